"""Detectors over a finite run that goes wrong: the loss diverges, the gradient norm spikes.

Both judge the run against itself (its own early loss, its own recent gradient norms), so a
GRPO loss near 0, a warmup, or a model whose loss starts at 12 need no tuning. Observe-first:
they report and page nobody until a policy says so (``--policy loss_divergence=stop`` stops a
diverging run).
"""

from __future__ import annotations

import math

from ..baseline.calibrate import spike_jump
from ..baseline.quantities import jump
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint
from .base import SpecDetector, Verdict, finite_history, fmt
from .spec import DetectorSpec, Evidence, Policy, Severity, Threshold


class LossDivergence(SpecDetector):
    """The finite loss rose far above the run's own early loss and stays there.

    The early window is the first few logged losses; its smallest magnitude (at least a
    floor, so a GRPO loss near 0 is not divided by 0) is the run's scale. A too-high learning
    rate takes a tiny model's loss from 5.7 to 185 with every number finite: nonfinite_loss
    never fires, this does.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "real-loss-series-healthy"),
        false_positives=("a loss that rises on purpose (curriculum to harder data, a new task "
                         "phase) or a run whose early loss is unusually small"),
        id="loss_divergence",
        severity=Severity.WARNING,
        policy=Policy.OBSERVE,
        summary="Run {run_id} diverges: its loss rose far above where it started",
        meaning="the finite loss rose to many times the run's own early loss and stayed "
        "there, or every step moves the weights further than any weight is large while the "
        "loss does not improve (a too-high learning rate, a bad data shard, a broken scheduler)",
        fix="lower the learning rate (or add warmup), clip gradients (`max_grad_norm`), and "
        "restart from the last checkpoint before the divergence",
        fires_when="consecutive logged losses above `divergence_factor` times the run's early "
        "loss (the smallest magnitude of its first logs, at least `loss_scale_floor`), or "
        "`divergence_logs` consecutive optimizer steps that each moved the weights by "
        "`divergence_update_rms` per element (RMS) and a tenth of their norm while the newest "
        "loss is no lower than the early loss",
        thresholds=(
            Threshold("divergence_factor", "ratio", "how many times its early loss a loss "
                      "must reach to count as diverged"),
            Threshold("divergence_baseline_logs", "log reports", "the first logged losses "
                      "that form the run's early window"),
            Threshold("divergence_logs", "log reports", "consecutive diverged losses before "
                      "it fires"),
            Threshold("loss_scale_floor", "loss", "the smallest early-loss scale (a GRPO loss "
                      "near 0 is judged against this)"),
            Threshold("divergence_update_rms", "weight units", "a step moving the weights by "
                      "this much per element (RMS) is blown up: no trained weight is that "
                      "large (a LoRA at lr 20 moves 13; lr 2e-4 moves 2e-4)"),
        ),
        evidence=(Evidence("loss", 185.0), Evidence("update_norm", 53.0),
                  Evidence("learning_rate")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        losses = finite_history(run, "loss")
        early = losses[:settings.divergence_baseline_logs]
        if len(early) < settings.divergence_baseline_logs:
            return None
        scale = max(min(abs(v) for _, v in early), settings.loss_scale_floor)
        blown = _blown_up_weights(run, settings, losses, min(v for _, v in early))
        if blown is not None:
            return blown
        limit = settings.divergence_factor * scale
        later = losses  # the early window's own logs count too: a run can diverge at once
        streak = 0
        for _, value in reversed(later):
            if value <= limit:
                break
            streak += 1
        if streak < settings.divergence_logs:
            return Verdict(False)
        diverged = later[len(later) - streak:]
        reached_step = diverged[settings.divergence_logs - 1][0]
        last_step, last = later[-1]
        return Verdict(
            True,
            step=reached_step,
            summary=(f"loss {fmt(last)} at step {last_step} is {last / scale:.3g}x the run's "
                     f"early loss {fmt(scale)} (above {settings.divergence_factor:g}x for "
                     f"{streak} logs since step {diverged[0][0]}); lower the learning rate or "
                     f"restore the last good checkpoint"),
            evidence={"loss": fmt(last), "early_loss": fmt(scale), "ratio": fmt(last / scale),
                      "first_diverged_step": fmt(diverged[0][0]), "step": fmt(last_step),
                      "learning_rate": fmt(run.log_value("learning_rate"))},
        )


#: The least share of the weights' own norm a step must move to count as blown up (with the
#: per-element size below): a model whose weights are all large moves by large amounts too.
BLOWN_UP_SHARE = 0.1


def _blown_up_weights(run: RunState, settings: DetectorSettings,
                      losses: list[tuple[int, float]], early_loss: float) -> Verdict | None:
    """An absurd learning rate that neither overflows nor lifts the loss tenfold: each of the
    last steps moved the weights by `divergence_update_rms` per element or more (no trained
    weight is that large, no healthy step moves it that far) while the loss is no better than
    where it started. Tiny LoRA at lr 20: 13 per element a step, loss 5.7 -> 5.8, and the grad
    norm collapses (the model saturates) instead of exploding."""
    steps = [p for p in run.combined_steps() if p.learning_rate > 0 and not p.skipped]
    window = steps[-settings.divergence_logs:]
    if len(window) < settings.divergence_logs or losses[-1][1] < early_loss:
        return None

    def rms(point: StepPoint) -> float:
        n = point.optimizer_params or point.watched_params
        return point.update_norm / math.sqrt(n) if n > 0 else 0.0

    def blown(point: StepPoint) -> bool:
        weights = math.sqrt(point.param_sq_sum) if math.isfinite(point.param_sq_sum) else 0.0
        return rms(point) >= settings.divergence_update_rms \
            and point.update_norm >= BLOWN_UP_SHARE * weights
    if not all(blown(p) for p in window):
        return None
    first, last = window[0], window[-1]
    share = last.update_norm / math.sqrt(last.param_sq_sum) if last.param_sq_sum > 0 else 0.0
    return Verdict(
        True,
        step=last.step,
        summary=(f"each of steps {first.step}-{last.step} moved every weight by "
                 f"{fmt(rms(last))} on average ({share:.2g}x the weights' own norm) at lr "
                 f"{fmt(last.learning_rate)}, while the loss went {fmt(early_loss)} -> "
                 f"{fmt(losses[-1][1])}: the learning rate is far too high; lower it (LoRA "
                 f"1e-4..2e-4, full fine-tune 1e-5..5e-5) and restart"),
        evidence={"update_rms": fmt(rms(last)), "update_norm": fmt(last.update_norm),
                  "weights_norm": fmt(math.sqrt(last.param_sq_sum)),
                  "learning_rate": fmt(last.learning_rate), "loss": fmt(losses[-1][1]),
                  "early_loss": fmt(early_loss), "first_blown_step": fmt(first.step),
                  "step": fmt(last.step)},
    )


def grad_norm_series(run: RunState) -> list[tuple[int, float]]:
    """(step, grad norm): the trainer's logged ``grad_norm`` (before clipping), else the
    optimizer steps' measured gradient (raw loops that log none)."""
    logged = [(s, v) for s, v in finite_history(run, "grad_norm") if v > 0]
    if logged:
        return logged
    return [(p.step, math.sqrt(p.grad_sq_sum)) for p in run.combined_steps()
            if p.grad_sq_sum is not None and math.isfinite(p.grad_sq_sum) and p.grad_sq_sum > 0]


