"""Detectors over the run's vital signs: non-finite numbers, silence, movement without gradient."""

from __future__ import annotations

import math
import time

from ..model.run_state import RankState, RunState
from ..model.settings import DetectorSettings
from ..model.step_point import StepPoint
from .base import SpecDetector, Verdict, fmt, step_at, trailing_streak
from .spec import (
    ROOT_CAUSES,
    DetectorSpec,
    Evidence,
    Severity,
    Threshold,
)
from .stopped_first import account, evidence, ranks_text, since, stopped_first


class NonfiniteLoss(SpecDetector):
    """The loss or gradient norm is NaN or infinite, or an update wrote non-finite weights."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("none known at critical: non-finite weights, or a loss or grad norm "
                         "non-finite for `nonfinite_logs` reports in a row, leave the run "
                         "useless; an inf grad norm on a step the fp16 scaler skipped is left "
                         "out; one bad batch whose NaN loss the next logs recover from fires "
                         "as a warning until a finite log clears it"),
        id="nonfinite_loss",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the loss or grad norm was non-finite for fewer than `nonfinite_logs` "
        "reports in a row and the weights are still finite (one bad batch can do that)",
        thresholds=(Threshold("nonfinite_logs", "log reports",
                              "consecutive non-finite loss or grad-norm reports (weights still "
                              "finite) before the verdict is critical"),),
        summary="Run {run_id} reports a NaN or infinite loss or grad norm",
        meaning="the loss or the gradient norm is not finite; every later update is garbage",
        fix="resume from the last finite checkpoint with a lower learning rate and gradient "
        "clipping (`max_grad_norm=1.0`), preferring `bf16=True` over `fp16=True`",
        fires_when="the latest `loss` or `grad_norm` is NaN/inf, or an update wrote non-finite "
        "weights",
        evidence=(Evidence("loss", float("inf")), Evidence("grad_norm"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        loss = run.log_value("loss")
        grad_norm = run.log_value("grad_norm")
        steps = run.combined_steps()
        latest = steps[-1] if steps else None
        if loss is None and grad_norm is None and latest is None:
            return None
        last_grad = run.last_logged("grad_norm")
        if last_grad is not None and (
                (point := step_at(steps, last_grad[0])) is not None and point.skipped):
            grad_norm = None  # fp16 overflow: the scaler skipped the step, as designed
        bad = [k for k, v in (("loss", loss), ("grad_norm", grad_norm))
               if v is not None and not math.isfinite(v)]
        if latest is not None and latest.nonfinite_update_tensors > 0:
            bad.append("weights")
        if not bad:
            return Verdict(False)
        step = _first_bad_step(run, bad, steps)
        streak = max(len(trailing_streak(run.history(key), _nonfinite))
                     for key in ("loss", "grad_norm"))
        certain = "weights" in bad or streak >= settings.nonfinite_logs
        return Verdict(
            True,
            step=step,
            severity=None if certain else Severity.WARNING,
            summary=f"non-finite {', '.join(bad)} at step {step}: loss={fmt(loss)} "
                    f"grad_norm={fmt(grad_norm)}"
                    + ("" if certain else f" ({streak} report(s) so far, weights still finite: "
                       "one bad batch, or the start of a divergence)"),
            evidence={"loss": fmt(loss), "grad_norm": fmt(grad_norm), "step": fmt(step),
                      "nonfinite_update_tensors": fmt(
                          latest.nonfinite_update_tensors if latest else 0)},
        )


def _nonfinite(entry: tuple[int, float]) -> bool:
    return not math.isfinite(entry[1])


def _first_bad_step(run: RunState, bad: list[str], steps: list[StepPoint]) -> int:
    """Where the current non-finite streak began: reports arrive in batches, so the latest
    step of a batch is not necessarily the first bad one."""
    starts: list[int] = []
    for key in ("loss", "grad_norm"):
        if key in bad:
            first = None
            for step, value in reversed(run.history(key)):
                if math.isfinite(value):
                    break
                first = step
            if first is not None:
                starts.append(first)
    if "weights" in bad:
        first_point = None
        for point in reversed(steps):
            if point.nonfinite_update_tensors == 0:
                break
            first_point = point.step
        if first_point is not None:
            starts.append(first_point)
    return min(starts, default=steps[-1].step if steps else 0)


class Stalled(SpecDetector):
    """A live run went silent, or its training loop stopped making steps.

    Silence (no step, log or heartbeat for ``stalled_seconds``) means a dead or frozen
    process; a loop whose sender thread still beats but that made no optimizer step for
    ``stalled_step_seconds`` is hung in a data loader, a collective or generation.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "stall-clock-starts-when-heard"),
        false_positives=("none known at critical: the callback's sender thread beats every few "
                         "seconds whatever the loop does, so a run silent for `stalled_seconds` "
                         "is gone or frozen; a process stopped on purpose (SIGSTOP by a "
                         "scheduler, seen in /proc on an attested run) and a step longer than "
                         "`stalled_step_seconds` with heartbeats still arriving (a huge "
                         "generation, a checkpoint upload) can be healthy, so they fire as a "
                         "warning; an evaluation that goes on finishing batches is progress, "
                         "not a stall"),
        symptom_of=("rank_stalled",),
        id="stalled",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="heartbeats still arrive (the loop made no step for the window, but its "
        "process is alive: a very long step can be healthy), or the silent process is stopped "
        "(SIGSTOP: suspended by a scheduler)",
        summary="Run {run_id} stopped making progress",
        meaning="no message at all arrived within the stall window (the process is gone or "
        "frozen), or heartbeats still arrive but no optimizer step did (the training loop is "
        "hung)",
        fix="find the hung rank, generation or data loader worker, then restart from the last good "
        "checkpoint",
        fires_when="a live run sent no message at all (step, log, heartbeat), or its loop made "
        "no optimizer step and finished no evaluation batch while heartbeats still arrive; on a "
        "run of several ranks the "
        "verdict names the rank that stopped first, the phase of the step it stopped in and "
        "since when",
        thresholds=(Threshold("stalled_seconds", "seconds",
                              "seconds without any message (step, log or heartbeat) from a "
                              "live run"),
                    Threshold("stalled_step_seconds", "seconds",
                              "seconds without an optimizer step or an evaluation batch while "
                              "heartbeats still arrive (a hung loop whose sender thread is "
                              "alive); long enough for slow steps")),
        evidence=(Evidence("seconds_since_last_step"), Evidence("step")),
        # The rank that stopped, named, is the root cause of a stall of the whole run.
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None or run.ended:
            return None
        heard = [r for r in run.ranks.values() if r.first_seen]
        if not heard:
            return None  # restored after a sidecar restart: nothing heard yet, no clock
        now = run.evaluated_at or time.time()
        silent = now - max(r.last_seen for r in heard)
        # An evaluation that goes on finishing batches is progress too.
        last_step = max(max(r.last_step_time, r.evaluated_time) for r in heard)
        since_step = now - (last_step or min(r.first_seen for r in heard))
        severity: Severity | None = None  # silence: the spec's own, critical
        if silent > settings.stalled_seconds:
            reason = f"no message for {silent:.0f} s (limit {settings.stalled_seconds:g} s)"
            if run.suspended_ranks:  # stopped on purpose (a scheduler), not gone or hung
                reason += (f"; the process of rank(s) {_ranks(run.suspended_ranks)} is "
                           "stopped (SIGSTOP: suspended by a scheduler or a debugger)")
                severity = Severity.WARNING
        elif since_step > settings.stalled_step_seconds:
            reason = (f"no optimizer step (nor evaluation batch) for {since_step:.0f} s "
                      f"(limit {settings.stalled_step_seconds:g} s) though the process still "
                      "reports")
            severity = Severity.WARNING  # alive: a very long step can be healthy
        else:
            return Verdict(False, step=run.step)
        evidence = {"seconds_since_last_message": fmt(silent),
                    "seconds_since_last_step": fmt(since_step), "step": fmt(run.step)}
        who = _who_stopped(sorted(heard, key=lambda r: r.rank), run.start.world_size, now,
                           min(settings.stalled_seconds, settings.stalled_step_seconds))
        if who is not None:
            words, named = who
            reason += f"; {words}"
            evidence.update(named)
        return Verdict(True, step=run.step, summary=f"run stalled at step {run.step}: {reason}",
                       evidence=evidence, severity=severity)


