"""Detectors over what a run reports about itself: the stream, not the training.

A run whose step numbers go backwards or leap ahead is not monitored any more (every later
step would look old and be dropped); a run id that two live processes use is two jobs
reporting as one. Neither is a training failure, both make the other verdicts blind.
"""

from __future__ import annotations

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import SpecDetector, Verdict, fmt
from .spec import (
    DetectorSpec,
    Evidence,
    Policy,
    Severity,
    Threshold,
)


class StepOutOfOrder(SpecDetector):
    """Step reports with a new sequence number but a step no newer than the rank's newest,
    again and again, or one step far beyond it: the client's step counter is broken (or
    forged), and the steps it sends are not applied."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "resent-batches-after-reconnect"),
        false_positives="a loop that reports an epoch or a counter that resets on purpose",
        id="step_out_of_order",
        severity=Severity.WARNING,
        policy=Policy.OBSERVE,
        latching=True,
        summary="Run {run_id} reports optimizer steps out of order",
        meaning="the run's step reports go backwards or leap far ahead, so the sidecar drops "
        "them and its step verdicts (frozen_weights, stalled, ...) no longer see the run",
        fix="report the optimizer step (`monitor.log(step, ...)`), not an epoch or a counter "
        "that resets, and give each job its own run id",
        fires_when="a rank sent `out_of_order_steps` step reports no newer than its newest "
        "step (new sequence numbers, so not re-sends), or one step over a million beyond it "
        "or below zero (refused), or an outlier step the reports after it went on from below",
        thresholds=(Threshold("out_of_order_steps", "reports",
                              "step reports no newer than the rank's newest before the "
                              "finding fires"),),
        evidence=(Evidence("step"),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        bad = run.bad_step
        if bad is None or (not run.steps_too_far
                           and run.steps_out_of_order < settings.out_of_order_steps):
            return None
        rank, step, newest, why = bad
        said = _SAID.get(why, "is no newer than")
        return Verdict(
            True,
            step=run.step,
            summary=f"{run.steps_out_of_order} step report(s) out of order and "
            f"{run.steps_too_far} too far ahead were dropped; latest: rank {rank} step "
            f"{step} {said} its newest step {newest}",
            evidence={"rank": str(rank), "step": str(step), "newest": str(newest),
                      "reason": why, "out_of_order": fmt(run.steps_out_of_order),
                      "too_far": fmt(run.steps_too_far)},
        )


#: How each reason of a refused step reads after "rank R step S".
_SAID = {
    "too_far": "leaps over a million steps beyond",
    "negative": "is negative; refused, the newest step stays",
    "outlier": "was an outlier: the reports after it went on from",
}


class RunIdInUse(SpecDetector):
    """Another process tried to register a rank of this run while this one owns it: two jobs
    share one run id (a job template's fixed ``DEADWEIGHT_RUN_ID``, a relaunch while the old
    process still runs). The newcomer is refused and told so; this run keeps its rank."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives="a relaunch while the old process is still exiting",
        id="run_id_in_use",
        severity=Severity.WARNING,
        policy=Policy.OBSERVE,
        latching=True,
        summary="Run {run_id} is used by a second job at the same time",
        meaning="another process registered the same run id and rank while this run's "
        "process still lives; it was refused and is not monitored, and both jobs need their "
        "own run ids",
        fix="give each job its own run id (leave `DEADWEIGHT_RUN_ID` unset, or template it "
        "with the job's unique name) and stop an old process before relaunching",
        fires_when="a second live process (or an unattested stream before the attested job) "
        "registers a rank of the run that another process owns",
        evidence=(Evidence("step"),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if not run.collisions:
            return None
        return Verdict(
            True,
            step=run.step,
            summary=f"run id registered by another party {run.collisions} time(s) while "
            f"this run owns it; latest {run.collision}: that job is refused and unmonitored, "
            "give each job its own run id",
            evidence={"newcomer": run.collision, "collisions": fmt(run.collisions)},
        )
