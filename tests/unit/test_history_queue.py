"""The history queue: step and log history committed behind ingest, in one transaction.

Real SQLite files: what is queued is not in the database until a drain, lands whole in one
commit (each run's steps as one packed row), survives a refused commit without stopping
the queue, and a queue that outgrows its bound drops its oldest rows and counts them.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from deadweight.proto import pb
from deadweight.sidecar.model.step_point import StepPoint
from deadweight.sidecar.store import history
from deadweight.sidecar.store.history_queue import HistoryQueue
from deadweight.sidecar.store.journal import RANKS, Store
from tests.support.realprocs import wait_for


def _steps(first: int, count: int) -> list[history.StoredStep]:
    """count consecutive steps as ingest keeps them (``history.encode_step``)."""
    rows: list[history.StoredStep] = []
    for step in range(first, first + count):
        report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=1e-6 * step,
                               watched_params=1024, optimizer_params=1024, watched_tensors=8)
        point = StepPoint.from_report(report, float(step))
        rows.append((step, float(step), history.encode_step(point, report, True)))
    return rows


def _commits(store: Store) -> list[str]:
    seen: list[str] = []
    store._db.set_trace_callback(  # the statements the store runs
        lambda sql: seen.append(sql) if sql.strip().upper() == "COMMIT" else None)
    return seen


def _packed_rows(store: Store, run_id: str) -> int:
    return len(store._read("SELECT 1 FROM step_batches WHERE run_id=?", (run_id,)))


def test_queued_history_lands_in_one_commit(tmp_path: Path) -> None:
    store = Store(tmp_path)
    queue = HistoryQueue(store)
    commits = _commits(store)
    queue.add_steps("a", _steps(1, 4))
    queue.add_logs("a", [(4, 4.0, {"loss": 1.5})])
    queue.add_steps("a", _steps(5, 4))
    queue.add_steps("b", _steps(1, 2))
    queue.add_logs("b", [(1, 1.0, {"loss": 2.5}), (2, 2.0, {"loss": 2.25})])
    queue.add_ranks("b", [(1, 1.0, {"slowest_over_next": 1.8})])  # a two-rank job's timing
    assert len(queue) == 14
    assert store.history("a", "step") == [] and store.history("b", "log") == []
    queue.flush()
    assert len(commits) == 1 and queue.commits == 1 and len(queue) == 0
    assert [s for s, _, _ in store.history("a", "step")] == list(range(1, 9))
    assert [s for s, _, _ in store.history("b", "step")] == [1, 2]
    assert _packed_rows(store, "a") == 1  # the interval's two batches: one packed row
    assert [f["loss"] for _, _, f in store.history("b", "log")] == [2.5, 2.25]
    assert [f["loss"] for _, _, f in store.history("a", "log")] == [1.5]
    assert store.history("b", RANKS) == [(1, 1.0, {"slowest_over_next": 1.8})]
    assert store.history("b", "log")[0][2] == {"loss": 2.5}  # a kind of its own: no overwrite
    queue.flush()  # nothing queued: nothing written
    assert len(commits) == 1


def test_a_refused_commit_is_counted_and_the_queue_goes_on(tmp_path: Path) -> None:
    store = Store(tmp_path)
    queue = HistoryQueue(store)
    store._db.execute("PRAGMA query_only = 1")  # SQLite refuses every write now
    queue.add_steps("a", _steps(1, 3))
    queue.flush()  # no exception reaches the caller
    assert store.write_failures == 1 and len(queue) == 0 and queue.commits == 0
    store._db.execute("PRAGMA query_only = 0")
    queue.add_steps("a", _steps(4, 2))
    queue.flush()
    assert [s for s, _, _ in store.history("a", "step")] == [4, 5]


def test_a_full_queue_drops_its_oldest_rows_and_counts_them(tmp_path: Path) -> None:
    store = Store(tmp_path)
    queue = HistoryQueue(store, max_rows=10)
    for first in (1, 5, 9, 13):
        queue.add_steps("a", _steps(first, 4))
    assert queue.dropped == 8 and len(queue) == 8
    queue.flush()
    assert [s for s, _, _ in store.history("a", "step")] == list(range(9, 17))


def test_its_thread_commits_unasked_and_stop_writes_the_rest(tmp_path: Path) -> None:
    store = Store(tmp_path)
    queue = HistoryQueue(store, interval=0.05)
    queue.start()
    try:
        queue.add_steps("a", _steps(1, 2))
        wait_for(lambda: store.history("a", "step"), 20, what="the queue's own commit")
        queue.add_steps("a", _steps(3, 2))  # written by the thread or, at the latest, by stop
    finally:
        queue.stop()
    assert [s for s, _, _ in store.history("a", "step")] == [1, 2, 3, 4]
    # another process reads what was committed (deadweight report reads the file)
    assert sqlite3.connect(store.path).execute(  # type: ignore[arg-type]
        "SELECT SUM(steps) FROM step_batches WHERE run_id='a'").fetchone() == (4,)


@pytest.mark.parametrize("rows", [0, 1])
def test_empty_batches_write_nothing(tmp_path: Path, rows: int) -> None:
    store = Store(tmp_path)
    queue = HistoryQueue(store)
    commits = _commits(store)
    queue.add_steps("a", _steps(1, rows))
    queue.add_logs("a", [])
    queue.flush()
    assert len(commits) == rows


def test_dropped_rows_are_exported() -> None:
    """A full queue's drops reach /metrics (``deadweight_history_rows_dropped_total``)."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from deadweight.sidecar.exposition.collector import DeadweightCollector
    from deadweight.sidecar.registry import Registry
    from tests.support.raw_client import healthy_events, run_start

    store = Store()
    queue = HistoryQueue(store, max_rows=3)  # not started: nothing drains it here
    registry = Registry(store=store, history_queue=queue)
    metrics = CollectorRegistry()
    metrics.register(DeadweightCollector(registry, None, registry.detectors))

    def dropped() -> float:
        for line in generate_latest(metrics).decode().splitlines():
            if line.startswith("deadweight_history_rows_dropped_total "):
                return float(line.split()[1])
        raise AssertionError("deadweight_history_rows_dropped_total is not exported")

    assert not registry.ingest(pb.StreamRequest(
        run_id="r", events=[pb.Event(seq=0, run_start=run_start())])).error
    assert dropped() == 0
    for step in range(1, 5):  # a step and a log each: 8 rows into a queue of 3
        assert not registry.ingest(pb.StreamRequest(
            run_id="r", events=healthy_events(step, 2 * step - 1))).error
    assert dropped() == queue.dropped > 0
    queue.flush()
    assert len(store.history("r", "step")) + len(store.history("r", "log")) == 8 - queue.dropped
