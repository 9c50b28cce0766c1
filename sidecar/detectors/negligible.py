"""``negligible_updates``: every step moves the weights by a negligible fraction of themselves.

Not frozen (bytes change, the scale-free ratio can look normal because it divides by the tiny
learning rate), yet the adapter a run at lr 1e-9 saves is its initial one for any use. The
verdict is about what the run produces, so it stands after the run ends and reaches the
summary beside the adapter as firing, not as a warning at train begin only.

The end of a decaying schedule is no such run: a cosine schedule's last steps of a long run
run at a millionth of its peak rate and move nothing, by design, after the peak trained the
weights. A step at a small share of the highest rate the run's steps reached is left out
(the whole run's peak: the step window forgets it).
"""

from __future__ import annotations

import math

from ..baseline.calibrate import negligible_floor
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint
from .base import SpecDetector, Verdict, fmt, trailing_streak
from .spec import DetectorSpec, Evidence, Severity, Threshold


def relative_update(point: StepPoint) -> float | None:
    """‖Δw‖/‖w‖ of the step (None when the weights' norm is unknown or zero)."""
    if point.param_sq_sum <= 0 or not math.isfinite(point.param_sq_sum):
        return None
    return point.update_norm / math.sqrt(point.param_sq_sum)


def peak_learning_rate(run: RunState) -> float:
    """The highest lr the run's optimizer steps ran at. A sidecar that did not see the run
    from its first step (a restart, a resumed Trainer) also counts the optimizer's configured
    peak, from the RunStart: the steps it missed may have held the peak."""
    peak = run.peak_learning_rate
    if run.first_applied_step != 1:
        config = run.config
        configured = config.get("optimizer_lr", config.get("learning_rate", 0.0))
        if math.isfinite(configured):
            peak = max(peak, configured)
    return peak


class NegligibleUpdates(SpecDetector):
    """K consecutive steps at lr > 0 each moved the weights by less than a tiny fraction."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a very large model whose healthy relative update per step is below the "
                         "floor"),
        symptom_of=("lora_lr_too_low", "zero_reward_variance", "zero_gradient",
                    "frozen_weights"),
        id="negligible_updates",
        severity=Severity.WARNING,
        scope="artifact",
        summary="Run {run_id} moves its weights by a negligible amount at every step",
        meaning="each optimizer step changes the trained weights by a negligible fraction of "
        "their size (a learning rate like 1e-9), so the adapter it saves is its initial one "
        "for any use",
        fix="raise the learning rate (LoRA: 1e-4..2e-4; full fine-tune: 1e-5..5e-5), check the "
        "scheduler's peak and warmup, and retrain before promoting",
        fires_when="`negligible_update_steps` consecutive steps at lr > 0 (a step at under "
        "`negligible_decayed_lr_share` of the highest lr the run already reached, a decaying "
        "schedule's tail, is left out) each moved the "
        "weights by less than `negligible_relative_update` of their norm (healthy tiny runs: "
        "9e-5..5e-3; a run with a baseline: a tenth of its lowest healthy value, when lower); "
        "it stands for the whole run and in its summary",
        thresholds=(
            Threshold("negligible_update_steps", "optimizer steps", "consecutive negligible "
                      "steps before it fires"),
            Threshold("negligible_relative_update", "ratio", "a step moving the weights by "
                      "less than this fraction of their L2 norm is negligible"),
            Threshold("negligible_decayed_lr_share", "ratio", "a step at an lr below this "
                      "share of the run's earlier peak lr is a schedule's tail, not judged"),
        ),
        evidence=(Evidence("update_norm", 3e-09), Evidence("learning_rate", 1e-09)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        steps = run.combined_steps()
        if not steps:
            return None
        floor = negligible_floor(run, settings)  # the fixed one, or below a baseline's

        def negligible(p: StepPoint) -> bool:
            rel = relative_update(p)
            return p.update_sq_sum > 0 and rel is not None and rel < floor

        decayed = settings.negligible_decayed_lr_share * peak_learning_rate(run)
        streak = trailing_streak(steps, negligible, skip=lambda p: (
            p.learning_rate <= 0 or p.skipped or p.learning_rate < decayed))
        reached = streak.reached(settings.negligible_update_steps)
        if reached is None:
            return Verdict(False, step=steps[-1].step)
        first, last = streak.items[0], streak.items[-1]
        rel = relative_update(last)
        return Verdict(
            True,
            step=reached.step,
            summary=(f"steps {first.step}-{last.step} each moved the weights by under "
                     f"{floor:g} of their norm (last: {fmt(rel)}, update {fmt(last.update_norm)} "
                     f"at lr {last.learning_rate:.3g}): the saved adapter is as good as "
                     f"untrained; raise the learning rate (LoRA: 1e-4..2e-4)"),
            evidence={"negligible_steps": fmt(len(streak)), "first_step": fmt(first.step),
                      "step": fmt(last.step), "relative_update": fmt(rel),
                      "update_norm": fmt(last.update_norm),
                      "learning_rate": fmt(last.learning_rate)},
        )
