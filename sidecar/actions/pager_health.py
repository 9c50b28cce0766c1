"""Whether paging works: per pager target, how often it was tried, failed, last delivered.

A page that cannot be delivered is worse than none if nobody learns of it, so every target (the
Alertmanager push, each ``--webhook-url``) keeps a ``TargetHealth`` that ``/metrics`` exports
as ``deadweight_pager_attempts_total``, ``deadweight_pager_failures_total`` and
``deadweight_pager_last_success_timestamp_seconds`` (label ``target``, plus ``kind``), and the
shipped ``DeadweightPagerFailing`` alert reads. A target's label names its kind and its
host:port only, never the URL's path or query (a chat webhook's path is its secret).

A page's journal row starts ``queued`` and is settled by the targets through ``Outcome``:
``delivered`` once every target took it, ``failed`` once one of them gave up after its retry
budget (a later delivery settles it to ``delivered`` again).
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
