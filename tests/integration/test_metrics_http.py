"""The /metrics renderer says exactly what the client library's encoder says, faster."""

from __future__ import annotations

import math
import os
import socket
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.proto.transport import attest_path
from deadweight.sidecar.detectors.frozen import _frozen_streak, run_family
from deadweight.sidecar.exposition.collector import DeadweightCollector
from deadweight.sidecar.exposition.http import MetricsServer, render
from deadweight.sidecar.registry import Registry
from tests.support.trust_client import attest_as


class _Awkward(Collector):
    """Families with every value and label the text format has to escape or spell out."""

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("dw_gauge", 'help with "quotes" \\ and\nnewline',
                                  labels=["trainer", "run_id"])  # not in sorted order
        gauge.add_metric(["T", 'run "a"\\b\nc'], 1.5)
        gauge.add_metric(["T", "nan"], math.nan)
        gauge.add_metric(["T", "inf"], math.inf)
        gauge.add_metric(["T", "-inf"], -math.inf)
        gauge.add_metric(["T", "tiny"], 1e-300)
        gauge.add_metric(["T", "int"], 3.0)
        yield gauge
        counter = CounterMetricFamily("dw_events", "a counter", labels=["rank"])
        counter.add_metric(["0"], 7.0)
        yield counter
        bare = GaugeMetricFamily("dw_bare", "no labels", value=2.0)
        yield bare


def test_render_matches_the_client_library_byte_for_byte() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Awkward())
    assert render(_Awkward().collect()) == generate_latest(registry)


def test_server_answers_metrics_and_404_elsewhere() -> None:
    server = MetricsServer("127.0.0.1", 0, _Awkward().collect)
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert b"dw_events_total" in response.read()
        try:
            urllib.request.urlopen(f"{url}/nope", timeout=5)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as err:
            assert err.code == 404
    finally:
        server.stop()


def _steps(run_id: str, first: int, count: int, moved: bool) -> pb.StreamRequest:
    events = [pb.Event(seq=step, step=pb.StepReport(
        step=step, learning_rate=1e-4, update_sq_sum=1e-6 if moved else 0.0, param_sq_sum=1.0,
        watched_tensors=4, watched_params=1000, optimizer_params=1000,
        unchanged_tensors=0 if moved else 4)) for step in range(first, first + count)]
    # the trainer's log: a finite loss and a flowing gradient (frozen weights then fire)
    events.append(pb.Event(seq=first + count, log=pb.LogReport(
        step=first + count - 1, values={"loss": 1.0, "grad_norm": 0.5})))
    return pb.StreamRequest(run_id=run_id, events=events)


def test_the_sidecar_page_matches_the_client_library_as_verdicts_come_and_go() -> None:
    # /metrics writes the detector-firing family from cached per-run blocks: the page must
    # stay byte-identical to the library's encoding of the same collector, scrape after scrape.
    registry = Registry()
    collector = DeadweightCollector(registry, None, registry.detectors)
    library = CollectorRegistry(auto_describe=False)
    library.register(collector)
    run_ids = ["healthy", 'odd "run"\\id', "frozen"]
    for run_id in run_ids:
        start = pb.RunStart(trainer="SFTTrainer", config={"learning_rate": 1e-4})
        assert not registry.ingest(pb.StreamRequest(
            run_id=run_id, events=[pb.Event(seq=0, run_start=start)])).error
    pages = []
    for first, count in ((1, 2), (4, 40)):
        for run_id in run_ids:
            assert not registry.ingest(_steps(run_id, first, count, run_id != "frozen")).error
        page = render(collector.exposition())
        assert page == generate_latest(library)
        pages.append(page.decode())
    firing = [{line for line in page.splitlines()
               if line.startswith("deadweight_detector_firing{") and line.endswith(" 1.0")}
              for page in pages]
    came = firing[1] - firing[0]  # a verdict came: the run's cached block was replaced
    assert came and all('run_id="frozen"' in line for line in came)
    assert 'run_id="odd \\"run\\"\\\\id"' in pages[1]


