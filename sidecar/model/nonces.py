"""One-time nonces that bind a stream to the kernel identity of the process behind it.

``ingest.attestation`` issues a nonce to a peer whose identity the kernel reported; the
registry redeems it from ``RunStart.attestation``. Each nonce is redeemable once, for a short
time, and only while the process it names still runs.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from .process import ProcessIdentity, is_alive

#: Seconds a nonce stays redeemable; a client redeems it within one connect.
NONCE_TTL_SECONDS = 120.0
#: Unredeemed nonces kept; a flood of connections evicts the oldest, it cannot grow memory.
MAX_PENDING_NONCES = 4096


class Attestor:
    """Issues one-time nonces bound to kernel identities and redeems them."""

    def __init__(self, ttl_seconds: float = NONCE_TTL_SECONDS,
                 max_pending: int = MAX_PENDING_NONCES) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_pending = max_pending
        self._pending: OrderedDict[str, tuple[ProcessIdentity, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.issued = 0
        self.redeemed = 0
        self.refused = 0

    def issue(self, identity: ProcessIdentity) -> str:
        nonce = secrets.token_hex(24)
        with self._lock:
            self._pending[nonce] = (identity, time.monotonic())
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
            self.issued += 1
        return nonce

    def redeem(self, nonce: str) -> ProcessIdentity | None:
        """The identity a nonce was issued to, once; None for unknown, used or stale ones."""
        with self._lock:
            found = self._pending.pop(nonce, None) if nonce else None
        if found is None:
            self.refused += 1
            return None
        identity, issued_at = found
        if time.monotonic() - issued_at > self.ttl_seconds or not is_alive(identity):
            self.refused += 1
            return None
        self.redeemed += 1
        return identity
