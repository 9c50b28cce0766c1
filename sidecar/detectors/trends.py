"""Detectors over trends in a window of logs: collapses that a rising reward hides.

Each compares the run with itself (a relative drop from the run's own start), never with an
absolute floor: a tiny model's entropy sits near 5.75 for a whole healthy run.
"""

from __future__ import annotations

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import (
    SpecDetector,
    Verdict,
    finite_history,
    fmt,
    is_rl,
    mean,
)
from .spec import DetectorSpec, Evidence, Severity, Threshold

#: Shared by the two collapse detectors: how many log reports each average covers.
TREND_LOGS = Threshold("trend_logs", "log reports",
                       "log reports averaged for the baseline (the run's first reports) and for "
                       "the current value (the latest reports)")


def _relative_drop(run: RunState, key: str, n: int, drop: float
                   ) -> tuple[float, float, int, int] | None:
    """(baseline, current, first_step, last_step) when key fell by more than drop, else None."""
    values = finite_history(run, key)
    if len(values) < 2 * n:
        return None
    baseline = mean([v for _, v in values[:n]])
    current = mean([v for _, v in values[-n:]])
    if baseline <= 0 or current >= baseline * (1.0 - drop):
        return None
    return baseline, current, values[0][0], values[-1][0]


class _Collapse(SpecDetector):
    key = ""
    what = ""
    #: Only for runs that sample their own completions (GRPO/RLOO): in SFT a falling entropy
    #: is the model learning its data, not a collapse.
    rl_only = True

    def _drop(self, settings: DetectorSettings) -> float:
        raise NotImplementedError

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if not run.history(self.key) or (self.rl_only and not is_rl(run)):
            return None
        found = _relative_drop(run, self.key, settings.trend_logs, self._drop(settings))
        if found is None:
            return Verdict(False)
        baseline, current, first, last = found
        return Verdict(
            True,
            step=last,
            summary=(f"{self.what} fell {1 - current / baseline:.0%} from {baseline:.4g} to "
                     f"{current:.4g} (steps {first}-{last}) while reward="
                     f"{fmt(run.log_value('reward'))}"),
            evidence={"baseline": fmt(baseline), "current": fmt(current),
                      "drop": fmt(1 - current / baseline), "threshold": fmt(self._drop(settings)),
                      "window_logs": fmt(settings.trend_logs), "step": fmt(last),
                      "reward": fmt(run.log_value("reward"))},
        )


class EntropyCollapse(_Collapse):
    """Token entropy of sampled completions fell far below the run's own start.

    The policy became near-deterministic: exploration is gone though the reward still rises.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "sft-learning-its-data", "constant-entropy"),
        false_positives=("a policy that becomes confident because it learned the task (entropy "
                         "falls while reward rises for good reasons)"),
        id="entropy_collapse",
        severity=Severity.WARNING,
        summary="Run {run_id}: policy entropy is collapsing",
        meaning="token entropy fell steadily over the window while reward rose: the policy is "
        "becoming deterministic",
        fix="anchor the policy with a KL penalty (`GRPOConfig(beta=0.04)`), lower the learning "
        "rate and check the reward for an exploit",
        fires_when="GRPO/RLOO: mean `entropy` of the latest logs fell below the run's own start "
        "by more than the threshold (relative, never an absolute floor; SFT's entropy falls "
        "as it learns)",
        thresholds=(TREND_LOGS, Threshold("entropy_drop", "fraction",
                                          "fires when current entropy < baseline * (1 - this)")),
        evidence=(Evidence("entropy", 0.05), Evidence("reward")),
    )
    key = "entropy"
    what = "entropy"

    def _drop(self, settings: DetectorSettings) -> float:
        return settings.entropy_drop


class CompletionLengthCollapse(_Collapse):
    """Mean completion length fell far below the run's own start (a GRPO shortcut)."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives="a task whose right answers are short, learned as the run goes",
        id="completion_length_collapse",
        severity=Severity.WARNING,
        summary="Run {run_id}: completions are getting much shorter",
        meaning="mean completion length fell steadily over the window: the policy drifts to "
        "short answers",
        fix="set a KL penalty (`GRPOConfig(beta=0.04)`) and check the reward for a length bias",
        fires_when="GRPO/RLOO: mean `completions/mean_length` of the latest logs fell below the "
        "run's start by more than the threshold",
        thresholds=(TREND_LOGS, Threshold("length_drop", "fraction",
                                          "fires when current mean length < baseline * "
                                          "(1 - this)")),
        evidence=(Evidence("completion_mean_length", 9), Evidence("reward"),
                  Evidence("kl_series")),
    )
    key = "completions/mean_length"
    what = "mean completion length"

    def _drop(self, settings: DetectorSettings) -> float:
        return settings.length_drop


