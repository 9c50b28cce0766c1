"""A sharded run's combined steps, each summed once, when its last rank reports it.

Sharded parameters (FSDP, ZeRO-3) are split over the ranks, so the run's figure for a step is
the sum of every rank's, for steps every rank reported (``RunState.combined_steps``). Built
afresh at every ask, that grouped every rank's whole window and decoded every step's groups,
several times for every step received (``bench/README.md``, "Figures behind the design",
has what it cost). ``ShardedSteps`` keeps what it combined and, at each
ask, combines only the steps reported since.

Why that gives the same steps: each rank reports steps in increasing order (the registry
drops a repeated or older step), so a step becomes complete when the last of its ranks
reports it, and a step still incomplete once a later one is complete never completes (the
rank that lacks it is past it). A combined step stays while every rank's window still holds
it, i.e. while it is not older than the oldest step of any window. A change of the rank set
(a rank joining) starts it afresh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from .step_point import (
    MAX_MODULE_KINDS_PER_STEP,
    ModuleFigures,
    StepGroups,
    StepPoint,
)


class RankWindow(Protocol):
    """What is read of a rank: its newest steps, oldest first, in increasing step order."""

    @property
    def steps(self) -> deque[StepPoint]: ...


class ShardedSteps:
    """The combined steps of one set of ranks, kept up to date as they report."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        #: The ranks (sorted) these steps combine; another set needs a new instance.
        self.ranks = ranks
        self._combined: deque[StepPoint] = deque()

    def steps(self, windows: Mapping[int, RankWindow]) -> deque[StepPoint]:
        """Every step every rank's window holds, combined, oldest first (kept: do not change
        it; copy it to keep it)."""
        self._extend(windows)
        combined = self._combined
        oldest = [windows[r].steps[0].step if windows[r].steps else None for r in self.ranks]
        if None in oldest:  # a rank with an empty window: no step is complete
            combined.clear()
            return combined
        floor = max(step for step in oldest if step is not None)
        while combined and combined[0].step < floor:
            combined.popleft()
        return combined

    def _extend(self, windows: Mapping[int, RankWindow]) -> None:
        """Combine the steps newer than the newest combined one that every rank reported."""
        last = self._combined[-1].step if self._combined else None
        newer: list[dict[int, StepPoint]] = []
        for rank in self.ranks:
            found: dict[int, StepPoint] = {}
            for point in reversed(windows[rank].steps):
                if last is not None and point.step <= last:
                    break
                found[point.step] = point
            if not found:
                return
            newer.append(found)
        for step in sorted(set(newer[0]).intersection(*newer[1:])):
            self._combined.append(combine(step, [found[step] for found in newer]))


def combine(step: int, points: Sequence[StepPoint]) -> StepPoint:
    """One step's figure for the whole run from its ranks' shards (the lowest rank first):
    squares and counts summed, the learning rate and AdaLoRA flag of the first."""
    first = points[0]
    return StepPoint(
        step=step,
        time=max(p.time for p in points),
        learning_rate=first.learning_rate,
        update_sq_sum=sum(p.update_sq_sum for p in points),
        param_sq_sum=sum(p.param_sq_sum for p in points),
        watched_tensors=sum(p.watched_tensors for p in points),
        watched_params=sum(p.watched_params for p in points),
        optimizer_params=sum(p.optimizer_params for p in points),
        unchanged_tensors=sum(p.unchanged_tensors for p in points),
        nonfinite_update_tensors=sum(p.nonfinite_update_tensors for p in points),
        grad_not_in_optimizer_tensors=sum(p.grad_not_in_optimizer_tensors for p in points),
        grad_not_in_optimizer_params=sum(p.grad_not_in_optimizer_params for p in points),
        sampled=any(p.sampled for p in points),
        skipped=any(p.skipped for p in points),
        adalora_allocated=first.adalora_allocated,
        groups=StepGroups(modules=_sum_module_elements(points)),
    )


def _sum_module_elements(points: Sequence[StepPoint]) -> tuple[ModuleFigures, ...]:
    """Each module kind's element counts summed over the ranks' shards (dtype of the first)."""
    summed: dict[str, tuple[str, int, int]] = {}
    for point in points:
        for kind, dtype, elements, unchanged in point.module_elements:
            first, total, still = summed.get(kind, (dtype, 0, 0))
            summed[kind] = (first, total + elements, still + unchanged)
    return tuple((k, d, n, u) for k, (d, n, u) in summed.items())[:MAX_MODULE_KINDS_PER_STEP]
