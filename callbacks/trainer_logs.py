"""Verdicts in the trainer's own loggers: a few ``deadweight/*`` keys added to each log.

Every ``report_to`` integration (TensorBoard, W&B, MLflow, trackio, ...) is a callback that
reads the ``logs`` dict in ``on_log``. Callbacks run in list order and a user's callback is
appended after the integrations, so keys added in our ``on_log`` would reach none of them.
``run_first`` moves the callback to the front of the handler that calls it (found as the
caller of the hook, once, at train begin); from then on the integrations see our keys.

========================================  ==================================================
key                                       value
========================================  ==================================================
``deadweight/update_norm``                L2 of the last optimizer step's weight update
``deadweight/update_ratio``               scale-free update, L2 / (lr * sqrt(n)); 0 = frozen
``deadweight/unchanged_fraction``         share of watched tensors the step left unchanged
``deadweight/monitored``                  1 while a sidecar judges the run, 0 when none
                                          answers (then no ``findings`` key: not judged is
                                          not healthy)
``deadweight/findings``                   number of detectors firing on this run now
``deadweight/firing/<detector>``          1 while that detector fires (0 once it resolved)
========================================  ==================================================
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any

#: Frames above the hook searched for the callback handler (the hook may be wrapped).
_MAX_FRAMES = 6
PREFIX = "deadweight/"


def run_first(callback: object) -> bool:
    """Move callback to the front of the CallbackHandler calling this hook; False if none."""
    from transformers.trainer_callback import CallbackHandler

    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler):
            callbacks: list[Any] = handler.callbacks
            if callback in callbacks and callbacks[0] is not callback:
                callbacks.remove(callback)
                callbacks.insert(0, callback)
            return callback in callbacks
        frame = frame.f_back
    return False


def step_keys(update_sq_sum: float, learning_rate: float, params: int,
              unchanged_tensors: int, watched_tensors: int) -> dict[str, float]:
    """The movement keys of one optimizer step (the same figures the sidecar receives)."""
    norm = math.sqrt(update_sq_sum) if update_sq_sum > 0 else 0.0
    keys = {
        PREFIX + "update_norm": norm,
        PREFIX + "unchanged_fraction": (
            unchanged_tensors / watched_tensors if watched_tensors else 1.0),
    }
    if norm == 0.0:
        keys[PREFIX + "update_ratio"] = 0.0
    elif learning_rate > 0 and params > 0:
        keys[PREFIX + "update_ratio"] = norm / (learning_rate * math.sqrt(params))
    return keys


def verdict_keys(firing: Iterable[str], ever_fired: set[str],
                 monitored: bool = True) -> dict[str, float]:
    """``deadweight/monitored``, ``deadweight/findings`` and one key per detector that fired.

    A detector that resolved keeps its key at 0, so a logger's chart shows when it stopped.
    Without a sidecar answering there is no verdict to count: ``monitored`` is 0 and no
    ``findings`` key says 0 (a chart would read it as "judged healthy"). ``ever_fired`` is
    updated in place.
    """
    if not monitored:
        return {PREFIX + "monitored": 0.0}
    now = set(firing)
    ever_fired |= now
    keys = {PREFIX + "monitored": 1.0, PREFIX + "findings": float(len(now))}
    for detector in sorted(ever_fired):
        keys[f"{PREFIX}firing/{detector}"] = 1.0 if detector in now else 0.0
    return keys
