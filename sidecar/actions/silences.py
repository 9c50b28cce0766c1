"""Detectors silenced by hand on one run, each until a time: no page while it lasts.

``deadweight silence RUN_ID DETECTOR --for DURATION`` sets one; it is journaled (action
``silence``, result ``set``, then ``expired`` or ``replaced``) and read back from the journal
at a restart, so a silence outlives the sidecar but never its own end. The actions consult
``active`` before paging; ``expired`` hands the ones whose time is up to the clock that pages
what is still firing. Bounded: at most ``MAX_SILENCES`` at once (the oldest-ending goes).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from ..store.journal import Store

#: Most silences held at once; a new one past it drops the one that ends first.
MAX_SILENCES = 10_000
#: Longest silence: a week (a longer one is a policy, ``--policy DETECTOR=observe``).
MAX_SILENCE_SECONDS = 7 * 86400.0
#: The journal's action name for silences.
ACTION = "silence"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class BadDuration(ValueError):
    """A duration that is not NUMBER[ms|s|m|h|d] within (0, a week]."""


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``15m``, ``2h``, ``1d`` or a bare number of seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise BadDuration(f"expected a duration like 30s, 15m, 2h or 1d, got {text!r}")
    seconds = float(match[1]) * _UNIT[match[2]]
    if not 0 < seconds <= MAX_SILENCE_SECONDS:
        raise BadDuration(f"a silence lasts more than 0 and at most 7d, got {text!r}")
    return seconds


@dataclass(frozen=True)
class Silence:
    run_id: str
    detector: str
    until: float  # unix seconds
    reason: str


class Silences:
    """The silences in force, by (run_id, detector); thread-safe."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Silence] = {}
        self._lock = threading.Lock()

    def set(self, silence: Silence) -> Silence | None:
        """Put silence in force; the one it replaces, if any."""
        key = (silence.run_id, silence.detector)
        with self._lock:
            previous = self._by_key.pop(key, None)
            self._by_key[key] = silence
            while len(self._by_key) > MAX_SILENCES:
                first = min(self._by_key, key=lambda k: self._by_key[k].until)
                del self._by_key[first]
        return previous

    def active(self, run_id: str, detector: str, now: float | None = None) -> bool:
        with self._lock:
            silence = self._by_key.get((run_id, detector))
        return silence is not None and silence.until > (time.time() if now is None else now)

    def of_run(self, run_id: str, now: float | None = None) -> list[Silence]:
        """The run's silences still in force, by detector."""
        now = time.time() if now is None else now
        with self._lock:
            found = [s for s in self._by_key.values() if s.run_id == run_id and s.until > now]
        return sorted(found, key=lambda s: s.detector)

    def all(self, now: float | None = None) -> list[Silence]:
        now = time.time() if now is None else now
        with self._lock:
            return sorted((s for s in self._by_key.values() if s.until > now),
                          key=lambda s: (s.run_id, s.detector))

    def expired(self, now: float | None = None) -> list[Silence]:
        """Take out and return the silences whose time is up."""
        now = time.time() if now is None else now
        with self._lock:
            done = [k for k, s in self._by_key.items() if s.until <= now]
            return [self._by_key.pop(k) for k in done]

    def load(self, store: Store, now: float | None = None) -> int:
        """The silences the journal says are in force (the last row per run and detector)."""
        latest: dict[tuple[str, str], Silence | None] = {}
        for row in store.actions():
            if row.action != ACTION:
                continue
            key = (row.run_id, row.detector)
            if row.result == "set":
                latest[key] = Silence(row.run_id, row.detector,
                                      float(row.detail.get("until", 0.0)),
                                      str(row.detail.get("reason", "")))
            else:
                latest[key] = None
        now = time.time() if now is None else now
        kept = [s for s in latest.values() if s is not None]
        for silence in kept:  # an expired one is handed to ``expired`` (it pages what fires)
            self.set(silence)
        return sum(1 for s in kept if s.until > now)
