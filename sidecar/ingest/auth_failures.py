"""Failed bearer tokens over TCP: limited per peer host, logged and counted.

A peer may get the token wrong a few times (a rotated secret, a typo): each failure spends
one of its host's ``burst`` credits, which come back at ``refill_per_second``. A host with no
credit left is refused (``RESOURCE_EXHAUSTED``) before its token is even compared, so guessing
runs at the refill rate however many calls it opens at once, and its right token waits too
until a credit came back. Every failure is counted (``deadweight_auth_failures_total`` by
``result``: ``wrong_token`` or ``throttled``); the log names the peer, never the token it
offered, and says once per throttling when a host is cut off and how many calls it made
meanwhile, so a guessing peer cannot flood the log either.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import structlog

log = structlog.get_logger("deadweight.server")

WRONG_TOKEN = "wrong_token"
THROTTLED = "throttled"
#: Failures a host may make before it is throttled, and how fast its credit comes back.
DEFAULT_BURST = 20
DEFAULT_REFILL_PER_SECOND = 1.0
#: Hosts remembered at once (the oldest is forgotten past it: a spoofing flood stays bounded).
MAX_HOSTS = 4096


def peer_host(peer: str) -> str:
    """The host of a gRPC peer (``ipv4:10.0.0.5:4711`` -> ``10.0.0.5``; ``ipv6:[::1]:1``
    -> ``[::1]``): the port changes with every connection, the host does not."""
    _, _, address = peer.partition(":")
    host, sep, _ = address.rpartition(":")
    return host if sep else address


@dataclass
class _Credit:
    left: float
    at: float  # monotonic time of the last update
    throttled_calls: int = 0


class AuthFailures:
    """Per-host credit for failed authentications (thread-safe)."""

    def __init__(self, burst: int = DEFAULT_BURST,
                 refill_per_second: float = DEFAULT_REFILL_PER_SECOND) -> None:
        self.burst = burst
        self.refill_per_second = refill_per_second
        #: Failures by result, for /metrics.
        self.counts: Counter[str] = Counter()
        self._hosts: dict[str, _Credit] = {}
        self._lock = threading.Lock()

    def _credit(self, host: str, now: float) -> _Credit:
        credit = self._hosts.get(host)
        if credit is None:
            credit = self._hosts[host] = _Credit(float(self.burst), now)
            while len(self._hosts) > MAX_HOSTS:
                del self._hosts[next(iter(self._hosts))]
        credit.left = min(float(self.burst),
                          credit.left + (now - credit.at) * self.refill_per_second)
        credit.at = now
        return credit

    def throttled(self, peer: str) -> float:
        """Seconds until peer's host may try again (0: it may try now); a throttled call is
        counted and its host's first one logged."""
        host = peer_host(peer)
        now = time.monotonic()
        with self._lock:
            credit = self._credit(host, now)
            if credit.left >= 1.0:
                return 0.0
            self.counts[THROTTLED] += 1
            credit.throttled_calls += 1
            first = credit.throttled_calls == 1
            wait = (1.0 - credit.left) / self.refill_per_second
        if first:
            log.warning("auth_throttled", peer=host, retry_after_seconds=round(wait, 1),
                        note=f"more than {self.burst} failed authentications: this host's "
                        "calls are refused before their token is compared until credit "
                        "comes back")
        return wait

    def failed(self, peer: str) -> None:
        """peer presented a missing or wrong token: one credit spent, logged, counted."""
        host = peer_host(peer)
        now = time.monotonic()
        with self._lock:
            credit = self._credit(host, now)
            credit.left = max(0.0, credit.left - 1.0)
            self.counts[WRONG_TOKEN] += 1
            throttled_calls, credit.throttled_calls = credit.throttled_calls, 0
            left = int(credit.left)
        log.warning("auth_failed", peer=host, credit_left=left,
                    throttled_calls_since_last=throttled_calls,
                    note="a TCP call presented a missing or wrong bearer token")
