"""Step and log history written behind ingest, a few times a second, in one transaction.

Written at every batch, a run's history was one or two SQLite commits on the thread that
ingested the batch: most of what a small batch costs beyond its records, and the reason a
batch could not be answered on the event loop (a commit may wait on the disk). The registry
now queues the rows (under its lock: an append, no SQLite) and one thread commits whatever
is queued, every ``interval`` seconds, each run's steps of that interval as one packed row.

History feeds ``deadweight report`` only. A crash loses at most the last interval's rows;
incidents, actions, bindings and checkpoints are written before their batch is answered, as
before. A queue that outgrows ``max_rows`` (a disk slower than the runs) drops its oldest
rows and counts them (``dropped``), rather than growing without bound.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import structlog

from . import history
from .journal import Life, LoggedFigures, Store, StoreWriteFailed

log = structlog.get_logger("deadweight.history")

#: Seconds between two commits of the queued history.
INTERVAL_SECONDS = 0.25
#: Rows (steps and logs) the queue holds at most before dropping its oldest.
MAX_QUEUED_ROWS = 200_000

#: What is queued, in arrival order: ((run id, incarnation), steps or None, logs or None,
#: rank timings or None).
_Queued = tuple[Life, Sequence[history.StoredStep] | None, Sequence[LoggedFigures] | None,
                Sequence[LoggedFigures] | None]


class HistoryQueue:
    """History rows queued by ingest and committed together by one thread."""

    def __init__(self, store: Store, interval: float = INTERVAL_SECONDS,
                 max_rows: int = MAX_QUEUED_ROWS) -> None:
        self.store = store
        self.interval = interval
        self.max_rows = max_rows
        #: Rows dropped because the queue was full (their disk could not keep up).
        self.dropped = 0
        #: Commits done (each holds every row queued since the one before).
        self.commits = 0
        self._queue: deque[_Queued] = deque()
        self._rows = 0
        self._lock = threading.Lock()  # the queue's, never held around SQLite
        self._write = threading.Lock()  # one drain at a time, in queue order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_steps(self, run_id: str, rows: Sequence[history.StoredStep],
                  incarnation: int = 1) -> None:
        """Queue a batch's steps (``history.encode_step`` each); O(1), no I/O."""
        self._add(((run_id, incarnation), rows, None, None), len(rows))

    def add_logs(self, run_id: str, logs: Sequence[LoggedFigures],
                 incarnation: int = 1) -> None:
        """Queue a batch's logs, (step, time, figures) each; O(1), no I/O."""
        self._add(((run_id, incarnation), None, logs, None), len(logs))

    def add_ranks(self, run_id: str, rows: Sequence[LoggedFigures],
                  incarnation: int = 1) -> None:
        """Queue a batch's rank timings (``journal.RANKS``); O(1), no I/O."""
        self._add(((run_id, incarnation), None, None, rows), len(rows))

    def _add(self, item: _Queued, rows: int) -> None:
        with self._lock:
            self._queue.append(item)
            self._rows += rows
            while self._rows > self.max_rows and len(self._queue) > 1:
                _, steps, logs, ranks = self._queue.popleft()
                lost = len(steps or ()) + len(logs or ()) + len(ranks or ())
                self._rows -= lost
                self.dropped += lost

    def __len__(self) -> int:
        """Rows queued and not yet written."""
        return self._rows

    def flush(self) -> None:
        """Write everything queued now, in one transaction (its own thread does this every
        interval; ``stop`` does it a last time)."""
        with self._write:
            with self._lock:
                queued, self._queue = self._queue, deque()
                self._rows = 0
            if not queued:
                return
            try:
                self.store.write_history(*_merged(queued))
                self.commits += 1
            except StoreWriteFailed:  # counted and logged by the store: these rows are lost
                log.warning("history_not_written", rows=sum(
                    len(s or ()) + len(g or ()) + len(r or ()) for _, s, g, r in queued))

    def start(self) -> None:
        """Commit the queue every interval on a thread of its own."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="deadweight-history",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and write what is still queued."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # the next interval tries again with what is queued then
                log.exception("history_flush_failed")


def _merged(queued: Sequence[_Queued]) -> tuple[
        list[tuple[Life, list[history.StoredStep]]], list[tuple[Life, list[LoggedFigures]]],
        list[tuple[Life, list[LoggedFigures]]]]:
    """Each life's steps, logs and rank timings of the interval, in arrival order: one
    packed row of steps per (run id, incarnation) (a step sent twice: the later one wins
    when read, as before; a run id's two lives in one interval stay two)."""
    steps: dict[Life, list[history.StoredStep]] = {}
    logs: dict[Life, list[LoggedFigures]] = {}
    ranks: dict[Life, list[LoggedFigures]] = {}
    for life, run_steps, run_logs, run_ranks in queued:
        if run_steps:
            steps.setdefault(life, []).extend(run_steps)
        if run_logs:
            logs.setdefault(life, []).extend(run_logs)
        if run_ranks:
            ranks.setdefault(life, []).extend(run_ranks)
    return list(steps.items()), list(logs.items()), list(ranks.items())
