"""What an optimizer step of each family would have moved, given the step's own gradient.

The scale-free ratio ``update_L2 / (lr·√n)`` assumes an Adam-like step (every element moves by
about lr, whatever the gradient). Other families scale differently, and a step is judged by
what its own optimizer would have done:

- ``adam`` (Adam, AdamW, Lion's sign step, RMSprop, ...): about lr per element, ``lr·√n``;
- ``sgd`` (SGD with or without momentum): about lr times the gradient, ``lr·‖g‖``;
- ``adafactor``: about lr times each tensor's RMS (``scale_parameter``), ``lr·‖w‖``, with
  Adafactor's floor of 1e-3 per element for weights near zero (a fresh ``lora_B``).

An optimizer of an unknown class is judged by the family that expects the least, so no family
can look frozen by mistake.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..model.step_point import StepPoint

ADAM, SGD, ADAFACTOR, UNKNOWN = "adam", "sgd", "adafactor", "unknown"
#: Adafactor's ``eps[1]``/``eps2``: the smallest weight scale it moves an element by.
ADAFACTOR_FLOOR = 1e-3

_ADAM_LIKE = ("adam", "lion", "rmsprop", "lamb", "lars", "sophia", "adan", "nadam", "radam",
              "adamax", "adagrad", "schedulefree", "came", "muon")


def family(config_text: Mapping[str, str]) -> str:
    """The family of the run's optimizer, from its class name (or the trainer's ``optim``)."""
    name = (config_text.get("optimizer") or config_text.get("optim") or "").lower()
    if not name:
        return UNKNOWN
    if "adafactor" in name:
        return ADAFACTOR
    if "sgd" in name:
        return SGD
    if any(k in name for k in _ADAM_LIKE):
        return ADAM
    return UNKNOWN


def _ratios(point: StepPoint) -> dict[str, float]:
    """The step's update over each family's expectation (families it cannot judge left out)."""
    lr = point.learning_rate
    n = point.optimizer_params or point.watched_params
    norm = point.update_norm
    ratios: dict[str, float] = {}
    if lr <= 0 or n <= 0:
        return ratios
    ratios[ADAM] = norm / (lr * math.sqrt(n))
    if point.grad_sq_sum is not None and point.grad_sq_sum > 0 \
            and math.isfinite(point.grad_sq_sum):
        ratios[SGD] = norm / (lr * math.sqrt(point.grad_sq_sum))
    weights = point.param_sq_sum if math.isfinite(point.param_sq_sum) else 0.0
    ratios[ADAFACTOR] = norm / (lr * math.sqrt(max(weights, ADAFACTOR_FLOOR ** 2 * n)))
    return ratios


def step_ratio(point: StepPoint, kind: str) -> float | None:
    """The step's update against what an optimizer of this family would have done.

    0 when nothing moved; None when it cannot say (lr 0, an SGD step whose gradient was not
    measured). An unknown family takes the largest ratio: the one expecting least.
    """
    if point.update_sq_sum == 0:
        return 0.0
    ratios = _ratios(point)
    if kind == UNKNOWN:
        return max(ratios.values()) if ratios else None
    return ratios.get(kind)
