"""Rollouts generated with stale weights: the generation engine samples from an old policy.

When an RL trainer generates with a separate engine (TRL's vLLM path), the trainer recomputes
the log-probabilities of the sampled tokens with its own, current weights and logs how far
they are from the engine's (``sampling/sampling_logp_difference/*``) and the importance
ratio between them (``sampling/importance_sampling_ratio/*``). A healthy run sits at a small
difference (about 0.015 nats per token, numerical noise between the two implementations);
an engine whose weights stopped being synchronised (sleep mode dropping them, a failed
weight sync) samples from an older policy, and the difference climbs (0.015 to 0.2 and
more) while every other metric looks ordinary. Only runs that log these keys are judged.
"""

from __future__ import annotations

import math
import statistics

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import SpecDetector, Verdict, fmt, trailing_streak
from .spec import DetectorSpec, Evidence, Severity, Threshold

LOGP_DIFFERENCE = "sampling/sampling_logp_difference/mean"
LOGP_DIFFERENCE_MAX = "sampling/sampling_logp_difference/max"
RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
RATIO_MIN = "sampling/importance_sampling_ratio/min"
#: Log reports whose median is the run's own baseline of the difference.
BASELINE_LOGS = 3


class RolloutStale(SpecDetector):
    """The trainer's log-probabilities of sampled tokens drift away from the engine's."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "rollout-healthy-twin"),
        false_positives=("a run whose logp difference rises for a reason other than stale weights "
                         "(numerics changed mid-run: another dtype or kernel on one side); only "
                         "on vLLM generation. A threshold on a drift, not proof: a warning"),
        id="rollout_stale",
        severity=Severity.WARNING,
        summary="Run {run_id} generates its rollouts with stale weights",
        meaning="the log-probabilities the trainer computes for the sampled tokens differ "
        "from the generation engine's far more than the run's own baseline: the engine "
        "samples from an old policy (its weights are no longer synchronised), so training "
        "is off-policy and the importance ratios throw the rollouts away",
        fix="make the generation engine follow the trained weights: turn vLLM sleep mode off "
        "(or use a TRL release that re-syncs after waking), and check the weight-sync calls",
        fires_when="`sampling/sampling_logp_difference/mean` above `rollout_logp_difference` "
        "and `rollout_rise` times the run's first logged values (or above "
        "`rollout_logp_ceiling`) in the last `rollout_stale_logs` log reports",
        thresholds=(Threshold("rollout_stale_logs", "log reports",
                              "consecutive log reports with the difference above its limit"),
                    Threshold("rollout_logp_difference", "nats per token",
                              "least mean log-probability difference that counts as stale"),
                    Threshold("rollout_rise", "ratio",
                              "least rise over the run's own first logged values"),
                    Threshold("rollout_logp_ceiling", "nats per token",
                              "a difference above this counts whatever the run began at (an "
                              "engine stale from the first step)")),
        evidence=(Evidence("sampling_logp_difference", 0.2), Evidence("reward")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        series = [(s, v) for s, v in run.history(LOGP_DIFFERENCE) if math.isfinite(v)]
        if not series:
            return None  # the run does not generate with a separate engine
        baseline = statistics.median(v for _, v in series[:BASELINE_LOGS])
        limit = min(max(settings.rollout_logp_difference, settings.rollout_rise * baseline),
                    settings.rollout_logp_ceiling)
        streak = trailing_streak(series, lambda entry: entry[1] > limit)
        reached = streak.reached(settings.rollout_stale_logs)
        if reached is None:
            return Verdict(False, step=series[-1][0])
        step, value = series[-1]
        ratio = run.logged_at(RATIO_MEAN, step)
        return Verdict(
            True,
            step=reached[0],
            summary=(f"the trainer's log-probabilities of the sampled tokens differ from the "
                     f"engine's by {value:.3g} nats per token at step {step} (the run began at "
                     f"{baseline:.3g}; limit {limit:.3g}) for {len(streak)} log reports: the "
                     f"generation engine samples with stale weights"),
            evidence={"sampling_logp_difference": fmt(value), "baseline": fmt(baseline),
                      "limit": fmt(limit),
                      "sampling_logp_difference_max": fmt(run.logged_at(LOGP_DIFFERENCE_MAX,
                                                                        step)),
                      "importance_sampling_ratio_mean": fmt(ratio),
                      "importance_sampling_ratio_min": fmt(run.logged_at(RATIO_MIN, step)),
                      "logs": fmt(len(streak)), "step": fmt(step)},
        )
