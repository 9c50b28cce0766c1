"""Detectors over the optimizer step figures: runs whose every step runs and moves nothing useful.

No gradient at all, steps the fp16 scaler throws away, weights too coarse to take the update:
each leaves loss and grad_norm looking ordinary.
"""

from __future__ import annotations

import functools
import math

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint
from .base import (
    SpecDetector,
    Verdict,
    fmt,
    step_at,
    trailing_streak,
    warmup_steps,
)
from .spec import DetectorSpec, Evidence, Severity, Threshold

#: Dtypes in which an optimizer step loses every update below half a unit in the last place.
LOW_PRECISION = frozenset({"bfloat16", "float16"})

class ZeroGradient(SpecDetector):
    """grad_norm is exactly 0 at lr > 0 with a non-empty optimizer: nothing to learn from.

    DPO with beta 0 (loss ln 2 for every pair), a loss detached from the weights, a reward
    without spread: any trainer. Weights do not move (or move by decay alone), which
    ``frozen_weights`` leaves alone because no gradient flows.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "zero-gradient-logs-out-of-order"),
        false_positives=("none known on a trainer at lr > 0: a healthy loss always gives some "
                         "gradient; skipped fp16 steps are left out"),
        symptom_of=("zero_reward_variance",),
        id="zero_gradient",
        severity=Severity.CRITICAL,
        summary="Run {run_id} trains with a gradient of exactly zero",
        meaning="grad_norm is exactly 0 at lr > 0 with a non-empty optimizer: the loss gives "
        "the weights nothing to learn from (DPO with beta 0, a detached loss, a flat reward)",
        fix="make the loss depend on trainable tensors (no `no_grad`/`detach`, the adapter active, "
        "labels not all -100; DPO `beta > 0`)",
        fires_when="`grad_norm` exactly 0 in the last log reports at lr > 0 (skipped fp16 "
        "steps left out) while the optimizer holds parameters",
        thresholds=(Threshold("zero_gradient_logs", "log reports",
                              "consecutive log reports at lr > 0 with grad_norm exactly 0"),),
        evidence=(Evidence("grad_norm", 0), Evidence("update_norm", 0), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        grads = run.log_history.get("grad_norm", ())
        if not any(math.isfinite(g) for _, g in reversed(grads)):
            return None
        steps = run.combined_steps()

        def left_out(report: tuple[int, float]) -> bool:
            """Non-finite, or logged at a step at lr 0 or skipped (fp16): neither counts."""
            point = step_at(steps, report[0])
            return not math.isfinite(report[1]) or (
                point is not None and (point.learning_rate <= 0 or point.skipped))

        # Walked back from the newest log: in a healthy run the walk ends at the first.
        streak = trailing_streak(grads, lambda report: report[1] == 0, skip=left_out)
        reached = streak.reached(settings.zero_gradient_logs)
        last = step_at(steps, streak.items[-1][0]) if streak.items else None
        if reached is None or (last is not None and last.optimizer_params == 0):
            return Verdict(False)
        first, end = streak.items[0][0], streak.items[-1][0]
        return Verdict(
            True,
            step=reached[0],
            summary=(f"grad_norm exactly 0 for {len(streak)} log reports (steps {first}-{end}) "
                     f"at lr {fmt(last.learning_rate if last else None)}: the loss gives the "
                     f"weights nothing to learn (loss={fmt(run.log_value('loss'))})"),
            evidence={"grad_norm": "0", "zero_logs": fmt(len(streak)), "steps": f"{first}-{end}",
                      "loss": fmt(run.log_value("loss")),
                      "update_norm": fmt(last.update_norm if last else None),
                      "optimizer_params": fmt(last.optimizer_params if last else None),
                      "step": fmt(end)},
        )


class OptimizerStepsSkipped(SpecDetector):
    """The optimizer skipped K steps in a row: fp16 loss scaling found inf/NaN gradients.

    A skipped step is no evidence of frozen weights (``frozen_weights`` ignores it); a run
    whose every step is skipped is its own failure: the weights never change.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("none known past the loss scale's calibration: a GradScaler starting "
                         "at 2^16 skips up to 16 steps in a row at the start of a healthy fp16 "
                         "run, and a streak from the run's first step is given that many more"),
        id="optimizer_steps_skipped",
        severity=Severity.CRITICAL,
        summary="Run {run_id} skips every optimizer step",
        meaning="the optimizer skipped several steps in a row (fp16 loss scaling found inf/NaN "
        "gradients): the weights do not change",
        fix="train with `bf16=True` where the hardware has it, or lower the learning rate and clip "
        "gradients under fp16",
        fires_when="the last optimizer steps were all skipped (the optimizer says so, or its "
        "GradScaler backed off); a streak from the run's first step, while the loss scale "
        "calibrates, needs `scale_calibration_skips` more",
        thresholds=(Threshold("skipped_steps", "optimizer steps",
                              "consecutive skipped optimizer steps"),
                    Threshold("scale_calibration_skips", "optimizer steps",
                              "more skips allowed from the run's first step: a GradScaler "
                              "halves its scale at each, from 2^16 down to 1")),
        evidence=(Evidence("update_norm", 0), Evidence("grad_norm"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        steps = run.combined_steps()
        if not steps:
            return None
        streak = trailing_streak(steps, lambda p: p.skipped)
        # From the run's first step, every step skipped: the loss scale may still be coming
        # down from its initial value (one halving per skip), which a healthy run does too.
        calibrating = len(streak) == len(steps) and steps[0].step <= 1
        reached = streak.reached(settings.skipped_steps
                                 + (settings.scale_calibration_skips if calibrating else 0))
        if reached is None:
            return Verdict(False, step=steps[-1].step)
        skipped = sum(p.skipped for p in steps)
        first = streak.items[0]
        return Verdict(
            True,
            step=reached.step,
            summary=(f"the optimizer skipped {len(streak)} steps in a row (steps {first.step}-"
                     f"{steps[-1].step}; {skipped} of {len(steps)} reported): fp16 gradients "
                     f"overflow, the weights do not change"),
            evidence={"skipped_steps": fmt(skipped), "reported_steps": fmt(len(steps)),
                      "streak": fmt(len(streak)), "first_skipped_step": fmt(first.step),
                      "all_skipped": str(skipped == len(steps)).lower(),
                      "step": fmt(steps[-1].step)},
        )


@functools.lru_cache(maxsize=256)  # a run names a few dtype texts, asked at every batch
def _is_low_precision(dtype_text: str) -> bool:
    """Whether a group's dtype text ("bfloat16" or "bfloat16,float32") names bf16/fp16."""
    return any(d.strip() in LOW_PRECISION for d in dtype_text.split(","))


def _stillest_low_precision_kind(point: StepPoint) -> tuple[float, str, str] | None:
    """(unchanged fraction, kind, dtype) of the bf16/fp16 module kind the step moved least."""
    kinds = [(unchanged / elements, kind, dtype)
             for kind, dtype, elements, unchanged in point.module_elements
             if elements > 0 and _is_low_precision(dtype)]
    return max(kinds) if kinds else None


class LowPrecisionUpdate(SpecDetector):
    """Optimizer steps leave a large share of a bf16/fp16 module kind's elements untouched.

    An update below half a unit in the last place rounds back to the old value: at lr 2e-4
    about half the elements of a bf16 LoRA never move, while every tensor changes a little and
    loss and grad_norm look normal (``model.to(torch.bfloat16)`` after ``get_peft_model`` undoes
    PEFT's fp32 adapter autocast; a DoRA magnitude left in bf16; a pure-bf16 full fine-tune).
    The verdict comes from the per-element counts of the update pass, per module kind; a DoRA
    magnitude is a kind of its own (``q_proj.lora_magnitude_vector``), or its lost updates
    would hide among its module's lora_A/B elements. Only steps that should
    move every element count: lr > 0 past the warmup (warmup and lr 0 are ``lora_lr_too_low``'s),
    a gradient that flows (``zero_gradient``'s), something moved (``frozen_weights``'s), not
    skipped. An optimizer that steps fp32 tensors (master copies) keeps the small updates, so
    its run is left alone: the dtypes are those of the tensors the optimizer steps, not of the
    model's parameters (DeepSpeed with bf16 steps fp32 partitions and copies them back into a
    bf16 model, which keeps most elements in any one step at a small lr and trains correctly).
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "deepspeed-bf16-master-weights"),
        false_positives=("a bf16 run whose optimizer keeps fp32 master weights the probe cannot "
                         "see"),
        id="low_precision_update",
        severity=Severity.WARNING,
        summary="Run {run_id} loses most small updates to bf16/fp16 rounding",
        meaning="optimizer steps leave a large share of the elements of a module held in bf16 or "
        "fp16 unchanged: updates below half a unit in the last place are lost, so many weights "
        "never move",
        fix="keep the trainable weights in fp32 (load the base in bf16 and let PEFT keep the "
        "adapter fp32; never cast the PEFT model afterwards)",
        fires_when="in consecutive optimizer steps at lr > 0 past the warmup, with a gradient "
        "flowing, some bf16/fp16 module kind (`q_proj`, `lm_head`, a DoRA magnitude "
        "`q_proj.lora_magnitude_vector`, ...) kept at least the threshold share of its elements "
        "bit for bit, and the optimizer steps bf16/fp16 tensors (no fp32 master copies)",
        thresholds=(
            Threshold("low_precision_fraction", "ratio",
                      "share of a bf16/fp16 module kind's elements one optimizer step left "
                      "unchanged (an fp32 LoRA moves every element from its second step)"),
            Threshold("low_precision_steps", "optimizer steps",
                      "consecutive counted steps at or above that share before it fires"),
        ),
        evidence=(Evidence("update_ratio"), Evidence("loss"), Evidence("grad_norm")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        steps = run.combined_steps()
        # Steps without element counts neither count nor break a streak. A step's groups are
        # decoded when first read: the newest steps only, not the whole window, per batch.
        newest = next((p for p in reversed(steps) if p.module_elements), None)
        if newest is None:
            return None
        held = run.start.trainable_params_by_dtype if run.start is not None else {}
        if held and not any(_is_low_precision(d) for d in held):
            # what the optimizer steps is fp32 (master copies): the small updates add up there
            return Verdict(False, step=newest.step)
        warmup = warmup_steps(run)
        # Steps that do not count (and those without element counts) are skipped on the walk
        # back from the newest: no filtered copy of the window per batch.
        streak = trailing_streak(steps, lambda p: (
            (worst := _stillest_low_precision_kind(p)) is not None
            and worst[0] >= settings.low_precision_fraction),
            skip=lambda p: not (p.learning_rate > 0 and p.step > warmup and not p.skipped
                                and p.update_sq_sum > 0 and run.logged_at("grad_norm", p.step) != 0)
            or not p.module_elements)
        reached = streak.reached(settings.low_precision_steps)
        if reached is None:
            return Verdict(False, step=newest.step)
        last = streak.items[-1]
        fraction, kind, dtype = _stillest_low_precision_kind(reached) or (0.0, "", "")
        shares = ", ".join(f"{k}={u / n:.0%}" for k, d, n, u in last.module_elements
                           if n > 0 and _is_low_precision(d))
        return Verdict(
            True,
            step=reached.step,
            summary=(f"{fraction:.0%} of the {dtype} elements of {kind} kept their exact value "
                     f"at step {reached.step} (lr {fmt(reached.learning_rate)}), and "
                     f"{len(streak)} steps in a row left this much of a bf16/fp16 module "
                     f"unchanged: updates below half a unit in the last place are lost"),
            evidence={"module_kind": kind, "dtype": dtype,
                      "unchanged_fraction": f"{fraction:.3g}",
                      "unchanged_by_kind": shares,
                      "steps": f"{streak.items[0].step}-{last.step}",
                      "sampled": str(reached.sampled).lower(),
                      "optimizer_dtypes": ",".join(f"{d}={n}" for d, n in sorted(held.items()))
                      or "n/a",
                      "learning_rate": fmt(reached.learning_rate),
                      "step": fmt(reached.step)},
        )
