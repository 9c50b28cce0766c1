"""What the optimizer itself will do, read off the object at train begin, not off the arguments.

The arguments can say one thing and the optimizer another: a Trainer handed its own optimizer
steps at that optimizer's rate whatever ``learning_rate`` says; Adafactor with
``relative_step=True`` computes its own step size and ignores any configured rate; a loop under
``accelerator.accumulate`` steps once per ``gradient_accumulation_steps`` micro-batches, which
only the prepared optimizer (its ``GradientState``) knows. The sidecar judges these facts.
"""

from __future__ import annotations

import math
from typing import Any

from .. import layout as layouts

#: Config keys this module reports (the sidecar's detectors read them by these names).
OPTIMIZER_LR = "optimizer_lr"
RELATIVE_STEP = "optimizer_relative_step"
ACCUMULATION = "optimizer_accumulation_steps"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def accumulation_steps(optimizer: Any) -> int | None:
    """Micro-batches per real optimizer step, as a wrapper that skips steps knows it (accelerate's
    prepared optimizer carries the accelerator's ``GradientState``); None when none says."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        state = getattr(optimizer, "gradient_state", None)
        steps = _number(getattr(state, "num_steps", None)) if state is not None else None
        if steps is not None and steps >= 1:
            return int(steps)
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def relative_step(group: dict[str, Any]) -> bool:
    """Whether the group's optimizer computes its own step size (Adafactor ``relative_step``)."""
    return bool(group.get("relative_step", False))


def relative_step_size(optimizer: Any, group: dict[str, Any]) -> float:
    """Adafactor's own step size for the coming step: ``min(1e-2, 1/sqrt(t))`` (``1e-6·t`` under
    ``warmup_init``). Its ``scale_parameter`` factor (each tensor's RMS) is left out, as the
    family's expected update ``lr·‖w‖`` already carries it; reading it would wait on a device."""
    params = group.get("params") or []
    state = getattr(optimizer, "state", {}).get(params[0], {}) if params else {}
    step = int(_number(state.get("step", 0)) or 0) + 1
    ceiling = 1e-6 * step if group.get("warmup_init") else 1e-2
    return min(ceiling, 1.0 / math.sqrt(step))


def numbers(optimizer: Any) -> dict[str, float]:
    """The optimizer's own peak learning rate (``initial_lr`` once a scheduler wrapped it),
    whether it sets its own step size, and its accumulation, for the RunStart's config."""
    found: dict[str, float] = {}
    accumulation = accumulation_steps(optimizer)
    if accumulation is not None:
        found[ACCUMULATION] = float(accumulation)
    groups = getattr(layouts.inner_optimizer(optimizer), "param_groups", None) or []
    if not groups or not isinstance(groups[0], dict):
        return found
    group = groups[0]
    if relative_step(group):
        found[RELATIVE_STEP] = 1.0
        return found
    lr = _number(group.get("initial_lr", group.get("lr")))
    if lr is not None:
        found[OPTIMIZER_LR] = lr
    return found
