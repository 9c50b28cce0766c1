"""``frozen_weights``: the headline verdict, a healthy-looking run whose weights do not move."""

from __future__ import annotations

import math

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint
from . import optimizer_family
from .base import (
    ADAPTER_MADE_TRAINABLE,
    FROZEN_AFTER_LOAD_FIX,
    SpecDetector,
    Streak,
    Verdict,
    adapter_made_trainable,
    fmt,
    trailing_streak,
)
from .spec import DetectorSpec, Evidence, FixCase, Severity, Threshold

#: Also read by lora_lr_too_low (K steps at lr 0 after the warmup).
FROZEN_STEPS = Threshold("frozen_steps", "optimizer steps",
                         "consecutive frozen optimizer steps (at lr > 0) before it fires")
FROZEN_RATIO_FLOOR = Threshold("frozen_ratio_floor", "ratio",
                               "a step whose update, over what its optimizer family would have "
                               "moved with that gradient (Adam-like lr·√n, SGD lr·‖g‖, "
                               "Adafactor lr·‖w‖), is below this counts as frozen (healthy "
                               "tiny runs sit at 0.38-0.86; frozen runs at exactly 0)")


def run_family(run: RunState) -> str:
    """The optimizer family of the run (see ``optimizer_family``)."""
    return optimizer_family.family(run.start.config_text) if run.start is not None \
        else optimizer_family.UNKNOWN


def _is_frozen_step(point: StepPoint, settings: DetectorSettings, family: str) -> bool:
    if point.frozen:
        return True
    ratio = optimizer_family.step_ratio(point, family)
    return ratio is not None and ratio < settings.frozen_ratio_floor


def _counts(point: StepPoint) -> bool:
    """Steps at lr 0 (warmup's first) and skipped steps neither count nor break a streak."""
    return point.learning_rate > 0 and not point.skipped


def _frozen_streak(steps: list[StepPoint], settings: DetectorSettings,
                   family: str) -> Streak[StepPoint]:
    """Walked back from the newest step: a moving run costs one step, not its window."""
    return trailing_streak(steps, lambda p: _is_frozen_step(p, settings, family),
                           skip=lambda p: not _counts(p))


class FrozenWeights(SpecDetector):
    """K consecutive optimizer steps with lr > 0 and a finite loss moved no weight.

    Steps at lr 0 (warmup's first step) and steps the optimizer skipped (fp16 overflow) neither
    count nor break the streak. A zero update
    with a zero gradient and a non-empty optimizer is left to the reward/gradient detectors
    (it is not frozen weights, it is nothing to learn from); with an empty optimizer or a
    gradient that is flowing, a zero update means the weights are cut off from training.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "optimizer-family-loops"),
        false_positives=("none known past warmup: every healthy run moved its weights at every "
                         "step at lr > 0; an optimizer family whose update floor is unknown could "
                         "misjudge a tiny update"),
        symptom_of=("empty_optimizer", "inactive_adapter", "zero_reward_variance",
                    "optimizer_steps_skipped", "grad_not_in_optimizer"),
        id="frozen_weights",
        severity=Severity.CRITICAL,
        summary="Run {run_id} reports a live loss but its weights do not move",
        meaning="optimizer steps with lr > 0 and a finite loss left every trainable weight "
        "unchanged, though a gradient flowed or the optimizer holds nothing to train",
        fix="stop the run and fix what froze it: resume adapters with `is_trainable=True`, or let "
        "the trainer wrap the model (`peft_config=LoraConfig(...)`)",
        fires_when="consecutive optimizer steps at lr > 0 moved no weight (or moved less than "
        "a floor of what the optimizer's family would have moved with that gradient: "
        "Adam-like `lr·√n`, SGD `lr·‖g‖`, Adafactor `lr·‖w‖`) while the loss was finite and "
        "the gradient flowed or the optimizer was empty",
        thresholds=(FROZEN_STEPS, FROZEN_RATIO_FLOOR),
        evidence=(Evidence("frozen_steps", 12), Evidence("update_norm", 0),
                  Evidence("update_ratio", 0), Evidence("loss"), Evidence("grad_norm"),
                  Evidence("learning_rate")),
        fix_cases=(FixCase(ADAPTER_MADE_TRAINABLE, "true", FROZEN_AFTER_LOAD_FIX),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        steps = run.combined_steps()
        # the newest counted step; the streak skips the others (no filtered copy per batch)
        last = next((p for p in reversed(steps) if _counts(p)), None)
        if last is None:
            return None
        loss = run.log_value("loss")
        grad_norm = run.log_value("grad_norm")
        if loss is not None and not math.isfinite(loss):
            return Verdict(False)  # a non-finite loss is its own detector's verdict
        family = run_family(run)
        streak = _frozen_streak(steps, settings, family)
        unknown = run.start is not None and run.start.membership.layout == "unknown"
        optimizer_empty = last.optimizer_params == 0 and not unknown
        gradient_flows = grad_norm is not None and grad_norm > 0
        reached = streak.reached(settings.frozen_steps)
        if reached is None or not (optimizer_empty or gradient_flows):
            return Verdict(False, step=last.step)
        first = streak.items[0]
        ratio = optimizer_family.step_ratio(last, family)
        return Verdict(
            True,
            step=reached.step,
            summary=(
                f"weights unchanged for {len(streak)} optimizer steps "
                f"(steps {first.step}-{last.step}) at lr {last.learning_rate:.3g} while "
                f"loss={fmt(loss)} and grad_norm={fmt(grad_norm)}"
            ),
            evidence={
                "frozen_steps": fmt(len(streak)),
                "first_frozen_step": fmt(first.step),
                "step": fmt(last.step),
                "update_norm": fmt(last.update_norm),
                "update_ratio": fmt(ratio),
                "optimizer_family": family,
                "learning_rate": fmt(last.learning_rate),
                "loss": fmt(loss),
                "grad_norm": fmt(grad_norm),
                "optimizer_params": fmt(last.optimizer_params),
                "unchanged_tensors": f"{last.unchanged_tensors}/{last.watched_tensors}",
                "grad_not_in_optimizer_tensors": fmt(last.grad_not_in_optimizer_tensors),
                ADAPTER_MADE_TRAINABLE: adapter_made_trainable(run),
            },
        )

    @staticmethod
    def streak(run: RunState, settings: DetectorSettings) -> int:
        """Consecutive frozen steps at lr > 0 ending at the latest one (for the metric).

        Every /metrics scrape asks this of every run; it is counted again only once a newer
        combined step (or another rank) arrived since the last count, or the settings changed.
        """
        newest = run.newest_combined_step()
        if newest is None:
            return 0
        key = (newest.step, len(run.ranks))
        memo = run.frozen_streak_memo
        if memo is not None and memo[0] == key and memo[1] is settings:
            return memo[2]
        count = len(_frozen_streak(run.combined_steps(), settings, run_family(run)))
        run.frozen_streak_memo = (key, settings, count)
        return count
