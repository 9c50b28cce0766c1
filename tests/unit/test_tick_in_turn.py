"""The server's periodic tick evaluates one run at a time on the event loop.

A tick over every run under one lock hold kept each stream waiting for all of it: with 1,000
runs of 256 steps, about 100 ms every second. ``tick_in_turn`` takes the lock for one run at a
time, lets the streams ready meanwhile go first between two runs, waits for real now and then
(gRPC's threads need the interpreter lock to hand a stream's message over), and never waits
on the registry lock (it tries again, as a batch does).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from deadweight.proto import pb
from deadweight.sidecar.ingest import server
from deadweight.sidecar.ingest.server import tick_in_turn
from deadweight.sidecar.model.run_state import RunState
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.registry.run_table import RunEntry
from deadweight.sidecar.store.journal import Store
from tests.support.faults import Pipe
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import wait_for

RUNS = 4


class Runs:
    """RUNS live runs in a registry, and their states, read without the lock (which a test
    may hold in another thread)."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()
        for run in range(RUNS):
            response = self.registry.ingest(pb.StreamRequest(run_id=f"run-{run}", rank=0, events=[
                pb.Event(run_start=pb.RunStart(trainer="SFTTrainer")),
                pb.Event(seq=1, step=pb.StepReport(step=1, learning_rate=1e-4,
                                                   update_sq_sum=1e-6, watched_params=10,
                                                   optimizer_params=10))]))
            assert not response.error, response.error
        self.states: list[RunState] = [run for run, _ in self.registry.runs()]
        #: The tick's time: later than every evaluation at ingest, within the silent window.
        self.now = time.time() + 1.0

    def ticked(self) -> int:
        """How many runs this tick has evaluated so far."""
        return sum(run.evaluated_at == self.now for run in self.states)


def test_streams_are_served_between_two_runs_of_a_tick() -> None:
    runs = Runs()
    seen: list[int] = []

    async def main() -> None:
        done = asyncio.Event()

        async def observer() -> None:  # stands for the streams served meanwhile
            while not done.is_set():
                seen.append(runs.ticked())
                await asyncio.sleep(0)

        watching = asyncio.create_task(observer())
        await asyncio.sleep(0)
        await tick_in_turn(runs.registry, runs.now)
        done.set()
        await watching

    asyncio.run(main())
    assert runs.ticked() == RUNS
    # in one go, the loop would only ever see none or all of the runs ticked
    assert set(range(1, RUNS)) <= set(seen), seen


def test_the_tick_waits_for_the_lock_without_stopping_the_loop() -> None:
    runs = Runs()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with runs.registry.lock:
            held.set()
            release.wait(30)

    tries: list[bool] = []
    start = runs.registry.tick_started

    def tick_started(now: float, wait: bool = True) -> list[RunEntry] | None:
        entries = start(now, wait)  # the registry's own, counted
        tries.append(entries is not None)
        return entries

    runs.registry.tick_started = tick_started  # type: ignore[method-assign]

    async def main() -> tuple[int, int]:
        tick = asyncio.create_task(tick_in_turn(runs.registry, runs.now))
        turns = 0
        deadline = time.monotonic() + 30  # a bound on a hung test, not a measured time
        while len(tries) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0)  # this loop turns while the tick tries again and again
            turns += 1
        during = runs.ticked()
        assert tries == [False, False, False] and not tick.done()
        release.set()
        await asyncio.wait_for(tick, 30)
        return turns, during

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(30)
        turns, during = asyncio.run(main())
    finally:
        release.set()
        thread.join()
    assert turns > 3 and (during, runs.ticked(), tries[-1]) == (0, RUNS, True)


def test_a_stream_is_answered_while_the_server_ticks_many_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's own tick over a real socket: with a real wait after every run (turns of
    0 s), a tick of 400 runs lasts over 0.4 s, and a batch sent during it is answered
    before it ends. A tick in one go answers it only after its last run."""
    monkeypatch.setattr(server, "TICK_TURN_SECONDS", 0.0)
    registry = Registry(max_runs=500, max_ranks=500, allow_unattested=True)
    for run in range(400):
        response = registry.ingest(pb.StreamRequest(run_id=f"many-{run}", rank=0, events=[
            pb.Event(run_start=pb.RunStart(trainer="SFTTrainer"))]))
        assert not response.error, response.error
    states = [run for run, _ in registry.runs()]
    sidecar = InProcessSidecar(tmp_path / "dw.sock", registry).start()
    pipe = Pipe(sidecar.address, attest=False)
    try:
        assert not pipe.send(pb.StreamRequest(run_id="streaming", rank=0, events=[
            pb.Event(run_start=pb.RunStart(trainer="SFTTrainer"))])).error

        ingested = max(run.evaluated_at for run in states)

        def ticked() -> int:  # runs the first tick has reached so far
            return sum(run.evaluated_at > ingested for run in states)

        wait_for(lambda: 0 < ticked() < 100, 30, what="the first tick under way", interval=0.001)
        answer = pipe.send(pb.StreamRequest(run_id="streaming", rank=0, events=[
            pb.Event(seq=1, step=pb.StepReport(step=1, learning_rate=1e-4))]))
        assert answer.ack_seq == 1
        assert ticked() < len(states), "answered only once the tick was over"
    finally:
        pipe.close()
        sidecar.stop()


def test_a_tick_cancelled_part_way_journals_what_it_decided(tmp_path: Path) -> None:
    """The sidecar stopping mid-tick (its ticker task cancelled): the incidents the tick fired
    for the runs it reached are journaled all the same, as the tick in a worker thread did."""
    store = Store(tmp_path / "state")
    runs = Runs(Registry(store=store))
    runs.now += 1000.0  # past stalled_seconds (300 s) since the runs last reported

    async def main() -> None:
        tick = asyncio.create_task(tick_in_turn(runs.registry, runs.now))
        while runs.ticked() == 0:
            await asyncio.sleep(0)
        tick.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tick

    asyncio.run(main())
    reached = [run.run_id for run in runs.states if run.evaluated_at == runs.now]
    assert 0 < len(reached) < RUNS, reached  # cancelled part way
    for run in runs.states:  # (the rest of what fired did so at ingest)
        stalled = "stalled" in {i.detector for i in store.incidents(run.run_id)}
        assert stalled == (run.run_id in reached), run.run_id
