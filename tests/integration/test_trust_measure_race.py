"""Issue 12, item 7: /metrics rendered while runs change must never fail (it was HTTP 500).

The exporter reads run state that ingest changes: rank dicts grow when a rank joins, step
deques turn over, log keys appear, runs end, expire and come back as new incarnations. A
reader iterating any of those while another thread changes it raises ("dictionary changed
size during iteration", "deque mutated during iteration"), and the HTTP server answers 500.

This stress test drives the real registry's ``ingest`` and ``tick`` from several threads
(exactly the calls the gRPC handlers and the ticker make) while other threads render
``/metrics`` with the real collector and text renderer, thousands of times. The thread switch
interval is shortened for the test so the threads interleave inside the render (the race
needs a switch mid-iteration; at the default 5 ms it happened in 3 of 931 scrapes). Without
the registry lock in ``DeadweightCollector.collect`` this test fails with hundreds of such
errors (see the closing note of issue 12); with it, none.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from deadweight.proto import pb
from deadweight.sidecar.exposition.collector import DeadweightCollector
from deadweight.sidecar.exposition.http import render
from deadweight.sidecar.registry import Registry

# thousands of renders under churn, about 30 s: timed, so run alone (.ci/run)
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

#: Renders the test requires (each one a full /metrics page).
RENDERS = 3000
RANKS = 4


def _start(sharded: bool) -> pb.Event:
    return pb.Event(seq=1, time_seconds=time.time(), run_start=pb.RunStart(
        trainer="SFTTrainer", world_size=RANKS, sharded=sharded,
        membership=pb.OptimizerMembership(optimizer_params=1000, trainable_params=1000,
                                          adapter_params=1000, adapter_tensors=4)))


def _steps(first: int, count: int, seq: int, fresh_key: str) -> list[pb.Event]:
    events = []
    for step in range(first, first + count):
        events.append(pb.Event(seq=seq, time_seconds=time.time(), step=pb.StepReport(
            step=step, learning_rate=1e-4, update_sq_sum=1e-6 * step, param_sq_sum=1.0,
            watched_tensors=4, watched_params=1000, optimizer_params=1000,
            groups=[pb.GroupUpdate(name="default", kind="adapter", update_sq_sum=1e-6,
                                   tensors=4)])))
        events.append(pb.Event(seq=seq + 1, time_seconds=time.time(), log=pb.LogReport(
            step=step, values={"loss": 2.0, "grad_norm": 0.5, "learning_rate": 1e-4,
                               fresh_key: float(step)})))
        seq += 2
    return events


def _churn(registry: Registry, worker: int, stop: threading.Event,
           lives: list[int]) -> None:
    """Runs that start, gain ranks, step, checkpoint, end and come back, until stop."""
    generation = 0
    while not stop.is_set():
        generation += 1
        lives.append(generation)
        run_id = f"churn-{worker}-{generation % 3}"  # ids come back: new incarnations
        sharded = generation % 2 == 0
        seqs = {}
        for rank in range(RANKS):  # ranks join one by one while steps flow
            registry.ingest(pb.StreamRequest(run_id=run_id, rank=rank,
                                             events=[_start(sharded)]))
            seqs[rank] = 2
            for joined in range(rank + 1):
                batch = _steps(1 + 40 * rank, 40, seqs[joined], f"key{generation}-{rank}")
                seqs[joined] += len(batch)
                registry.ingest(pb.StreamRequest(run_id=run_id, rank=joined, events=batch))
        registry.ingest(pb.StreamRequest(run_id=run_id, rank=0, events=[
            pb.Event(seq=seqs[0], checkpoint=pb.CheckpointReport(
                step=generation, path=f"/nowhere/{run_id}/checkpoint-{generation}",
                adapter=pb.AdapterDigest(combined="ab" * 16))),
            pb.Event(seq=seqs[0] + 1, run_end=pb.RunEnd(reason="done"))]))


def _tick(registry: Registry, stop: threading.Event) -> None:
    """The ticker: ended runs expire (TTL 0) while they are being rendered."""
    while not stop.is_set():
        registry.tick()


def _render(collector: DeadweightCollector, errors: Counter[str], renders: list[int],
            stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            # both outputs: the library's families and the /metrics page's text families
            page = render(collector.exposition() if len(renders) % 2 else collector.collect())
            assert b"deadweight_sidecar_info" in page
        except Exception as err:  # every failure is what this test counts
            errors[f"{type(err).__name__}: {err}"] += 1
        renders.append(1)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms, so renders and ingest interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def test_metrics_render_never_fails_while_runs_change(fast_switching: None) -> None:
    registry = Registry(ended_ttl_seconds=0.0, max_runs=64)
    collector = DeadweightCollector(registry, None, registry.detectors)
    stop = threading.Event()
    errors: Counter[str] = Counter()
    renders: list[int] = []
    lives: list[int] = []
    workers = [threading.Thread(target=_churn, args=(registry, w, stop, lives), daemon=True)
               for w in range(3)]
    workers.append(threading.Thread(target=_tick, args=(registry, stop), daemon=True))
    readers = [threading.Thread(target=_render, args=(collector, errors, renders, stop),
                                daemon=True) for _ in range(2)]
    for thread in workers + readers:
        thread.start()
    try:
        deadline = time.monotonic() + 600  # a bound on a hung test, not a measured time
        while len(renders) < RENDERS and time.monotonic() < deadline \
                and all(t.is_alive() for t in workers):
            time.sleep(0.05)  # polling a counter the readers advance
    finally:
        stop.set()
        for thread in workers + readers:
            thread.join(60)
    assert len(renders) >= RENDERS, f"only {len(renders)} renders"
    assert len(lives) >= 6, "the runs hardly changed during the renders"
    assert registry.rejected_batches == 0
    assert not errors, f"{sum(errors.values())} of {len(renders)} renders failed: " \
                       f"{errors.most_common(3)}"
