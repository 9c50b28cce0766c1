"""Resource bounds under attack, against a real ``deadweight serve``: idle /metrics sockets,
a Status answer over 4 MB, multi-megabyte log lines.

Each test performs the attack for real (hundreds of real TCP connections, a thousand runs
registered over the real unix socket, a client's megabytes of strings) and shows what held.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.exposition.http import MAX_CONNECTIONS
from deadweight.sidecar.registry import status_report as status
from tests.support.faults import Pipe
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Pipe]]:
    with SidecarProcess(tmp_path_factory.mktemp("trust-limits"),
                        extra_args=["--max-runs", "2000", "--max-runs-per-process", "2000",
                                    "--max-runs-per-uid", "2000"]) as process:
        pipe = Pipe(process.address)
        yield process, pipe
        pipe.close()


def _threads(process: SidecarProcess) -> int:
    assert process.process is not None
    text = Path(f"/proc/{process.process.pid}/status").read_text()
    return int(next(x.split()[1] for x in text.splitlines() if x.startswith("Threads:")))


def test_idle_metrics_connections_cost_bounded_threads_and_time_out(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    process, _ = sidecar
    before = _threads(process)
    idle = []
    for _ in range(200):  # connect and send nothing, as a slow or hostile client does
        conn = socket.create_connection(("127.0.0.1", process.metrics_port), timeout=10)
        idle.append(conn)
    try:
        # Never more than MAX_CONNECTIONS request threads, however many sockets are open.
        assert _threads(process) - before <= MAX_CONNECTIONS + 2
        # The idle sockets are closed by the sidecar (timeout, or 503 past the cap) ...
        for conn in idle:
            conn.settimeout(30)
            data = conn.recv(4096)
            assert data == b"" or data.startswith(b"HTTP/1.0 503"), data
        # ... after which a real scrape is served and the refusals are counted.
        text = wait_for(lambda: _scrape(process), what="a scrape served after the flood")
        refused = next(float(x.split()[-1]) for x in text.splitlines()
                       if x.startswith("deadweight_metrics_http_refused_total "))
        assert refused >= 200 - MAX_CONNECTIONS
        wait_for(lambda: _threads(process) - before <= 2, what="the request threads to end")
    finally:
        for conn in idle:
            conn.close()


def _scrape(process: SidecarProcess) -> str | None:
    try:
        return process.metrics()
    except OSError:
        return None


def test_status_over_4_mb_still_answers(sidecar: tuple[SidecarProcess, Pipe]) -> None:
    process, pipe = sidecar
    trainer = "T" * 4000  # the longest trainer name a client may send
    for i in range(1100):  # over 4 MB of Status before it was bounded
        assert not pipe.send(pb.StreamRequest(run_id=f"big-status-{i}", events=[pb.Event(
            run_start=pb.RunStart(trainer=trainer))])).error
    result = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", "status", "--address",
         process.address], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "big-status-1099" in result.stdout or "(omitted)" in result.stdout
    assert result.stdout.count("big-status-") >= 900


def test_a_bounded_status_counts_what_it_left_out() -> None:
    response = pb.StatusResponse(runs=[
        pb.RunStatus(run_id=f"r{i}", trainer="x" * 5000, last_seen_seconds=float(i),
                     findings=[pb.Finding(detector="d", summary="s" * 10_000,
                                          evidence={f"k{j}": "v" * 9000 for j in range(50)})])
        for i in range(100)])
    assert response.ByteSize() > 40_000_000
    out = status.bounded(response, limit=200_000)
    assert out.ByteSize() <= 200_000
    assert out.runs[0].run_id == "r0"  # the most recently seen first
    assert out.runs[-1].run_id.startswith(status.OMITTED_PREFIX)
    kept = len(out.runs) - 1
    assert f"{100 - kept} more runs" in out.runs[-1].run_id
    assert len(out.runs[0].findings[0].evidence) == status.MAX_STATUS_EVIDENCE


def test_log_lines_stay_bounded_when_a_client_sends_megabytes(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    process, pipe = sidecar
    modules = [f"m{i}" + "x" * 4000 for i in range(900)]  # 3.6 MB of unmatched target names
    start = pb.RunStart(trainer="SFTTrainer", preflight=pb.Preflight(
        is_peft=True, requested_target_modules=["q_proj"], unmatched_target_modules=modules))
    assert not pipe.send(pb.StreamRequest(run_id="huge-log", events=[pb.Event(
        run_start=start)])).error

    def fired_line() -> str | None:
        for raw in process.log_path.read_text(errors="replace").splitlines():
            if '"huge-log"' in raw and "partial_target_modules" in raw and "fired" in raw:
                return raw
        return None

    line = wait_for(fired_line, what="the partial_target_modules line")
    assert json.loads(line)["detector"] == "partial_target_modules"
    longest = max(len(x) for x in process.log_path.read_text(errors="replace").splitlines())
    assert longest < 300_000, longest


def test_a_client_digest_that_is_not_hex_never_becomes_a_label(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    process, pipe = sidecar
    hostile = 'ab"} 1\ndeadweight_fake{run_id="x'  # an injection attempt, 37 characters
    for run_id, digest in (("digest-hostile", hostile), ("digest-hex", "0123abcd" * 4)):
        assert not pipe.send(pb.StreamRequest(run_id=run_id, events=[
            pb.Event(run_start=pb.RunStart(trainer="SFTTrainer")),
            pb.Event(seq=1, checkpoint=pb.CheckpointReport(
                step=1, path=f"/nowhere/{run_id}/checkpoint-1",
                adapter=pb.AdapterDigest(combined=digest)))])).error
    text = process.metrics()
    lines = [x for x in text.splitlines() if x.startswith("deadweight_checkpoint_info{")]
    assert any('run_id="digest-hostile"' in x and 'digest="invalid"' in x for x in lines)
    assert any('run_id="digest-hex"' in x and 'digest="0123abcd' in x for x in lines)
    assert "deadweight_fake" not in text


def _rss_bytes(process: SidecarProcess) -> int:
    assert process.process is not None
    text = Path(f"/proc/{process.process.pid}/status").read_text()
    return int(next(x.split()[1] for x in text.splitlines() if x.startswith("VmRSS:"))) * 1024


def test_steps_with_a_thousand_long_adapter_groups_cost_bounded_memory(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    """5: 60 steps x 1024 adapter groups with 1 kB names: memory stays bounded (names are
    cut and shared, at most 64 adapters are kept per step)."""
    process, pipe = sidecar
    assert not pipe.send(pb.StreamRequest(run_id="groups", events=[pb.Event(
        run_start=pb.RunStart(trainer="SFTTrainer"))])).error
    groups = [pb.GroupUpdate(name=f"adapter-{i}-" + "n" * 1000, kind="adapter",
                             update_sq_sum=0.0, tensors=4, unchanged_tensors=4)
              for i in range(1024)]
    before = _rss_bytes(process)
    for step in range(1, 61):
        answer = pipe.send(pb.StreamRequest(run_id="groups", events=[pb.Event(
            seq=step, step=pb.StepReport(step=step, learning_rate=1e-4, param_sq_sum=1.0,
                                         watched_tensors=4, watched_params=1000,
                                         optimizer_params=1000, groups=groups))]))
        assert not answer.error
    grown = _rss_bytes(process) - before
    assert grown < 40 * 1024 * 1024, grown
