"""Detectors over how the training loop drives the optimizer: no step at all, gradients that
are never cleared, and modules the user declared frozen that move anyway."""

from __future__ import annotations

from itertools import pairwise

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import SpecDetector, Verdict, finite_history, fmt, trainer_loop
from .divergence import grad_norm_series
from .spec import DetectorSpec, Evidence, Policy, Severity, Threshold

NO_STEP_LOGS = Threshold("no_step_logs", "log reports",
                         "log reports without an optimizer step before it fires (twice the "
                         "optimizer's accumulation, or twice the most seen between two steps, "
                         "when that is more: a loop that logs every micro-batch)")


def accumulation_steps(run: RunState) -> int:
    """Micro-batches per optimizer step: what the prepared optimizer reported (accelerate's
    ``GradientState``) or the config's ``gradient_accumulation_steps``, the larger; 1 if none."""
    config = run.config
    reported = max(config.get("optimizer_accumulation_steps", 1.0),
                   config.get("gradient_accumulation_steps", 1.0))
    return max(1, int(reported))


class NoOptimizerStep(SpecDetector):
    """The loop logs (so it runs and computes a loss) but no optimizer step happens.

    A raw loop that calls ``backward()`` and logs every iteration but never
    ``optimizer.step()`` trains nothing; no step report ever comes, so no detector over
    steps can speak and ``stalled`` (which waits for steps) needs its long bound. Log
    reports count: a Trainer logs only after optimizer steps, a raw loop once per iteration,
    and a loop under ``accelerator.accumulate`` once per micro-batch: it is judged against the
    accumulation its prepared optimizer reported at start, not only against a fixed count.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "optimizer-family-loops"),
        false_positives=("a loop that logs far more often than it steps, beyond twice its own "
                         "largest accumulation window seen so far (an accumulation it counts "
                         "itself, before its first step; an evaluation phase that logs every "
                         "batch); under a Trainer, an optimizer the probe watches that is not "
                         "the one that steps. A count, not proof: a warning"),
        id="no_optimizer_step",
        severity=Severity.WARNING,
        summary="Run {run_id} runs and logs but makes no optimizer step",
        meaning="the loop reports losses but no optimizer step happens (optimizer.step() "
        "missing, or called on another optimizer), so nothing trains",
        fix="call `optimizer.step()` (then `optimizer.zero_grad()`) every iteration or "
        "accumulation window, and pass the optimizer that really steps to `deadweight.watch`",
        fires_when="`no_step_logs` log reports (or twice the optimizer's gradient accumulation, "
        "or twice the most seen between two steps) arrived since the last optimizer step, or "
        "since the start when there was none",
        thresholds=(NO_STEP_LOGS,),
        evidence=(Evidence("step", 0), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        unstepped = run.unstepped_logs
        accumulation = accumulation_steps(run)
        # a loop that logs each micro-batch logs `accumulation` times per real step
        bound = max(settings.no_step_logs, 2 * accumulation, 2 * run.most_logs_between_steps)
        if len(unstepped) < bound:
            return Verdict(False)
        last_step = run.step
        logged = list(unstepped)
        since = f"step {last_step}" if last_step else "the start"
        return Verdict(
            True,
            step=logged[bound - 1],
            summary=(f"{len(logged)} log reports (logged steps {logged[0]}-{logged[-1]}) "
                     f"arrived since {since} without an optimizer step"
                     + (f" (the optimizer accumulates {accumulation} micro-batches a step)"
                        if accumulation > 1 else "")
                     + ": call optimizer.step() on the optimizer deadweight watches"),
            evidence={"log_reports_without_step": fmt(len(logged)),
                      "accumulation_steps": fmt(accumulation),
                      "last_optimizer_step": fmt(last_step),
                      "first_logged_step": fmt(logged[0]), "last_logged_step": fmt(logged[-1]),
                      "loss": fmt(run.log_value("loss"))},
        )


#: How much faster the window's second half may rise than its first and still read as summed
#: gradients (a sum adds about one batch's gradient a step: its rise is steady or slows down; a
#: rise that speeds up is a weight scale growing, a saddle left, a divergence).
SUMMED_RISE_ALLOWANCE = 1.25


def _falls_steadily(losses: list[float]) -> bool:
    """The loss fell at every log but at most one: a run that learns, whatever its grad norm
    does (a summed gradient drives a noisy loss up and down)."""
    if len(losses) < 3:
        return False
    rises = sum(b >= a for a, b in pairwise(losses))
    return rises <= 1


class GradientAccumulating(SpecDetector):
    """Gradients are summed across optimizer steps: ``zero_grad`` is missing from a raw loop.

    Each backward adds to the gradients of every step before, so the norm the optimizer steps
    with rises at every step, by about one batch's gradient each time: steadily or slowing
    down, never speeding up, and smoothly even while the batches' losses jump. A healthy run's
    norm falls or wanders; when it does rise for a while (a zero-initialised head growing, a
    saddle left behind, full-batch training) the rise speeds up or the loss falls at every log.
    A Trainer clears the gradients after every step itself: its runs are never judged.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a run whose gradient norm grows for a window while the loss stalls for "
                         "another reason (a learning-rate warmup on a plateau)"),
        symptom_of=("grad_not_in_optimizer",),
        id="gradient_accumulating",
        severity=Severity.WARNING,
        policy=Policy.OBSERVE,
        summary="Run {run_id} accumulates gradients across steps (zero_grad missing?)",
        meaning="the gradient norm rose at every step of a window, steadily as summed gradients "
        "do, while the loss did not fall steadily: gradients are summed across steps instead of "
        "cleared",
        fix="call `optimizer.zero_grad(set_to_none=True)` after every `optimizer.step()`",
        fires_when="in a raw loop (never a Trainer, which clears gradients itself), the grad norm "
        "rose at each of the last `accumulating_logs` steps to `accumulating_growth` times the "
        "run's smallest, its rise did not speed up (the window's second half rose at most "
        "1.25x as fast as its first, as a sum does), the loss did not fall at every log of "
        "the window, and it (a mean of 3 logs) fell by less than `accumulating_loss_drop`",
        thresholds=(
            Threshold("accumulating_logs", "steps", "the window of rising grad norms"),
            Threshold("accumulating_growth", "ratio", "how many times the run's smallest "
                      "grad norm the newest must be"),
            Threshold("accumulating_loss_drop", "fraction", "a loss that fell by more than "
                      "this over the window is improving (no verdict)"),
        ),
        evidence=(Evidence("grad_norm", 71.5), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if trainer_loop(run):
            return Verdict(False)  # the Trainer calls zero_grad after every optimizer step
        series = grad_norm_series(run)
        window = series[-(settings.accumulating_logs + 1):]
        if len(window) <= settings.accumulating_logs:
            return None
        rises = [b[1] - a[1] for a, b in pairwise(window)]
        rising = all(r > 0 for r in rises)
        growth = window[-1][1] / min(v for _, v in series)
        half = max(1, len(rises) // 2)
        early_rise, late_rise = sum(rises[:half]) / half, sum(rises[-half:]) / half
        summed = late_rise <= SUMMED_RISE_ALLOWANCE * early_rise
        # the loss, smoothed over 3 logs, at the window's start and at its end
        losses = finite_history(run, "loss")
        head = [v for s, v in losses if s <= window[0][0]][-3:]
        start_loss = sum(head) / len(head) if head else None
        loss = sum(v for _, v in losses[-3:]) / len(losses[-3:]) if losses else None
        improving = start_loss is not None and loss is not None \
            and loss < (1 - settings.accumulating_loss_drop) * start_loss
        steady = _falls_steadily([v for s, v in losses if s >= window[0][0]])
        if not rising or not summed or growth < settings.accumulating_growth or improving \
                or steady:
            return Verdict(False)
        first, last = window[0], window[-1]
        return Verdict(
            True,
            step=last[0],
            summary=(f"grad norm rose at every step from {fmt(first[1])} (step {first[0]}) to "
                     f"{fmt(last[1])} (step {last[0]}; {growth:.3g}x the run's smallest), "
                     f"about as much each step as summed gradients rise, while the loss went "
                     f"{fmt(start_loss)} -> {fmt(loss)}: call optimizer.zero_grad() every step"),
            evidence={"grad_norm": fmt(last[1]), "window_start_grad_norm": fmt(first[1]),
                      "growth": fmt(growth), "early_rise_per_step": fmt(early_rise),
                      "late_rise_per_step": fmt(late_rise), "loss": fmt(loss),
                      "window_start_loss": fmt(start_loss), "step": fmt(last[0])},
        )


class DeclaredFrozenMoved(SpecDetector):
    """Modules the user declared frozen train or move.

    The declared set (``frozen_modules=`` on the callback or ``watch``, or
    ``DEADWEIGHT_FROZEN_MODULES``) is checked at train begin (its tensors must be neither in
    the optimizer nor require grad) and at every step (a fixed sample of each tensor against
    its train-begin value). Silent when no modules are declared.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a declared set that names modules the run does train on purpose; silent "
                         "without a declared set"),
        id="declared_frozen_moved",
        severity=Severity.WARNING,
        policy=Policy.OBSERVE,
        summary="Run {run_id} trains modules that were declared frozen",
        meaning="tensors of modules the run declared frozen are trainable or moved since "
        "train begin (a freeze that did not take, or came after the optimizer was built)",
        fix="freeze the modules before building the optimizer, and build it over `p for p in "
        "model.parameters() if p.requires_grad`",
        fires_when="a tensor of the declared `frozen_modules` is in the optimizer or requires "
        "grad at train begin, or any of them moved since (silent without a declared set)",
        evidence=(Evidence("optimizer_params"), Evidence("update_norm")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        declared = int(run.config.get("declared_frozen_tensors", 0))
        if not declared:
            return Verdict(False)
        modules = run.start.config_text.get("declared_frozen_modules", "")
        trainable = int(run.config.get("declared_frozen_trainable_tensors", 0))
        moved = next((p for p in run.combined_steps() if p.declared_frozen_moved > 0), None)
        if moved is None and not trainable:
            return Verdict(False)
        newest = run.newest_combined_step()
        count = newest.declared_frozen_moved if newest is not None else 0
        what = (f"{moved.declared_frozen_moved} of {moved.declared_frozen_tensors} tensors "
                f"moved by step {moved.step}" if moved is not None
                else f"{trainable} of {declared} tensors are trainable at train begin")
        return Verdict(
            True,
            step=moved.step if moved is not None else 0,
            summary=(f"modules declared frozen ({modules}): {what}; freeze them "
                     f"(requires_grad_(False)) before building the optimizer, or leave them "
                     f"out of it"),
            evidence={"declared_frozen_modules": modules, "declared_frozen_tensors": fmt(declared),
                      "trainable_at_begin": fmt(trainable), "moved_tensors": fmt(count),
                      "first_moved_step": fmt(moved.step) if moved is not None else "none"},
        )