def spike_scores(values: list[float], settings: DetectorSettings,
                 alpha: float = 0.9) -> list[float]:
    """ZClip-style z-scores of log grad norms against an EMA of the ones before each.

    A spike enters the EMA clipped to the threshold, so one spike does not hide the next;
    the first ``spike_warmup_logs`` values only warm the EMA (score 0).
    """
    scores: list[float] = []
    mean = var = 0.0
    for i, value in enumerate(values):
        x = math.log(value)
        if i < settings.spike_warmup_logs:
            scores.append(0.0)
            if i == 0:
                mean = x
            else:
                mean, var = _ema(mean, var, x, alpha)
            continue
        sigma = max(math.sqrt(var), settings.spike_sigma_floor)
        z = (x - mean) / sigma
        scores.append(z)
        mean, var = _ema(mean, var, min(x, mean + settings.spike_z * sigma), alpha)
    return scores


def _ema(mean: float, var: float, x: float, alpha: float) -> tuple[float, float]:
    delta = x - mean
    mean += (1 - alpha) * delta
    return mean, alpha * (var + (1 - alpha) * delta * delta)


class GradNormSpike(SpecDetector):
    """The gradient norm jumped far above its own recent level: an early warning.

    A z-score of the log grad norm against its exponential moving mean and spread (as ZClip
    does), so it adapts to each run's level; a spread floor keeps a very steady run from
    calling a small wiggle a spike. It often comes before the loss moves. On a run that names
    a baseline, a jump no larger than the recipe's healthy runs made is no spike
    (``calibrate.spike_jump``).
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives="one hard batch in a healthy run: information only",
        id="grad_norm_spike",
        severity=Severity.INFO,
        policy=Policy.OBSERVE,
        summary="Run {run_id} had a gradient-norm spike",
        meaning="the gradient norm jumped far above its own recent level (a bad batch, a "
        "learning-rate jump, the start of a divergence)",
        fix="look at the batch of that step and clip gradients (`max_grad_norm`) or skip "
        "outlier batches",
        fires_when="the newest grad norm's z-score (log scale, against an EMA of the run's "
        "earlier ones, ZClip-style) is above `spike_z`; on a run with a baseline, the norm "
        "must also lie further above its recent level (the geometric mean of the 5 before it) "
        "than the baseline's healthy runs ever did, by `baseline_margin`",
        thresholds=(
            Threshold("spike_z", "z-score", "how many spreads above its moving mean a log grad "
                      "norm must be"),
            Threshold("spike_warmup_logs", "log reports", "grad norms that only warm the "
                      "moving mean"),
            Threshold("spike_sigma_floor", "log units", "the smallest spread (0.25: a spike "
                      "is at least e^(z·0.25) times the mean)"),
        ),
        evidence=(Evidence("grad_norm", 41.0), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        series = grad_norm_series(run)
        if len(series) <= settings.spike_warmup_logs:
            return None
        values = [v for _, v in series]
        scores = spike_scores(values, settings)
        step, value = series[-1]
        if scores[-1] <= settings.spike_z:
            return Verdict(False, step=step)
        over = jump(values, len(values) - 1)
        level = value / over if over else math.exp(
            sum(math.log(v) for _, v in series[-6:-1]) / 5)
        healthy = spike_jump(run, settings)
        if healthy is not None and over is not None and over <= healthy:
            return Verdict(False, step=step)  # the recipe's healthy runs jumped as far
        return Verdict(
            True,
            step=step,
            summary=(f"grad norm {fmt(value)} at step {step} is {value / level:.3g}x its recent "
                     f"level {fmt(level)} (z={scores[-1]:.2f}); look at this step's batch and "
                     f"learning rate, and clip gradients (max_grad_norm)"),
            evidence={"grad_norm": fmt(value), "recent_grad_norm": fmt(level),
                      "z_score": fmt(scores[-1]), "step": fmt(step),
                      **({} if healthy is None else {"baseline_jump": fmt(healthy)})},
        )
