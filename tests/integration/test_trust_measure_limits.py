"""Issue 12, item 5, against a real ``deadweight serve``: what a real job keeps under a
heartbeat flood of a run with 1024 adapters x 1024 groups, and what a scraper gets while
idle connections hold every ``/metrics`` slot.

Behaviour only: the times are measured in ``bench/sidecar_trust.py``.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.exposition.http import MAX_CONNECTIONS
from deadweight.sidecar.model.limits import MAX_LIST_ENTRIES
from tests.support.faults import Pipe
from tests.support.raw_client import frozen_events
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

#: As many adapters and groups as the caps let one client send.
ADAPTERS = MAX_LIST_ENTRIES


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with SidecarProcess(tmp_path_factory.mktemp("trust-measure"),
                        policies={"frozen_weights": "stop"}) as process:
        yield process


class Flood(threading.Thread):
    """A run with 1024 adapters sending heartbeats, and every tenth batch a 1024-group step,
    as fast as the sidecar answers."""

    def __init__(self, sidecar: SidecarProcess, run_id: str) -> None:
        super().__init__(daemon=True)
        self.pipe = Pipe(sidecar.address)
        self.run_id = run_id
        self.stop = threading.Event()
        self.acked = 0
        self.errors: list[str] = []
        self.seq = 1
        adapters = [pb.AdapterCoverage(name=f"adapter-{i}", tensors=4, params=1000,
                                       in_optimizer_tensors=4, active=True)
                    for i in range(ADAPTERS)]
        start = pb.RunStart(trainer="SFTTrainer", world_size=1, membership=pb.OptimizerMembership(
            optimizer_params=ADAPTERS * 1000, trainable_params=ADAPTERS * 1000,
            adapter_params=ADAPTERS * 1000, adapter_tensors=4 * ADAPTERS, adapters=adapters))
        answer = self.pipe.send(pb.StreamRequest(run_id=run_id, events=[
            pb.Event(seq=self.seq, run_start=start)]))
        assert not answer.error, answer.error
        self.groups = [pb.GroupUpdate(name=f"adapter-{i}", kind="adapter", update_sq_sum=1e-9,
                                      tensors=4) for i in range(ADAPTERS)]
        self.step = 0

    def _batch(self, number: int) -> list[pb.Event]:
        if number % 10 == 0:
            self.seq += 1
            self.step += 1
            return [pb.Event(seq=self.seq, time_seconds=time.time(), step=pb.StepReport(
                step=self.step, learning_rate=1e-4, update_sq_sum=1e-6, param_sq_sum=1.0,
                watched_tensors=4 * ADAPTERS, watched_params=1000 * ADAPTERS,
                optimizer_params=1000 * ADAPTERS, groups=self.groups))]
        return [pb.Event(time_seconds=time.time(), heartbeat=pb.Heartbeat(step=self.step))]

    def run(self) -> None:
        number = 0
        while not self.stop.is_set():
            number += 1
            answer = self.pipe.send(pb.StreamRequest(run_id=self.run_id,
                                                     events=self._batch(number)))
            if answer.error:
                self.errors.append(answer.error)
            self.acked += 1

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        self.pipe.close()


def _firing(process: SidecarProcess, run_id: str, detector: str) -> bool:
    status = process.run_status(run_id)
    return status is not None and any(f.detector == detector and f.firing
                                      for f in status.findings)


def test_a_frozen_run_still_gets_its_verdict_under_a_1024_adapter_heartbeat_flood(
    sidecar: SidecarProcess,
) -> None:
    flood = Flood(sidecar, "flood")
    flood.start()
    job = Pipe(sidecar.address)
    try:
        wait_for(lambda: flood.acked >= 20, what="the flood to be under way")
        before = flood.acked
        answer = job.send(pb.StreamRequest(run_id="frozen-under-flood", events=[
            pb.Event(seq=1, run_start=pb.RunStart(
                trainer="SFTTrainer", world_size=1, membership=pb.OptimizerMembership(
                    optimizer_params=1000, trainable_params=1000, adapter_params=1000,
                    adapter_tensors=4)))]))
        assert not answer.error, answer.error
        directives: list[str] = []
        for step in range(1, 11):  # a frozen job, one optimizer step per batch
            answer = job.send(pb.StreamRequest(run_id="frozen-under-flood",
                                               events=frozen_events(step, 2 * step)))
            assert not answer.error, answer.error
            assert answer.ack_seq == 2 * step + 1  # nothing of the job was dropped
            directives += [pb.Directive.Action.Name(d.action) for d in answer.directives]
        wait_for(lambda: _firing(sidecar, "frozen-under-flood", "frozen_weights"),
                 what="the frozen verdict under the flood")
        if "ACTION_STOP" not in directives:  # the STOP rides on the job's next answer
            answer = job.send(pb.StreamRequest(run_id="frozen-under-flood",
                                               events=frozen_events(11, 22)))
            directives += [pb.Directive.Action.Name(d.action) for d in answer.directives]
        assert "ACTION_STOP" in directives
        assert flood.acked > before + 2, "the flood stalled while the job stepped"
        assert flood.is_alive() and not flood.errors, flood.errors[:3]
    finally:
        flood.finish()
        job.close()
    # The flooding run's state stayed bounded: at most 64 adapters kept per step.
    status = sidecar.run_status("flood")
    assert status is not None and status.step == flood.step


def _get(port: int) -> int:
    """HTTP status of one scrape: 200, or 503 from the connection cap."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            body = response.read()
            assert b"deadweight_sidecar_info" in body
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _closed_by_server(conn: socket.socket) -> bool:
    conn.settimeout(30)
    try:
        data = conn.recv(4096)
    except ConnectionResetError:
        return True
    return data == b"" or data.startswith(b"HTTP/1.0 503")


