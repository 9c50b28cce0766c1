"""Property-based batches over a real socket into a real ``deadweight serve``.

One long-lived stream carries every generated batch; each must get an answer (an ack or a
clear error) on the same stream, the daemon must stay up, its memory must stay bounded and
its ``/metrics`` page must still parse.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from tests.support import wire_strategies as ws
from tests.support.faults import Pipe
from tests.unit.test_fuzz_registry import FUZZ

pytestmark = pytest.mark.slow

MAX_RUNS = 8


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Pipe]]:
    extra = ["--max-runs", str(MAX_RUNS)]
    with SidecarProcess(tmp_path_factory.mktemp("fuzzed"), extra_args=extra) as process:
        pipe = Pipe(process.address)
        yield process, pipe
        pipe.close()


@settings(FUZZ, max_examples=300)
@given(request=ws.requests, register_first=st.booleans())
def test_any_batch_over_the_socket_gets_an_answer(
    target: tuple[SidecarProcess, Pipe], request: pb.StreamRequest, register_first: bool
) -> None:
    _, pipe = target
    if register_first and len(request.run_id) <= 128:
        start = pb.RunStart(trainer="SFTTrainer")
        pipe.send(pb.StreamRequest(run_id=request.run_id, rank=request.rank,
                                   events=[pb.Event(run_start=start)]))
    answer = pipe.send(request)  # raises if the server broke the stream
    assert isinstance(answer, pb.StreamResponse)
    if not answer.error:  # the ack covers every sequence number of the batch (or more)
        assert answer.ack_seq >= max((e.seq for e in request.events), default=0)


def test_the_fuzzed_server_is_up_bounded_and_parseable(
    target: tuple[SidecarProcess, Pipe],
) -> None:
    process, pipe = target
    assert process.process is not None and process.process.poll() is None
    status = process.status()
    assert len(status.runs) <= MAX_RUNS
    families = list(text_string_to_metric_families(process.metrics()))
    assert any(f.name == "deadweight_sidecar_info" for f in families)
    rss = _rss_bytes(process.process.pid)
    assert rss < 512 * 1024 * 1024, f"sidecar RSS {rss / 2**20:.0f} MiB after fuzzing"
    answer = pipe.send(pb.StreamRequest(run_id="after-fuzz", events=[
        pb.Event(run_start=pb.RunStart(trainer="t"))]))
    assert answer.error in ("", f"sidecar already tracks {MAX_RUNS} live runs")
