"""The one pager outbox every destination goes through (Alertmanager, each webhook).

A page is journaled (``Store.add_delivery``) before its first attempt, one row per
destination, and settled only when that destination acknowledged it with a 2xx: a page in
flight when the sidecar is killed, or still failing when it is stopped, goes again after the
restart (``restore``) with the same idempotency key. Each destination has its own queue and
thread (``DestinationWorker``), so a slow or dead receiver delays no other destination; every
attempt runs under one total deadline and refuses redirects (``deadline_post``); a failed
delivery is tried again with exponential backoff until acknowledged, and its later neighbours
go meanwhile. After ``max_attempts`` the page is told ``failed`` (its journal row says so;
a later acknowledgement tells ``delivered``). Attempts, failures, the last success, the queue
and the age of its oldest unacknowledged delivery are kept in the destination's
``TargetHealth`` for ``/metrics`` (``DeadweightPagerFailing``).

What a destination sends is its ``Encoding``: the body of a batch, whether a newer delivery
of the same alert replaces a queued one, and the re-assertions due (Alertmanager's firing
alerts, re-sent with a fresh endsAt so they never expire into "resolved").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from ..store.journal import StoredDelivery, StoreWriteFailed
from .deadline_post import PostResult, post
from .pager_health import DEFAULT_ATTEMPTS, DELIVERED, FAILED, Outcome, TargetHealth

log = structlog.get_logger("deadweight.pager")

#: What a delivery asks of its destination.
FIRE = "fire"
RESOLVE = "resolve"
#: How a journaled delivery that will not be tried again was settled.
SUPERSEDED = "superseded"
DROPPED = "dropped"

#: An alert's identity in a destination's queue: (run_id, detector).
AlertKey = tuple[str, str]


class Journal(Protocol):
    """Where deliveries are kept until acknowledged (``store.journal.Store``)."""

    def add_delivery(self, destination: str, idempotency_key: str, page: int | None,
                     run_id: str, detector: str, kind: str, payload: dict[str, Any],
                     created: float) -> int: ...

    def delivery_tried(self, delivery_id: int, error: str) -> None: ...

    def settle_deliveries(self, delivery_ids: Sequence[int], result: str) -> None: ...

    def open_deliveries(self, destination: str) -> list[StoredDelivery]: ...


@dataclass(eq=False)  # one delivery each: found in the queue by identity
class Delivery:
    """One page, resolution or re-assertion for one destination."""

    alert: AlertKey
    kind: str
    payload: dict[str, Any]
    idempotency_key: str
    created: float  # unix seconds
    #: The page's action id in the journal (None: a resolution or a re-assertion).
    page: int | None = None
    on_result: Outcome | None = None
    #: False: a re-assertion, rebuilt from the open incidents at each start (not journaled).
    journaled: bool = True
    row: int = 0  # its journal row (0: none)
    attempts: int = 0
    next_try: float = 0.0  # monotonic seconds
    told: str = ""


def idempotency_key(destination: str, run_id: str, detector: str, kind: str,
                    started: float, page: int | None) -> str:
    """The same key for every attempt of one delivery, before and after a restart."""
    text = f"{destination}\0{run_id}\0{detector}\0{kind}\0{started:.3f}\0{page}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Encoding(Protocol):
    """What one kind of destination sends."""

    #: A newer delivery of an alert replaces its queued one (the receiver keeps state).
    coalesce: bool
    #: Deliveries per POST.
    batch: int
    #: The log event of a failed attempt.
    failure_event: str

    def body(self, deliveries: Sequence[Delivery], now: float) -> object: ...

    def refresh(self, now: float) -> list[Delivery]: ...


@dataclass(frozen=True)
class Timing:
    """The outbox's clocks (``deadweight serve --pager-*``; tests make them short)."""

    #: One attempt, connecting to the last byte of the answer.
    deadline: float = 10.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    #: Attempts before a page is told failed (it is still tried until acknowledged).
    max_attempts: int = DEFAULT_ATTEMPTS
    #: How often re-assertions are due (Alertmanager: firing alerts re-sent).
    reassert_interval: float = 60.0
    #: Queued deliveries kept; past it the oldest is dropped (and told failed).
    max_pending: int = 10_000


def destination_key(kind: str, url: str) -> str:
    """A destination's name in the journal: its kind and a digest of its URL (the URL may
    carry a secret; the digest finds the same destination again after a restart)."""
    return f"{kind}:{hashlib.sha256(url.encode()).hexdigest()[:16]}"