def test_a_scrape_is_served_or_cleanly_refused_while_idle_connections_fill_the_cap(
    sidecar: SidecarProcess,
) -> None:
    port = sidecar.metrics_port
    held = [socket.create_connection(("127.0.0.1", port), timeout=10)
            for _ in range(MAX_CONNECTIONS)]
    try:
        # Every slot is taken by a connection that never sends: a scrape gets a clean 503
        # (or is served, if a slot came free), never a hang or a reset.
        assert _get(port) in (200, 503)
        # Fifty parallel scrapers meanwhile: each answer is 200 or 503, and each scraper is
        # served in the end, while this side still holds the idle sockets open.
        outcomes: list[int] = []
        served: list[int] = []
        lock = threading.Lock()

        def scraper(index: int) -> None:
            def attempt() -> bool:
                code = _get(port)
                with lock:
                    outcomes.append(code)
                return code == 200

            wait_for(attempt, timeout=60, what=f"scraper {index} served")
            with lock:
                served.append(index)

        threads = [threading.Thread(target=scraper, args=(i,)) for i in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(served) == list(range(50))
        assert set(outcomes) <= {200, 503}, set(outcomes)
        # The idle connections were closed by the sidecar (read timeout), not by this side.
        assert all(_closed_by_server(conn) for conn in held)
    finally:
        for conn in held:
            conn.close()


def test_steps_of_a_1024_adapter_run_keep_64_adapters_in_memory() -> None:
    """The detector work per event is bounded because the state is: a step's adapter groups
    beyond the cap are not kept (read back through the in-process registry)."""
    from deadweight.sidecar.model.step_point import MAX_ADAPTERS_PER_STEP
    from deadweight.sidecar.registry import Registry

    registry = Registry()
    groups = [pb.GroupUpdate(name=f"adapter-{i}", kind="adapter", tensors=4)
              for i in range(ADAPTERS)]
    assert not registry.ingest(pb.StreamRequest(run_id="wide", events=[
        pb.Event(seq=1, run_start=pb.RunStart(trainer="SFTTrainer")),
        pb.Event(seq=2, step=pb.StepReport(step=1, learning_rate=1e-4, groups=groups))])).error
    run = registry.run("wide")
    assert run is not None
    assert len(run.ranks[0].steps[-1].adapter_updates) == MAX_ADAPTERS_PER_STEP < ADAPTERS