def _start(run_id: str, rank: int, world: int, sharded: bool) -> pb.StreamRequest:
    start = pb.RunStart(trainer='T "x"', world_size=world, sharded=sharded,
                        config={"learning_rate": 1e-4},
                        membership=pb.OptimizerMembership(
                            optimizer_params=12_345_678, trainable_params=12_345_678,
                            adapter_params=12_345_678, adapter_tensors=4))
    return pb.StreamRequest(run_id=run_id, rank=rank, events=[pb.Event(
        seq=1, time_seconds=1_700_000_000.25, run_start=start)])


def _step(seq: int, step: int, lr: float, moved: bool, skipped: bool = False) -> pb.Event:
    return pb.Event(seq=seq, time_seconds=1_700_000_000.5 + step, step=pb.StepReport(
        step=step, learning_rate=lr, update_sq_sum=1e-6 * step if moved else 0.0,
        param_sq_sum=1.0, watched_tensors=4, watched_params=1000, optimizer_params=1000,
        unchanged_tensors=0 if moved else 4, grad_not_in_optimizer_params=7 * step,
        optimizer_step_skipped=skipped))


def test_the_page_matches_the_library_for_every_kind_of_run_figure() -> None:
    # Ranks (one run sharded over two), checkpoints with a digest label, values the text format
    # spells specially (NaN, infinities, -0.0, a million and up), an ended run: the page
    # written from cached label text equals the library's encoding, scrape after scrape.
    registry = Registry()
    collector = DeadweightCollector(registry, None, registry.detectors)
    library = CollectorRegistry(auto_describe=False)
    library.register(collector)
    for run_id, world, sharded in (("solo", 1, False), ("sharded", 2, True),
                                   ("replicated", 2, False)):
        for rank in range(world):
            assert not registry.ingest(_start(run_id, rank, world, sharded)).error
            assert not registry.ingest(pb.StreamRequest(run_id=run_id, rank=rank, events=[
                _step(2 + i, 1 + i, 1e-4, moved=True) for i in range(3)])).error
    logs = [{"loss": -0.0, "kl": math.nan, "reward": math.inf, "entropy": -math.inf,
             "completions/mean_length": 2_500_000.0, "grad_norm": 0.5},
            {"loss": 0.0, "kl": 1e-300, "reward": -1.5, "entropy": 1e21,
             "completions/mean_length": 2_500_001.0, "grad_norm": -0.0}]
    for round_, values in enumerate(logs):
        seq = 10 + 10 * round_
        assert not registry.ingest(pb.StreamRequest(run_id="solo", events=[
            pb.Event(seq=seq, log=pb.LogReport(step=3, values=values)),
            pb.Event(seq=seq + 1, checkpoint=pb.CheckpointReport(
                step=3, path=f"/nowhere/solo/checkpoint-{round_}",
                adapter=pb.AdapterDigest(combined=f"{round_}f" * 16, bytes=3_000_000)))]
        )).error
        if round_ == 1:
            assert not registry.ingest(pb.StreamRequest(run_id="replicated", events=[
                pb.Event(seq=30, run_end=pb.RunEnd(step=3, reason="done"))])).error
        page = render(collector.exposition())
        assert page == generate_latest(library)
    text = page.decode()
    # The ended run's id is used again by another trainer: a new incarnation, new label text.
    again = pb.RunStart(trainer="GRPOTrainer", world_size=1)
    assert not registry.ingest(pb.StreamRequest(run_id="replicated", events=[
        pb.Event(seq=1, run_start=again), _step(2, 1, 1e-4, moved=True)])).error
    later = render(collector.exposition())
    assert later == generate_latest(library)
    assert b'deadweight_step{rank="0",run_id="replicated",trainer="GRPOTrainer"} 1.0' in later
    assert 'deadweight_loss{run_id="solo",trainer="T \\"x\\""} 0.0' in text  # was -0.0
    assert 'deadweight_grad_norm{run_id="solo",trainer="T \\"x\\""} 0.0\n' in text  # -0.0 sent
    assert 'rank="1",run_id="sharded"' in text
    assert 'deadweight_run_active{run_id="replicated",trainer="T \\"x\\""} 0.0' in text
    assert "deadweight_optimizer_params{" in text and "1.2345678e+07" in text


