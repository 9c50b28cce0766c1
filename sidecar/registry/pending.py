"""Store writes and action calls decided under the registry lock, done after it is released.

Code holding the registry lock never touches SQLite (or a pager, or the enforcer): it adds
what is to be done to the run's ``Outbox``, in the order it decided it. The thread that
changed the run then flushes the outbox after releasing the lock. One outbox per run, drained
by one thread at a time, keeps each run's writes in decision order (an incident is opened
before it is resolved) while a slow write for one run holds up neither readers nor the
batches of other runs. Directives an action call returns are handed to ``deliver``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from ...proto import pb
from ..store.journal import StoreWriteFailed

log = structlog.get_logger("deadweight.registry")

#: One pending write or action call; an action may answer with directives for the run.
Effect = Callable[[], Sequence[pb.Directive] | None]


class Outbox:
    """One run's pending effects, first in first out."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._queue: deque[Effect] = deque()
        # Re-entrant: an effect may lead back into the registry, which flushes this outbox.
        self._order = threading.RLock()

    def add(self, effect: Effect) -> None:
        self._queue.append(effect)

    def __len__(self) -> int:
        return len(self._queue)

    def flush(self, deliver: Callable[[Sequence[pb.Directive]], None]) -> None:
        """Do every pending effect in order (the caller must not hold the registry lock)."""
        with self._order:
            while True:
                try:
                    effect = self._queue.popleft()
                except IndexError:
                    return
                try:
                    directives = effect()
                except StoreWriteFailed:  # the store logged and counted it: no traceback
                    continue
                except Exception:  # one failed write must not lose the ones after it
                    log.exception("pending_effect_failed", run_id=self.run_id)
                    continue
                if directives:
                    deliver(directives)
