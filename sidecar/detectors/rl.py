"""Detectors over GRPO/RLOO logs: the KL term and the reward spread that drives advantages."""

from __future__ import annotations

from deadweight.sidecar.detectors.base import (
    Policy,
    Severity,
    Verdict,
    finite_history,
    fmt,
    is_rl,
)
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import RunState


def _beta(run: RunState) -> float:
    return run.config.get("beta", 0.0)


class KlMissing:
    """beta > 0 yet the trainer never logs ``kl``: the KL term is not computed as configured."""

    id = "kl_missing"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = False

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None or not is_rl(run) or _beta(run) <= 0:
            return None
        losses = run.history("loss")
        if run.history("kl") or len(losses) < settings.kl_missing_logs:
            return Verdict(False)
        return Verdict(
            True,
            step=losses[-1][0],
            summary=f"beta={_beta(run):g} but no kl in {len(losses)} log reports",
            evidence={"beta": fmt(_beta(run)), "log_reports": fmt(len(losses)),
                      "step": fmt(losses[-1][0])},
        )


class KlStuckZero:
    """beta > 0 and ``kl`` is exactly 0 after the first updates: policy equals reference.

    Step 1 (and warmup steps at lr 0) legitimately log 0; later an exact 0 means the policy
    never moved, or the reference moves with it.
    """

    id = "kl_stuck_zero"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = False

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None or not is_rl(run) or _beta(run) <= 0:
            return None
        warmup = int(run.config.get("resolved_warmup_steps", run.config.get("warmup_steps", 0)))
        values = [(s, v) for s, v in finite_history(run, "kl") if s > warmup + 1]
        window = values[-settings.kl_zero_logs:]
        if len(window) < settings.kl_zero_logs or any(v != 0 for _, v in window):
            return Verdict(False)
        return Verdict(
            True,
            step=window[-1][0],
            summary=(f"kl exactly 0 for {len(window)} log reports (steps "
                     f"{window[0][0]}-{window[-1][0]}) with beta={_beta(run):g}"),
            evidence={"kl": "0", "beta": fmt(_beta(run)), "zero_logs": fmt(len(window)),
                      "steps": f"{window[0][0]}-{window[-1][0]}",
                      "update_norm": fmt(_update_norm(run))},
        )


def _update_norm(run: RunState) -> float | None:
    steps = run.combined_steps()
    return steps[-1].update_norm if steps else None


class ZeroRewardVariance:
    """Every completion of a prompt gets the same reward: advantages and gradients are 0.

    Read from ``frac_reward_zero_std`` (1 when every group is flat, e.g. a reward that depends
    on the prompt only) and each ``rewards/<fn>/std`` (0 when a function is constant), over a
    window; ``reward_std`` is not used, it stays > 0 when rewards differ only between prompts.
    """

    id = "zero_reward_variance"
    severity = Severity.CRITICAL
    default_policy = Policy.PAGE
    latching = False

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        n = settings.zero_reward_logs
        flat: dict[str, str] = {}
        last_step = 0
        frac = finite_history(run, "frac_reward_zero_std")[-n:]
        if len(frac) == n and all(v >= 1.0 for _, v in frac):
            flat["frac_reward_zero_std"] = fmt(frac[-1][1])
            last_step = frac[-1][0]
        for key in sorted(run.log_history):
            if not (key.startswith("rewards/") and key.endswith("/std")):
                continue
            window = finite_history(run, key)[-n:]
            if len(window) == n and all(v == 0 for _, v in window):
                flat[key] = "0"
                last_step = max(last_step, window[-1][0])
        if not flat:
            return Verdict(False) if frac or run.history("reward") else None
        return Verdict(
            True,
            step=last_step,
            summary=(f"no reward spread within groups for {n} log reports "
                     f"({', '.join(sorted(flat))}); grad_norm={fmt(run.log_value('grad_norm'))}"),
            evidence={**flat, "window_logs": fmt(n),
                      "reward": fmt(run.log_value("reward")),
                      "reward_std": fmt(run.log_value("reward_std")),
                      "grad_norm": fmt(run.log_value("grad_norm")),
                      "update_norm": fmt(_update_norm(run)), "step": fmt(last_step)},
        )
