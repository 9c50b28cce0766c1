"""The registry never writes to SQLite while it holds its lock, and keeps each run's order."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deadweight.proto import pb
from deadweight.sidecar.actions.policy import Actions
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.support.raw_client import frozen_events, healthy_events, run_start

#: Generous bound on waits that only fail when something is blocked (a deadlock, not speed).
STUCK_SECONDS = 60.0


class GatedStore(Store):
    """A real store whose writes for one run wait until the test opens the gate."""

    def __init__(self, slow_run: str) -> None:
        super().__init__()
        self.slow_run = slow_run
        self.writing = threading.Event()
        self.gate = threading.Event()

    def upsert_run(self, run_id: str, trainer: str, start: pb.RunStart) -> None:
        if run_id == self.slow_run:
            self.writing.set()
            assert self.gate.wait(STUCK_SECONDS), "the test never opened the gate"
        super().upsert_run(run_id, trainer, start)


def _start(run_id: str) -> pb.StreamRequest:
    return pb.StreamRequest(run_id=run_id, rank=0, events=[pb.Event(seq=0, run_start=run_start())])


def test_a_blocked_write_blocks_neither_readers_nor_other_runs() -> None:
    store = GatedStore("slow")
    registry = Registry(store=store)
    with ThreadPoolExecutor(max_workers=2) as pool:
        slow = pool.submit(registry.ingest, _start("slow"))
        assert store.writing.wait(STUCK_SECONDS)  # the slow run's write is under way
        # While it waits: readers answer, and another run registers and steps.
        assert {run.run_id for run, _ in registry.runs()} == {"slow"}
        assert registry.status().runs[0].run_id == "slow"
        other = pool.submit(registry.ingest, _start("fast")).result(STUCK_SECONDS)
        assert not other.error and other.ack_seq == 0
        stepped = pool.submit(registry.ingest, pb.StreamRequest(
            run_id="fast", rank=0, events=healthy_events(1, 1))).result(STUCK_SECONDS)
        assert not stepped.error and stepped.ack_seq == 2
        assert [r.run_id for r in store.runs()] == ["fast"]  # "slow" is not written yet
        assert not slow.done()
        store.gate.set()
        assert not slow.result(STUCK_SECONDS).error
    assert sorted(r.run_id for r in store.runs()) == ["fast", "slow"]


def test_the_batch_that_fires_still_gets_its_stop_and_the_journal_keeps_the_order(
        tmp_path: Path) -> None:
    from deadweight.sidecar.detectors.base import Policy

    store = Store(tmp_path)
    registry = Registry(Actions(store=store), policies={"frozen_weights": Policy.STOP},
                        store=store)
    registry.ingest(_start("r"))
    directives = []
    for step in range(1, 5):
        directives += registry.ingest(pb.StreamRequest(
            run_id="r", rank=0, events=frozen_events(step, 2 * step - 1))).directives
    assert [d.action for d in directives] == [pb.Directive.ACTION_STOP]
    registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=[
        pb.Event(seq=99, run_end=pb.RunEnd(step=4, reason="completed"))]))
    (incident,) = [i for i in store.incidents("r") if i.detector == "frozen_weights"]
    assert incident.incident == 1 and incident.resolved_at is not None  # opened, then resolved
    (run,) = store.runs()
    assert run.ended and run.end_reason == "completed"
    journal = [(a.action, a.result) for a in store.actions("r", "frozen_weights")]
    assert journal == [("page", "no_pager"), ("stop", "sent")]


def test_incident_numbers_continue_across_a_restart_and_a_reused_run_id(
        tmp_path: Path) -> None:
    def fire_and_end(registry: Registry) -> None:
        registry.ingest(_start("r"))
        registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=[
            e for step in range(1, 5) for e in frozen_events(step, 2 * step - 1)]))
        registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=[
            pb.Event(seq=99, run_end=pb.RunEnd(step=4, reason="completed"))]))

    store = Store(tmp_path)
    fire_and_end(Registry(store=store))
    store.close()  # the sidecar dies; the next one forgets the ended run (TTL 0)
    store = Store(tmp_path)
    registry = Registry(store=store, ended_ttl_seconds=0.0)
    registry.resume()
    fire_and_end(registry)
    numbers = [i.incident for i in store.incidents("r") if i.detector == "frozen_weights"]
    assert numbers == [1, 2]


def test_over_the_socket_a_blocked_write_stalls_no_other_stream(tmp_path: Path) -> None:
    from tests.support.faults import Pipe
    from tests.support.inprocess_sidecar import InProcessSidecar

    store = GatedStore("slow")
    sidecar = InProcessSidecar(tmp_path / "dw.sock", Registry(store=store)).start()
    slow_pipe, fast_pipe = Pipe(sidecar.address), Pipe(sidecar.address)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(slow_pipe.send, _start("slow"))
            assert store.writing.wait(STUCK_SECONDS)
            assert not fast_pipe.send(_start("fast")).error
            answer = fast_pipe.send(pb.StreamRequest(run_id="fast", rank=0,
                                                     events=healthy_events(1, 1)))
            assert not answer.error and answer.ack_seq == 2
            assert not slow.done()
            store.gate.set()
            assert not slow.result(STUCK_SECONDS).error
    finally:
        store.gate.set()
        slow_pipe.close()
        fast_pipe.close()
        sidecar.stop()
