"""Make every rank of a distributed run leave the training loop after the same step.

A STOP directive reaches each rank with that rank's next acknowledgement, so two ranks can
see it one step apart; the rank that stops first leaves its peers waiting in the next
gradient all-reduce (a crash on gloo, a hang until the timeout on NCCL). So on a multi-rank
run a rank only *proposes* to stop. At every step end each rank starts one non-blocking
all-reduce (MAX) of its proposal on a small CPU group and reads the previous step's result:
the ranks agree one step later, on the same step, without ever waiting on the sidecar.
"""

from __future__ import annotations

from typing import Any


class StopAgreement:
    """Per-step, one-step-delayed agreement on stopping; every rank must call ``step_end``."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._work: Any = None
        self._flag: Any = None

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
        """Offer this rank's proposal; True when any rank proposed by the previous step end."""
        import torch
        import torch.distributed as dist

        agreed = False
        if self._work is not None:
            self._work.wait()
            agreed = bool(self._flag.item())
        self._flag = torch.tensor([1 if proposed else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group,
                                     async_op=True)
        return agreed

    def close(self) -> None:
        """Finish the last outstanding all-reduce (every rank has exactly one)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