class DestinationWorker:
    """One destination's queue and the thread that delivers it."""

    def __init__(self, url: str, destination: str, health: TargetHealth, encoding: Encoding,
                 timing: Timing, journal: Journal | None = None, name: str = "pager") -> None:
        self.url = url
        self.destination = destination
        self.health = health
        self.encoding = encoding
        self.timing = timing
        self.journal = journal
        self.dropped = 0
        self._queue: list[Delivery] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flush_deadline = timing.deadline
        self._thread = threading.Thread(target=self._run, name=f"deadweight-{name}",
                                        daemon=True)
        self._thread.start()

    # -- caller side (never blocks on the network) -----------------------------------------

    def submit(self, delivery: Delivery) -> None:
        """Journal a delivery and queue it (a queued one of the same alert is superseded
        when the destination coalesces)."""
        superseded: list[Delivery] = []
        if self.encoding.coalesce:
            with self._lock:
                superseded = [d for d in self._queue if d.alert == delivery.alert]
                for old in superseded:
                    self._queue.remove(old)
            for old in superseded:  # the newer one answers for the page the older carried
                if delivery.page is None and old.page is not None:
                    delivery.page, delivery.on_result = old.page, old.on_result
                    delivery.journaled = True  # so a crash before it is acknowledged
                    # still finds the page's delivery in the journal
            self._settle([d for d in superseded if d is not delivery], SUPERSEDED)
        if delivery.journaled and self.journal is not None:
            # A failed write is counted and logged by the store: the page is still sent now.
            with contextlib.suppress(StoreWriteFailed):
                delivery.row = self.journal.add_delivery(
                    self.destination, delivery.idempotency_key, delivery.page,
                    delivery.alert[0], delivery.alert[1], delivery.kind, delivery.payload,
                    delivery.created)
        self._append(delivery)

    def restore(self) -> list[Delivery]:
        """The deliveries a previous sidecar journaled and nobody acknowledged (to be given
        back with ``requeue`` once their outcomes are attached)."""
        if self.journal is None:
            return []
        restored = []
        for row in self.journal.open_deliveries(self.destination):
            delivery = Delivery((row.run_id, row.detector), row.kind, row.payload,
                                row.idempotency_key, row.created, page=row.page, row=row.id,
                                attempts=row.attempts)
            if row.attempts >= self.timing.max_attempts:
                delivery.told = FAILED  # its page says failed already
            restored.append(delivery)
        return restored

    def requeue(self, deliveries: Sequence[Delivery]) -> None:
        """Queue restored deliveries, oldest first (a later one of an alert supersedes)."""
        for delivery in deliveries:
            if self.encoding.coalesce:
                with self._lock:
                    older = [d for d in self._queue if d.alert == delivery.alert]
                    for old in older:
                        self._queue.remove(old)
                for old in older:
                    if delivery.page is None and old.page is not None:
                        delivery.page, delivery.on_result = old.page, old.on_result
                self._settle(older, SUPERSEDED)
            self._append(delivery)
        if deliveries:
            log.info("pager_deliveries_restored", target=self.health.target,
                     deliveries=len(deliveries))

    def pending_count(self) -> int:
        with self._lock:
            return len(self._queue)

    def pending_alerts(self) -> set[AlertKey]:
        """The alerts with a delivery still queued (not yet acknowledged)."""
        with self._lock:
            return {delivery.alert for delivery in self._queue}

    def close(self, flush_timeout: float = 2.0) -> None:
        """Stop after one last attempt (bounded by flush_timeout); what is still unsettled
        stays journaled and goes again after the restart."""
        self._flush_deadline = min(self.timing.deadline, flush_timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self._flush_deadline + 1.0)

    # -- internals -------------------------------------------------------------------------

    def _append(self, delivery: Delivery) -> None:
        dropped: list[Delivery] = []
        with self._lock:
            self._queue.append(delivery)
            while len(self._queue) > self.timing.max_pending:
                dropped.append(self._queue.pop(0))
            self.dropped += len(dropped)
            self._gauge()
        if dropped:
            log.warning("pager_deliveries_dropped", target=self.health.target,
                        dropped=len(dropped), total=self.dropped)
            self._settle(dropped, DROPPED)
            for old in dropped:
                self._tell(old, FAILED)
        self._wake.set()

    def _gauge(self) -> None:
        """The queue's size and its oldest delivery's time, for /metrics (under the lock)."""
        self.health.queued(len(self._queue),
                           min((d.created for d in self._queue), default=0.0))

    def _settle(self, deliveries: Sequence[Delivery], result: str) -> None:
        rows = [d.row for d in deliveries if d.row]
        if rows and self.journal is not None:
            # A failed write is counted by the store; the row goes again after a restart,
            # with its idempotency key.
            with contextlib.suppress(StoreWriteFailed):
                self.journal.settle_deliveries(rows, result)

    def _tell(self, delivery: Delivery, result: str) -> None:
        if delivery.on_result is None or delivery.told == result:
            return
        delivery.told = result
        try:
            delivery.on_result(result)
        except Exception:  # the journal's own failure must not stop delivery
            log.exception("page_outcome_failed", target=self.health.target)

    def _due(self, now: float, stopping: bool) -> list[Delivery]:
        with self._lock:
            due = [d for d in self._queue if stopping or d.next_try <= now]
            return due[:self.encoding.batch]

    def _next_wake(self, next_refresh: float) -> float:
        with self._lock:
            return min([next_refresh, *(d.next_try for d in self._queue)])

    def _run(self) -> None:
        next_refresh = time.monotonic() + self.timing.reassert_interval
        while True:
            stopping = self._stop.is_set()
            now = time.monotonic()
            if now >= next_refresh and not stopping:
                next_refresh = now + self.timing.reassert_interval
                for delivery in self.encoding.refresh(time.time()):
                    with self._lock:
                        covered = any(d.alert == delivery.alert for d in self._queue)
                    if not covered:
                        self._append(delivery)
            due = self._due(now, stopping)
            if not due:
                if stopping:
                    return
                self._wake.wait(max(0.0, self._next_wake(next_refresh) - time.monotonic()))
                self._wake.clear()
                continue
            self._attempt(due, self._flush_deadline if stopping else self.timing.deadline)
            if stopping:
                return

    def _attempt(self, due: list[Delivery], deadline: float) -> None:
        headers = {"Idempotency-Key": due[0].idempotency_key} if len(due) == 1 else {}
        try:
            body = json.dumps(self.encoding.body(due, time.time())).encode()
            result = post(self.url, body, headers, deadline)
        except Exception as err:  # a bug must not end this thread: the queue would only age
            log.exception("pager_attempt_crashed", target=self.health.target)
            result = PostResult(False, 0, f"{type(err).__name__}: {err}")
        self.health.tried(result.ok)
        if result.ok:
            with self._lock:
                for delivery in due:
                    if delivery in self._queue:
                        self._queue.remove(delivery)
                self._gauge()
            self._settle(due, DELIVERED)
            for delivery in due:
                self._tell(delivery, DELIVERED)
            return
        log.warning(self.encoding.failure_event, target=self.health.target,
                    error=result.error, status=result.status, deliveries=len(due),
                    failures=self.health.failures)
        now = time.monotonic()
        for delivery in due:
            delivery.attempts += 1
            delivery.next_try = now + min(
                self.timing.backoff_max,
                self.timing.backoff_initial * 2 ** min(delivery.attempts - 1, 30))
            if delivery.row and self.journal is not None:
                with contextlib.suppress(StoreWriteFailed):  # counted by the store
                    self.journal.delivery_tried(delivery.row, result.error)
            if delivery.attempts >= self.timing.max_attempts:
                self._tell(delivery, FAILED)


def restore_pages(workers: Sequence[DestinationWorker],
                  outcome_for: Callable[[int, int], Callable[[int], Outcome]]) -> int:
    """Give every worker back its unacknowledged deliveries; those of one page share an
    outcome (``outcome_for(page, deliveries)`` -> the outcome of its i-th delivery).
    Returns how many were restored."""
    restored = [(worker, worker.restore()) for worker in workers]
    by_page: dict[int, list[Delivery]] = {}
    for _, deliveries in restored:
        for delivery in deliveries:
            if delivery.page is not None:
                by_page.setdefault(delivery.page, []).append(delivery)
    for page, deliveries in by_page.items():
        outcome = outcome_for(page, len(deliveries))
        for index, delivery in enumerate(deliveries):
            delivery.on_result = outcome(index)
    for worker, deliveries in restored:
        worker.requeue(deliveries)
    return sum(len(d) for _, d in restored)
