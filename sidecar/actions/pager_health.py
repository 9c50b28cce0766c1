"""Whether paging works: per pager target, how often it was tried, failed, last delivered.

A page that cannot be delivered is worse than none if nobody learns of it, so every target (the
Alertmanager push, each ``--webhook-url``) keeps a ``TargetHealth`` that ``/metrics`` exports
as ``deadweight_pager_attempts_total``, ``deadweight_pager_failures_total`` and
``deadweight_pager_last_success_timestamp_seconds`` (label ``target``, plus ``kind``), and the
shipped ``DeadweightPagerFailing`` alert reads, with the outbox's backlog
(``deadweight_pager_queued``, ``deadweight_pager_oldest_unacknowledged_age_seconds``): a
receiver that never acknowledges shows as a queue that only ages. A target's label names its
kind and its host:port only, never the URL's path or query (a chat webhook's path is its secret).

A page's journal row starts ``queued`` and is settled by the targets through ``Outcome``:
``delivered`` once every target took it, ``failed`` once one of them gave up after its retry
budget (a later delivery settles it to ``delivered`` again; it is tried until acknowledged,
also after a restart: ``outbox``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

#: Called with "delivered" or "failed" by a target when it settles one page.
Outcome = Callable[[str], None]
DELIVERED = "delivered"
FAILED = "failed"
#: POSTs a page gets (with backoff between them) before its journal row says "failed".
DEFAULT_ATTEMPTS = 4


def target_label(kind: str, url: str, index: int = 0) -> str:
    """``kind host:port`` (and ``#index`` past the first of a kind): no path, no secret."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    suffix = f"#{index + 1}" if index else ""
    return f"{kind}{suffix} {host}:{port}"


@dataclass
class TargetHealth:
    """Counters of one pager target, updated by its delivery thread (read by a scrape)."""

    kind: str
    target: str
    attempts: int = 0
    failures: int = 0
    last_success: float = 0.0  # unix seconds; 0: never
    #: Deliveries waiting for an acknowledgement, and when the oldest was queued (0: none).
    pending: int = 0
    oldest_pending: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tried(self, ok: bool, at: float | None = None) -> None:
        with self._lock:
            self.attempts += 1
            if ok:
                self.last_success = time.time() if at is None else at
            else:
                self.failures += 1

    def read(self) -> tuple[int, int, float]:
        with self._lock:
            return self.attempts, self.failures, self.last_success

    def queued(self, pending: int, oldest: float) -> None:
        """The outbox's queue for this target: its size and its oldest delivery's time."""
        with self._lock:
            self.pending, self.oldest_pending = pending, oldest

    def backlog(self, now: float | None = None) -> tuple[int, float]:
        """Deliveries waiting, and the age in seconds of the oldest (0: none waits)."""
        with self._lock:
            pending, oldest = self.pending, self.oldest_pending
        if not pending or not oldest:
            return pending, 0.0
        return pending, max(0.0, (time.time() if now is None else now) - oldest)


class PageOutcome:
    """Settles one page across several targets: failed once one gave up, delivered once all
    took it. Calls ``settle`` on each change of that verdict (never twice the same)."""

    def __init__(self, targets: int, settle: Outcome) -> None:
        self._results: list[str | None] = [None] * targets
        self._settle = settle
        self._told: str | None = None
        self._lock = threading.Lock()

    def for_target(self, index: int) -> Outcome:
        def told(result: str) -> None:
            with self._lock:
                self._results[index] = result
                if FAILED in self._results:
                    verdict: str | None = FAILED
                elif all(r == DELIVERED for r in self._results):
                    verdict = DELIVERED
                else:
                    verdict = None
                if verdict is None or verdict == self._told:
                    return
                self._told = verdict
            self._settle(verdict)

        return told


@dataclass(frozen=True)
class PageSettler:
    """The outcome of one journaled page: its action id travels with every delivery of it
    (``outbox``), so a page restored after a restart is settled in the journal as well."""

    page: int
    tell: Outcome

    def __call__(self, result: str) -> None:
        self.tell(result)


def page_of(on_result: Outcome | None, page: int | None = None) -> int | None:
    """The journaled page an outcome settles: page when given, else a ``PageSettler``'s."""
    if page is not None:
        return page
    return on_result.page if isinstance(on_result, PageSettler) else None