def test_frozen_steps_count_back_from_the_newest_step_as_the_detector_does() -> None:
    # Steps at lr 0 and skipped steps neither count nor break the streak; a moving step ends it.
    registry = Registry()
    collector = DeadweightCollector(registry, None, registry.detectors)
    assert not registry.ingest(_start("run", 0, 1, False)).error
    plan = [(1e-4, True, False)] * 3 + [(1e-4, False, False)] * 2 + [(0.0, False, False)] \
        + [(1e-4, True, True)] + [(1e-4, False, False)] * 3 + [(0.0, True, False)]
    events = [_step(2 + i, 1 + i, lr, moved, skipped)
              for i, (lr, moved, skipped) in enumerate(plan)]
    assert not registry.ingest(pb.StreamRequest(run_id="run", events=events)).error
    run = registry.run("run")
    assert run is not None
    counted = [p for p in run.combined_steps() if p.learning_rate > 0 and not p.skipped]
    assert registry.frozen_streak(run) == len(_frozen_streak(counted, registry.settings,
                                                                   run_family(run))) == 5
    page = render(collector.exposition()).decode()
    assert 'deadweight_frozen_steps{run_id="run",trainer="T \\"x\\""} 5.0\n' in page
    assert run.frozen_streak_memo is not None and run.frozen_streak_memo[2] == 5
    again = render(collector.exposition()).decode()  # the next scrape, from the memo
    assert 'deadweight_frozen_steps{run_id="run",trainer="T \\"x\\""} 5.0\n' in again
    assert not registry.ingest(pb.StreamRequest(run_id="run", events=[
        _step(2 + len(plan), 1 + len(plan), 1e-4, moved=True)])).error
    page = render(collector.exposition()).decode()
    assert 'deadweight_frozen_steps{run_id="run",trainer="T \\"x\\""} 0.0\n' in page


def _attest_refused(process: SidecarProcess) -> float:
    return next(float(line.split()[-1]) for line in process.metrics().splitlines()
                if line.startswith("deadweight_attestation_refused_connections_total "))


@pytest.mark.slow
def test_attest_connections_of_another_uid_are_closed_and_counted() -> None:
    # A process of a uid that may not report (not the sidecar's own nor root: the default
    # trainer uids) connects to .attest: closed with no answer, and counted on /metrics.
    from bench.attest_flood import OTHER_UID

    folder = Path(tempfile.mkdtemp(prefix="deadweight-attest-count-", dir="/tmp"))
    os.chmod(folder, 0o755)  # the other uid reaches the socket through its group
    with SidecarProcess(folder / "sidecar") as process:
        assert _attest_refused(process) == 0.0
        assert fetch_attestation(str(process.socket_path))  # our own uid: a nonce, not counted
        for _ in range(2):
            probe = attest_as(OTHER_UID, attest_path(process.socket_path))
            assert probe.stdout.strip() == "b''", probe
        # The count is taken when the listener closes the connection, which the probe saw.
        assert _attest_refused(process) == 2.0


def test_a_silent_connection_holding_the_kept_thread_does_not_hold_up_a_scrape() -> None:
    # The one kept request thread is busy waiting on a client that sends nothing; a scrape
    # meanwhile gets a thread of its own and is answered while that connection is still open
    # (served after the silent one timed out, it would find that connection closed).
    server = MetricsServer("127.0.0.1", 0, _Awkward().collect)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:  # the kept thread exists
            assert response.status == 200
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        try:
            for _ in range(3):
                with urllib.request.urlopen(url, timeout=30) as response:
                    assert b"dw_events_total" in response.read()
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):  # no data, and not closed (that reads b"")
                silent.recv(1)
        finally:
            silent.close()
    finally:
        server.stop()
