"""The figures a baseline holds and a run is compared on, defined once for both sides.

A baseline is built from the state database's history (figures per stored step and log), a
live run is read from its ``RunState`` (step points and log windows): the same definitions
here, so the two always measure the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..model.step_point import StepPoint

#: Figures of each optimizer step: the learning rate the step used, the per-element size of
#: its update (L2 over the square root of the optimizer's elements), the gradient's L2 as the
#: optimizer got it, and the update relative to the weights.
STEP_QUANTITIES = ("learning_rate", "update_rms", "grad_l2", "relative_update")
#: Figures the loop or trainer logs.
LOG_QUANTITIES = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy")
#: How much wider than ``baseline_margin`` a quantity's margin is: the learning rate and the
#: loss follow the recipe closely; the size of each gradient and update wanders more between
#: seeds (Adam's early steps, batch noise).
MARGIN_SCALE = {"grad_l2": 2.0, "grad_norm": 2.0, "update_rms": 2.0, "relative_update": 2.0}
#: The RL signals (their own detector: a missing one is a changed recipe, e.g. beta 0).
RL_QUANTITIES = ("reward", "reward_std", "kl", "entropy")
#: Grad norms before one that make its recent level (``grad_norm_spike`` words a spike as
#: the newest norm over it; its default warmup is as long).
JUMP_LEVEL = 5


def step_values(figures: Mapping[str, float]) -> dict[str, float]:
    """A stored step's figures (``history.step_series``) as the compared quantities."""
    values: dict[str, float] = {}
    lr = figures.get("learning_rate")
    if lr is not None:
        values["learning_rate"] = lr
    params, norm = figures.get("params"), figures.get("update_norm")
    if params and norm is not None and params > 0:
        values["update_rms"] = norm / math.sqrt(params)
    for key in ("grad_l2", "relative_update"):
        if key in figures:
            values[key] = figures[key]
    return {k: v for k, v in values.items() if math.isfinite(v)}


def point_value(point: StepPoint, quantity: str) -> float | None:
    """One quantity of a live step (None when the step does not measure it), computed alone:
    detectors ask for one quantity of the newest steps at every batch."""
    value: float | None = None
    if quantity == "learning_rate":
        value = point.learning_rate
    elif quantity == "update_rms":
        params = point.optimizer_params or point.watched_params
        value = point.update_norm / math.sqrt(params) if params > 0 else None
    elif quantity == "grad_l2":
        grad = point.grad_sq_sum
        value = math.sqrt(grad) if grad is not None and grad >= 0 else None
    elif quantity == "relative_update":
        value = point.update_norm / math.sqrt(point.param_sq_sum) \
            if point.param_sq_sum > 0 else None
    return value if value is not None and math.isfinite(value) else None


def update_over_lr(update_sq_sum: float, elements: float, lr: float) -> float | None:
    """A module kind's per-element update over the learning rate (a scale-free movement:
    Adam's is near 1 whatever the rate); None at lr 0 or with no elements."""
    if lr <= 0 or elements <= 0 or update_sq_sum < 0:
        return None
    return math.sqrt(update_sq_sum / elements) / lr


def jump(values: Sequence[float], index: int) -> float | None:
    """How many times the recent level (the geometric mean of the JUMP_LEVEL values before
    it) a positive value is: a gradient norm's jump as ``grad_norm_spike`` states it, and
    what a baseline keeps the largest healthy one of. None without JUMP_LEVEL positive
    values before it."""
    before = values[max(0, index - JUMP_LEVEL):index]
    if len(before) < JUMP_LEVEL or values[index] <= 0 or any(v <= 0 for v in before):
        return None
    level = math.exp(sum(math.log(v) for v in before) / JUMP_LEVEL)
    return values[index] / level


def largest_jump(values: Sequence[float]) -> float | None:
    """The largest ``jump`` of a series (None when it has none)."""
    jumps = [j for i in range(len(values)) if (j := jump(values, i)) is not None]
    return max(jumps) if jumps else None