def _ranks(ranks: frozenset[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def _who_stopped(heard: list[RankState], world_size: int, now: float, limit: float
                 ) -> tuple[str, dict[str, str]] | None:
    """The words and evidence naming the rank(s) of a stalled run that stopped first, where
    and since when. A sidecar that serves one rank of a larger job (one node of several)
    says where its rank is and leaves the naming to the comparison across nodes. None when
    nothing finer than the step is known."""
    if len(heard) == 1:
        rank = heard[0]
        mark = rank.position
        if not rank.phase:
            return None  # one rank, no mark finer than the step: the step says it all
        seconds = now - since(rank)
        if world_size > 1:
            return (f"this sidecar serves rank {rank.rank} only (of {world_size}), which is at "
                    f"{mark.words()} since {seconds:.0f} s; the rank the job waits for may "
                    "report to another node's sidecar (DeadweightRankStopped names it)",
                    {"local_ranks": str(rank.rank), "phase": mark.phase,
                     "phase_step": str(mark.step), "stopped_seconds": f"{seconds:.1f}"})
        return (f"rank {rank.rank} stopped at {mark.words()}, {seconds:.0f} s ago",
                {"rank": str(rank.rank), "phase": mark.phase, "phase_step": str(mark.step),
                 "stopped_seconds": f"{seconds:.1f}"})
    # The whole run stopped stepping for the limit, so a mark behind the others' for even a
    # fraction of it is the one they wait for.
    found = stopped_first(heard, now, limit / 2)
    if found is None:
        mark = max((r.position for r in heard), key=lambda p: p.key)
        words = (f"every rank here ({ranks_text(heard)}) stopped at {mark.words()}; none is "
                 "behind the others")
        if len(heard) < world_size:
            words += (f" (this sidecar serves {len(heard)} of {world_size} ranks: the rank the "
                      "job waits for may report to another node's sidecar; "
                      "DeadweightRankStopped names it)")
        return words, {"phase": mark.phase, "phase_step": str(mark.step),
                       "local_ranks": ranks_text(heard)}
    return account(found, now), evidence(found, now)


class DecayOnlyUpdate(SpecDetector):
    """Weights move while the gradient norm is exactly 0: weight decay, not learning.

    A flat reward or a loss detached from the adapter gives zero gradients; decoupled weight
    decay still shrinks the weights, so an update-norm check alone would call the run alive.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("none known: weight decay with a gradient of exactly 0 moves weights "
                         "without learning on any run"),
        symptom_of=("zero_gradient", *ROOT_CAUSES),
        id="decay_only_update",
        severity=Severity.WARNING,
        summary="Run {run_id} moves its weights by weight decay alone",
        meaning="weights change while the gradient norm is zero: the movement is decay, not "
        "learning",
        fix="fix the zero gradient at its source (reward spread for GRPO, labels that are not all "
        "-100 for SFT); `weight_decay=0` only hides it",
        fires_when="weights move while the logged `grad_norm` is exactly 0 and weight decay "
        "> 0: decay, not learning",
        thresholds=(Threshold("decay_only_steps", "logged steps",
                              "consecutive logged steps with grad_norm exactly 0 and a weight "
                              "update"),),
        evidence=(Evidence("update_norm"), Evidence("grad_norm", 0), Evidence("learning_rate")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        grads = run.history("grad_norm")
        if not grads:
            return None
        if run.config.get("weight_decay", 0.0) <= 0:
            return Verdict(False)  # Adam momentum alone moves weights for a few steps
        window = grads[-settings.decay_only_steps:]
        if len(window) < settings.decay_only_steps:
            return Verdict(False)
        steps = run.combined_steps()
        points = [step_at(steps, s) for s, _ in window]
        if any(g != 0 for _, g in window) or any(
                p is None or p.learning_rate <= 0 or p.update_sq_sum <= 0 for p in points):
            return Verdict(False)
        last = points[-1]
        assert last is not None
        return Verdict(
            True,
            step=last.step,
            summary=(f"weights moved (update L2 {last.update_norm:.3g}) with grad_norm 0 for "
                     f"{len(window)} steps: weight decay "
                     f"{fmt(run.config.get('weight_decay'))} only"),
            evidence={"grad_norm": "0", "update_norm": fmt(last.update_norm),
                      "update_ratio": fmt(last.update_ratio),
                      "weight_decay": fmt(run.config.get("weight_decay")),
                      "learning_rate": fmt(last.learning_rate),
                      "steps": f"{window[0][0]}-{window[-1][0]}", "step": fmt(last.step)},
        )
