"""Detectors over GRPO/RLOO logs: the KL term and the reward spread that drives advantages."""

from __future__ import annotations

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import (
    SpecDetector,
    Verdict,
    finite_history,
    fmt,
    is_rl,
    trailing_streak,
    warmup_steps,
)
from .spec import (
    ROOT_CAUSES,
    DetectorSpec,
    Evidence,
    Severity,
    Threshold,
)


def _beta(run: RunState) -> float:
    return run.config.get("beta", 0.0)


class KlMissing(SpecDetector):
    """beta > 0 yet the trainer never logs ``kl``: the KL term is not computed as configured."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a run that logs rarely (large logging_steps) or whose trainer names its "
                         "KL key differently"),
        id="kl_missing",
        severity=Severity.WARNING,
        summary="Run {run_id} was configured with a KL penalty but logs no KL",
        meaning="beta > 0 but no `kl` value arrives, so the KL anchor cannot be checked",
        fix="pass `beta` straight to the trainer config (`GRPOConfig(beta=0.04)`) and make sure "
        "the trainer logs (`logging_steps`)",
        fires_when="beta > 0 but no `kl` key in the logs (beta set where the trainer never read "
        "it)",
        thresholds=(Threshold("kl_missing_logs", "log reports",
                              "log reports with a loss but no `kl` key (beta > 0) before it "
                              "fires"),),
        evidence=(Evidence("kl_series"), Evidence("step")),
    )

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


class KlStuckZero(SpecDetector):
    """beta > 0 and ``kl`` is exactly 0 after the first updates: policy equals reference.

    Step 1 (and warmup steps at lr 0) legitimately log 0; later an exact 0 means the policy
    never moved, or the reference moves with it.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("the first steps of a run whose reference is the policy's own start (KL "
                         "is 0 until the policy moves); the warmup and step 1 are left out"),
        symptom_of=ROOT_CAUSES,
        id="kl_stuck_zero",
        severity=Severity.WARNING,
        summary="Run {run_id} logs a KL of exactly 0 after the first step",
        meaning="KL to the reference stays exactly 0: the policy equals the reference, so it is "
        "not moving (or the reference is the policy itself)",
        fix="fix frozen weights first (`is_trainable=True`); with a full model pass a separate "
        "`ref_model`, not the policy object",
        fires_when="beta > 0 and `kl` exactly 0 after step 1 and the warmup: the policy equals "
        "the reference",
        thresholds=(Threshold("kl_zero_logs", "log reports",
                              "consecutive log reports with `kl` exactly 0 (after warmup) "
                              "before it fires"),),
        evidence=(Evidence("kl", 0), Evidence("update_norm"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None or not is_rl(run) or _beta(run) <= 0:
            return None
        warmup = warmup_steps(run)
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


class ZeroRewardVariance(SpecDetector):
    """Every completion of a prompt gets the same combined reward: advantages and gradients are 0.

    The advantage comes from the combined (weighted) reward, so that is what is judged: from
    ``frac_reward_zero_std`` (1 when every group of the combined reward is flat, e.g. a reward
    that depends on the prompt only) when the trainer logs it, else from every
    ``rewards/<fn>/std`` being 0 (all functions constant, or the only one). A constant format
    or shape reward beside a varying one is a healthy recipe: the varying one still spreads the
    groups. ``reward_std`` is not used, it stays > 0 when rewards differ only between prompts.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "reward-std-alone", "single-flat-reward-step"),
        false_positives=("none known at critical: a reward that never spread any group since "
                         "the run's first report cannot rank completions; a task so easy or so "
                         "hard that every group scores the same for a window after spreading "
                         "earlier (binary rewards late in training) is healthy for a while, so "
                         "it fires as a warning"),
        id="zero_reward_variance",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the combined reward did spread its groups earlier in the run and then "
        "went flat (a task solved or saturated, or a reward broken mid-run)",
        summary="Run {run_id} gets the same reward for every completion of a prompt",
        meaning="every GRPO group has zero spread in its combined reward, so advantages and "
        "gradients are zero",
        fix="make the reward depend on the completion (partial credit, not one fallback value) and "
        "sample with spread (`temperature=1.0`, more `num_generations`)",
        fires_when="the combined reward is flat for a window of logs: `frac_reward_zero_std == 1` "
        "(or, where it is not logged, every `rewards/<fn>/std == 0`); a constant function "
        "beside a varying one is left alone; `reward_std` is not used, it stays > 0 when "
        "rewards differ only between prompts",
        thresholds=(Threshold("zero_reward_logs", "log reports",
                              "consecutive log reports with frac_reward_zero_std == 1 (or, "
                              "without it, with every rewards/<fn>/std == 0; one such step "
                              "happens on healthy tiny runs)"),),
        evidence=(Evidence("frac_reward_zero_std", 1), Evidence("reward_std"),
                  Evidence("reward"), Evidence("grad_norm", 0), Evidence("update_norm", 0)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        n = settings.zero_reward_logs
        frac = finite_history(run, "frac_reward_zero_std")
        per_function = {key: finite_history(run, key)[-n:] for key in sorted(run.log_history)
                        if key.startswith("rewards/") and key.endswith("/std")}
        constant = sorted(key for key, window in per_function.items()
                          if len(window) == n and all(v == 0 for _, v in window))
        if frac:  # the trainer's own measure of the combined reward's groups
            window = frac[-n:]
            flat = len(window) == n and all(v >= 1.0 for _, v in window)
            last_step = window[-1][0]
            spread = [step for step, v in frac if v < 1.0]
        else:  # without it: flat only when every function is (the combined one is then too)
            flat = bool(per_function) and len(constant) == len(per_function)
            last_step = max((per_function[key][-1][0] for key in constant), default=0)
            spread = [step for key in per_function for step, v in finite_history(run, key)
                      if v > 0]
        if not flat:
            return Verdict(False) if frac or per_function or run.history("reward") else None
        names = ", ".join(key.removeprefix("rewards/").removesuffix("/std") for key in constant)
        # Spread seen earlier: the reward can rank completions, the groups went flat since (a
        # healthy saturated task can do that for a while): likely wrong, not certainly.
        spread_until = max(spread, default=None)
        return Verdict(
            True,
            step=last_step,
            severity=None if spread_until is None else Severity.WARNING,
            summary=(f"no spread in the combined reward within groups for {n} log reports"
                     + (f" (constant reward functions: {names})" if names else "")
                     + ("" if spread_until is None else
                        f" after spreading until step {spread_until} (a task solved or "
                        "saturated, or a reward broken mid-run)")
                     + f"; grad_norm={fmt(run.log_value('grad_norm'))}"),
            evidence={**({"frac_reward_zero_std": fmt(frac[-1][1])} if frac else {}),
                      **({} if spread_until is None else {"spread_until_step": fmt(spread_until)}),
                      **{key: "0" for key in constant},
                      "window_logs": fmt(n),
                      "reward": fmt(run.log_value("reward")),
                      "reward_std": fmt(run.log_value("reward_std")),
                      "grad_norm": fmt(run.log_value("grad_norm")),
                      "update_norm": fmt(_update_norm(run)), "step": fmt(last_step)},
        )


class CompletionsTruncated(SpecDetector):
    """Every GRPO/RLOO completion hits max_completion_length: the policy never sees an ending.

    ``completions/clipped_ratio`` is 1 and ``completions/mean_terminated_length`` 0 in every
    log report of the window; rewards still vary, so nothing else fires.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "grpo-terminating-model"),
        false_positives=("tiny test models and short max_completion_length settings where no "
                         "completion can end; a task whose answers are meant to be cut"),
        id="completions_truncated",
        severity=Severity.WARNING,
        summary="Run {run_id}: no completion ever ends",
        meaning="every GRPO/RLOO completion hits max_completion_length (clipped_ratio 1, no "
        "terminated completion): the policy never sees an ending",
        fix="raise `max_completion_length` and check generation stops on the chat template's "
        "end-of-turn token",
        fires_when="`completions/clipped_ratio` is 1 and `completions/mean_terminated_length` "
        "0 in every log report of the window",
        thresholds=(Threshold("truncated_logs", "log reports",
                              "consecutive log reports with every completion truncated"),),
        evidence=(Evidence("completion_mean_length"), Evidence("reward")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if not is_rl(run):
            return None
        clipped = finite_history(run, "completions/clipped_ratio")
        if not clipped:
            return None
        terminated = dict(run.history("completions/mean_terminated_length"))
        streak = trailing_streak(
            clipped, lambda report: report[1] >= 1.0 and not (terminated.get(report[0]) or 0) > 0)
        reached = streak.reached(settings.truncated_logs)
        if reached is None:
            return Verdict(False)
        window = streak.items
        return Verdict(
            True,
            step=reached[0],
            summary=(f"every completion was cut at max_completion_length="
                     f"{fmt(run.config.get('max_completion_length'))} for {len(window)} log "
                     f"reports (steps {window[0][0]}-{window[-1][0]}): no completion ends"),
            evidence={"clipped_ratio": "1", "mean_terminated_length": "0",
                      "window_logs": fmt(len(window)),
                      "max_completion_length": fmt(run.config.get("max_completion_length")),
                      "mean_length": fmt(run.log_value("completions/mean_length")),
                      "step": fmt(window[-1][0])},
        )
