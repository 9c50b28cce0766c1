"""Make every rank of a distributed run leave the training loop after the same step.

A STOP directive reaches each rank with that rank's next acknowledgement, so two ranks can
see it one step apart; the rank that stops first leaves its peers waiting in the next
gradient all-reduce (a crash on gloo, a hang until the timeout on NCCL). So on a multi-rank
run a rank only *proposes* to stop. At an agreement point each rank starts one non-blocking
all-reduce (MAX) of its proposal on a small CPU group and reads the previous point's result:
the ranks agree at the next point, on the same step, without ever waiting on the sidecar.

Short steps share one agreement: the all-reduce also carries how many step ends each rank
wants until the next point (enough to span ``interval_seconds``, at most
``MAX_STEPS_PER_AGREEMENT``), and every rank reads the same maximum from it, so the points
stay the same on every rank. A proposal is remembered until the next point. Steps longer than
the interval agree at every step end; a STOP lands within about two intervals either way.
"""

from __future__ import annotations

import math
import time
from typing import Any

#: Least time between two agreement points: one all-reduce costs about 0.2-0.4 ms on
#: loopback gloo, so steps of a few ms would otherwise spend several percent on it.
INTERVAL_SECONDS = 0.25
#: Most step ends one agreement may span (bounds the STOP latency in steps).
MAX_STEPS_PER_AGREEMENT = 16


class StopAgreement:
    """Delayed agreement on stopping, at points every rank reaches on the same step end;
    every rank must call ``step_end`` at every step end."""

    def __init__(self, group: Any, interval_seconds: float = INTERVAL_SECONDS) -> None:
        self._group = group
        self._interval = interval_seconds
        self._work: Any = None
        self._flag: Any = None  # [any proposal, step ends wanted until the next point]
        self._proposed = False
        self._steps = 0  # step ends since the last point
        self._every = 1  # step ends between points: read from an all-reduce, so rank-wide
        self._since = time.monotonic()
        #: All-reduces started (for tests and the bench).
        self.agreements = 0

    @classmethod
    def create(cls) -> StopAgreement | None:
        """A group when a process group with more than one rank is up, else None.

        Collective: every rank calls it at train begin (as it does the run id broadcast).
        """
        try:
            import torch.distributed as dist
        except ImportError:
            return None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.new_group(backend="gloo"))

    def step_end(self, proposed: bool) -> bool:
        """Offer this rank's proposal; True when any rank had proposed by the previous
        agreement point (on every rank at the same step end)."""
        self._proposed = self._proposed or proposed
        self._steps += 1
        if self._steps < self._every:
            return False
        import torch
        import torch.distributed as dist

        agreed = False
        if self._work is not None:
            self._work.wait()
            result = self._flag.tolist()
            agreed, self._every = bool(result[0]), max(1, int(result[1]))
        now = time.monotonic()
        per_step = (now - self._since) / self._steps
        wanted = (MAX_STEPS_PER_AGREEMENT if per_step <= 0 else
                  min(MAX_STEPS_PER_AGREEMENT, max(1, math.ceil(self._interval / per_step))))
        self._flag = torch.tensor([int(self._proposed), wanted], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group,
                                     async_op=True)
        self.agreements += 1
        self._steps, self._since = 0, now
        return agreed

    def close(self) -> None:
        """Finish the last outstanding all-reduce (every rank has exactly one)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
