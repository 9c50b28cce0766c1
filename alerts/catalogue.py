"""The one table every alert artefact is generated from, so names cannot drift.

Each paging detector gets one Prometheus alert, one runbook, one line in the runbook index and
a firing plus a silent `promtool test rules` case. Alert names and runbook links are computed by
the same functions the sidecar's own Alertmanager push uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Metric name -> value used in the promtool firing case (healthy values come from HEALTHY).
Evidence = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class DetectorAlert:
    """One detector's alert: identity, wording, and the evidence its description quotes.

    `scope` says when the alert resolves: "run" alerts hold only while the run is active (the
    problem is the training itself: it ends with the run); "artifact" alerts describe what the
    run wrote and stay until the sidecar expires the finished run's series.
    """

    detector: str
    severity: str
    summary: str
    meaning: str
    evidence: Evidence
    scope: str = "run"
    firing_values: dict[str, float] = field(default_factory=dict)


def _ev(*names: str) -> Evidence:
    """Evidence entries: (label shown in the description, PromQL with one %q for run_id)."""
    out = []
    for name in names:
        if name == "seconds_since_last_step":
            expr = "time() - max(deadweight_last_step_timestamp_seconds{run_id=%q})"
        elif name == "kl_series":
            expr = "count(deadweight_kl{run_id=%q})"
        else:
            expr = "max(deadweight_" + name + "{run_id=%q})"
        out.append((name, expr))
    return tuple(out)


# Values the evidence metrics take in the healthy promtool cases and, unless a detector
# overrides them, in its firing case.
HEALTHY: dict[str, float] = {
    "step": 40,
    "loss": 1.25,
    "grad_norm": 0.41,
    "learning_rate": 0.0002,
    "update_norm": 0.0031,
    "update_ratio": 0.62,
    "frozen_steps": 0,
    "optimizer_params": 8,
    "trainable_params": 8,
    "grad_not_in_optimizer_params": 0,
    "checkpoints_total": 2,
    "checkpoint_unchanged_total": 0,
    "checkpoint_adapter_bytes": 41280,
    "kl": 0.012,
    "reward": 0.55,
    "reward_std": 0.21,
    "frac_reward_zero_std": 0,
    "entropy": 1.9,
    "completion_mean_length": 118,
}

DETECTORS: tuple[DetectorAlert, ...] = (
    DetectorAlert(
        "frozen_weights", "critical",
        "Run {{ $labels.run_id }} reports a live loss but its weights do not move",
        "optimizer steps with lr > 0, finite loss and grad_norm > 0 left every trainable "
        "weight unchanged",
        _ev("frozen_steps", "update_norm", "update_ratio", "loss", "grad_norm", "learning_rate"),
        firing_values={"frozen_steps": 12, "update_norm": 0, "update_ratio": 0},
    ),
    DetectorAlert(
        "empty_optimizer", "critical",
        "Run {{ $labels.run_id }} trains with an optimizer that holds no parameters",
        "the optimizer was built with zero parameters, so no step can change the model",
        _ev("optimizer_params", "trainable_params", "grad_norm", "loss"),
        firing_values={"optimizer_params": 0, "trainable_params": 0},
    ),
    DetectorAlert(
        "grad_not_in_optimizer", "critical",
        "Run {{ $labels.run_id }} computes gradients for parameters its optimizer does not hold",
        "parameters receive gradients (grad_norm looks alive) but are not in the optimizer, "
        "so they are never updated",
        _ev("grad_not_in_optimizer_params", "optimizer_params", "grad_norm", "update_norm"),
        firing_values={"grad_not_in_optimizer_params": 8, "optimizer_params": 0,
                       "update_norm": 0},
    ),
    DetectorAlert(
        "checkpoint_unchanged", "critical",
        "Run {{ $labels.run_id }} writes checkpoints identical to the initial adapter",
        "the saved adapter tensors hash equal to the previous or initial ones: the run "
        "produces nothing new",
        _ev("checkpoint_unchanged_total", "checkpoints_total", "update_norm", "loss"),
        scope="artifact",
        firing_values={"checkpoint_unchanged_total": 2, "update_norm": 0},
    ),
    DetectorAlert(
        "adapter_never_trained", "critical",
        "Run {{ $labels.run_id }} saved an adapter that was never trained",
        "every lora_B tensor in the saved adapter is exactly zero: the adapter is the "
        "identity it started as",
        _ev("checkpoints_total", "checkpoint_adapter_bytes", "update_norm"),
        scope="artifact",
        firing_values={"update_norm": 0},
    ),
    DetectorAlert(
        "nonfinite_loss", "critical",
        "Run {{ $labels.run_id }} reports a NaN or infinite loss or grad norm",
        "the loss or the gradient norm is not finite; every later update is garbage",
        _ev("loss", "grad_norm", "step"),
        firing_values={"loss": float("inf")},
    ),
    DetectorAlert(
        "stalled", "critical",
        "Run {{ $labels.run_id }} stopped making progress",
        "no message at all arrived within the stall window (the process is gone or frozen), "
        "or heartbeats still arrive but no optimizer step did (the training loop is hung)",
        _ev("seconds_since_last_step", "step"),
    ),
    DetectorAlert(
        "zero_reward_variance", "critical",
        "Run {{ $labels.run_id }} gets the same reward for every completion of a prompt",
        "every GRPO group has zero reward spread, so advantages and gradients are zero",
        _ev("frac_reward_zero_std", "reward_std", "reward", "grad_norm", "update_norm"),
        firing_values={"frac_reward_zero_std": 1, "grad_norm": 0, "update_norm": 0},
    ),
    DetectorAlert(
        "inactive_adapter", "critical",
        "Run {{ $labels.run_id }} trains an adapter other than the one it saves",
        "an adapter the run was configured to train is not active or not in the optimizer "
        "(never activated, or switched by set_adapter mid-run)",
        _ev("optimizer_params", "trainable_params", "grad_not_in_optimizer_params"),
        firing_values={"optimizer_params": 4, "grad_not_in_optimizer_params": 4},
    ),
    DetectorAlert(
        "decay_only_update", "warning",
        "Run {{ $labels.run_id }} moves its weights by weight decay alone",
        "weights change while the gradient norm is zero: the movement is decay, not learning",
        _ev("update_norm", "grad_norm", "learning_rate"),
        firing_values={"grad_norm": 0},
    ),
    DetectorAlert(
        "adapter_bloat", "warning",
        "Run {{ $labels.run_id }} saves an adapter with full (non-LoRA) tensors",
        "the adapter file holds non-LoRA tensors (embed_tokens, lm_head, wte) and is far "
        "larger than its LoRA weights",
        _ev("checkpoint_adapter_bytes", "checkpoints_total"),
        scope="artifact",
        firing_values={"checkpoint_adapter_bytes": 483328},
    ),
    DetectorAlert(
        "embedding_resized", "warning",
        "Run {{ $labels.run_id }} resized the token embeddings under a LoRA adapter",
        "the embedding rows differ from the base vocabulary, so the adapter will carry the "
        "whole embedding and no longer load on the base model",
        _ev("checkpoint_adapter_bytes", "trainable_params"),
        scope="artifact",
    ),
    DetectorAlert(
        "partial_target_modules", "warning",
        "Run {{ $labels.run_id }} asked for LoRA target modules that matched nothing",
        "some requested target_modules matched no module in the model (PEFT raises only when "
        "none match), so part of the intended adapter does not exist",
        _ev("trainable_params", "optimizer_params"),
        firing_values={"trainable_params": 4, "optimizer_params": 4},
    ),
    DetectorAlert(
        "kl_missing", "warning",
        "Run {{ $labels.run_id }} was configured with a KL penalty but logs no KL",
        "beta > 0 but no `kl` value arrives, so the KL anchor cannot be checked",
        _ev("kl_series", "step"),
    ),
    DetectorAlert(
        "kl_stuck_zero", "warning",
        "Run {{ $labels.run_id }} logs a KL of exactly 0 after the first step",
        "KL to the reference stays exactly 0: the policy equals the reference, so it is "
        "not moving (or the reference is the policy itself)",
        _ev("kl", "update_norm", "step"),
        firing_values={"kl": 0},
    ),
    DetectorAlert(
        "entropy_collapse", "warning",
        "Run {{ $labels.run_id }}: policy entropy is collapsing",
        "token entropy fell steadily over the window while reward rose: the policy is "
        "becoming deterministic",
        _ev("entropy", "reward"),
        firing_values={"entropy": 0.05},
    ),
    DetectorAlert(
        "completion_length_collapse", "warning",
        "Run {{ $labels.run_id }}: completions are getting much shorter",
        "mean completion length fell steadily over the window: the policy drifts to short "
        "answers",
        _ev("completion_mean_length", "reward", "kl_series"),
        firing_values={"completion_mean_length": 9},
    ),
    DetectorAlert(
        "lora_lr_too_low", "warning",
        "Run {{ $labels.run_id }} trains a LoRA adapter with a full-fine-tune learning rate",
        "the learning rate is far below the LoRA range (1e-4..2e-4), so the adapter learns "
        "almost nothing",
        _ev("learning_rate", "update_ratio", "update_norm"),
        firing_values={"learning_rate": 1e-06, "update_norm": 2e-06},
    ),
    DetectorAlert(
        "pickle_checkpoint", "warning",
        "Run {{ $labels.run_id }} wrote a pickle checkpoint",
        "a checkpoint holds a pickle file (adapter_model.bin / pytorch_model.bin); loading it "
        "can run arbitrary code",
        _ev("checkpoints_total"),
        scope="artifact",
    ),
    DetectorAlert(
        "dpo_likelihood_collapse", "warning",
        "Run {{ $labels.run_id }}: DPO chosen and rejected rewards are both falling",
        "the likelihood of chosen and rejected answers both drop while the margin grows: "
        "the model is unlearning both",
        _ev("loss", "reward", "update_norm"),
    ),
    DetectorAlert(
        "no_kl_anchor", "info",
        "Run {{ $labels.run_id }} trains with beta = 0 (no KL anchor to the reference)",
        "GRPO/RLOO run without a KL penalty; the policy may drift (often fine, but worth "
        "knowing when completions shrink)",
        _ev("kl_series", "completion_mean_length"),
    ),
)

# Non-detector alerts (the monitoring path itself).
SIDECAR_DOWN = "DeadweightSidecarDown"
RUN_STALE = "DeadweightRunStale"
DEFAULT_JOB_SELECTOR = 'job=~".*deadweight.*"'
DEFAULT_STALE_SECONDS = 900

# Inhibitions: a root cause silences its symptoms for the same run.
ROOT_CAUSES = ("frozen_weights", "empty_optimizer")
SYMPTOMS = (
    "zero_reward_variance",
    "kl_stuck_zero",
    "decay_only_update",
    "checkpoint_unchanged",
    "adapter_never_trained",
    "grad_not_in_optimizer",
)
