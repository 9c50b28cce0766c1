"""Detectors over trends in a window of logs: collapses that a rising reward hides.

Each compares the run with itself (a relative drop from the run's own start), never with an
absolute floor: a tiny model's entropy sits near 5.75 for a whole healthy run.
"""

from __future__ import annotations

from deadweight.sidecar.detectors.base import (
    Policy,
    Severity,
    Verdict,
    finite_history,
    fmt,
    is_rl,
    mean,
)
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import RunState


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


class _Collapse:
    key = ""
    what = ""
    latching = False
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

    id = "entropy_collapse"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    key = "entropy"
    what = "entropy"

    def _drop(self, settings: DetectorSettings) -> float:
        return settings.entropy_drop


class CompletionLengthCollapse(_Collapse):
    """Mean completion length fell far below the run's own start (a GRPO shortcut)."""

    id = "completion_length_collapse"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    key = "completions/mean_length"
    what = "mean completion length"

    def _drop(self, settings: DetectorSettings) -> float:
        return settings.length_drop


class DpoLikelihoodCollapse:
    """DPO pushes chosen and rejected likelihoods down together while the margin grows.

    Over the window both implicit rewards stay below the reference (< 0) and fall, while the
    margin rises: the loss improves because rejected falls faster, not because chosen rises.
    """

    id = "dpo_likelihood_collapse"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = False

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
        if not (below and falling and late(margins) > early(margins)):
            return Verdict(False)
        return Verdict(
            True,
            step=chosen[-1][0],
            summary=(f"chosen reward fell {early(chosen):.4g} -> {late(chosen):.4g} and rejected "
                     f"{early(rejected):.4g} -> {late(rejected):.4g} while the margin rose "
                     f"{early(margins):.4g} -> {late(margins):.4g}"),
            evidence={"chosen_early": fmt(early(chosen)), "chosen_late": fmt(late(chosen)),
                      "rejected_early": fmt(early(rejected)),
                      "rejected_late": fmt(late(rejected)),
                      "margin_early": fmt(early(margins)), "margin_late": fmt(late(margins)),
                      "window_logs": fmt(n), "step": fmt(chosen[-1][0])},
        )