class DpoLikelihoodCollapse(SpecDetector):
    """DPO pushes chosen and rejected likelihoods down together while the margin grows.

    Over the window both implicit rewards stay below the reference (< 0) and fall while the
    margin rises, and chosen's fall is as large as the separation: over the window chosen fell
    by at least what the margin gained (rejected falls less than twice as fast as chosen), and
    it lies below the reference by at least the margin. The loss improves by lowering both, not
    by raising chosen. Likelihood displacement in a healthy run (chosen dips a little, well
    under the margin it opens, and levels off) stays silent.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "dpo-margin-grows-chosen-rises"),
        false_positives=("DPO commonly lowers both likelihoods a little while learning; the window"
                         " may catch a healthy run"),
        id="dpo_likelihood_collapse",
        severity=Severity.WARNING,
        summary="Run {run_id}: DPO chosen and rejected rewards are both falling",
        meaning="the likelihood of chosen and rejected answers both drop while the margin "
        "grows, chosen by as much as the margin: the model is unlearning both",
        fix="add an NLL term on the chosen answers (`DPOConfig(rpo_alpha=1.0)`), lower the "
        "learning rate or raise `beta`",
        fires_when="over the window DPO's `rewards/chosen` and `rewards/rejected` are both "
        "below 0 and falling while `rewards/margins` grows, and chosen fell by at least the "
        "margin's growth and lies below minus the margin (a dip smaller than the margin it "
        "opens, normal likelihood displacement, is left alone)",
        thresholds=(Threshold("dpo_window", "log reports",
                              "log reports in the window over which chosen and rejected "
                              "rewards must both fall (and stay below the reference) while the "
                              "margin grows"),),
        evidence=(Evidence("loss"), Evidence("reward"), Evidence("update_norm")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        n = settings.dpo_window
        chosen = finite_history(run, "rewards/chosen")[-n:]
        rejected = finite_history(run, "rewards/rejected")[-n:]
        margins = finite_history(run, "rewards/margins")[-n:]
        if not chosen:
            return None
        if min(len(chosen), len(rejected), len(margins)) < n:
            return Verdict(False)
        half = max(1, n // 2)

        def early(xs: list[tuple[int, float]]) -> float:
            return mean([v for _, v in xs[:half]])

        def late(xs: list[tuple[int, float]]) -> float:
            return mean([v for _, v in xs[-half:]])

        below = all(v < 0 for _, v in chosen) and all(v < 0 for _, v in rejected)
        falling = late(chosen) < early(chosen) and late(rejected) < early(rejected)
        gain = late(margins) - early(margins)
        if not (below and falling and gain > 0):
            return Verdict(False)
        # Chosen's fall is large against the separation, over the window and since the
        # reference: not a dip that levels off while the margin opens.
        chosen_fall = early(chosen) - late(chosen)
        if chosen_fall < gain or -late(chosen) < late(margins):
            return Verdict(False)
        return Verdict(
            True,
            step=chosen[-1][0],
            summary=(f"chosen reward fell {early(chosen):.4g} -> {late(chosen):.4g} and rejected "
                     f"{early(rejected):.4g} -> {late(rejected):.4g} while the margin rose "
                     f"{early(margins):.4g} -> {late(margins):.4g}: both likelihoods collapse"),
            evidence={"chosen_early": fmt(early(chosen)), "chosen_late": fmt(late(chosen)),
                      "rejected_early": fmt(early(rejected)),
                      "rejected_late": fmt(late(rejected)),
                      "margin_early": fmt(early(margins)), "margin_late": fmt(late(margins)),
                      "window_logs": fmt(n), "step": fmt(chosen[-1][0])},
        )
