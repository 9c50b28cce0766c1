"""Detector thresholds and windows, with the defaults documented in the README.

Windows count log reports (one per ``logging_steps``) or optimizer steps, as each field says;
tests shorten them honestly through this one object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DetectorSettings:
    """Tunable thresholds; each field names the detector it belongs to."""

    #: frozen_weights: consecutive frozen optimizer steps (at lr > 0) before it fires.
    frozen_steps: int = 3
    #: frozen_weights: a scale-free update ratio below this counts as frozen
    #: (healthy tiny runs sit at 0.38-0.86; frozen runs at exactly 0).
    frozen_ratio_floor: float = 0.01
    #: stalled: seconds without any message (step, log or heartbeat) from a live run.
    stalled_seconds: float = 300.0
    #: stalled: seconds without an optimizer step while heartbeats still arrive (a hung loop
    #: whose sender thread is alive); long enough for slow steps and evaluations.
    stalled_step_seconds: float = 1800.0
    #: inactive_adapter: consecutive optimizer steps (lr > 0) in which an adapter the optimizer
    #: holds stayed unchanged while another adapter received gradients or moved.
    inactive_adapter_steps: int = 2
    #: decay_only_update: consecutive logged steps with grad_norm exactly 0 and a weight update.
    decay_only_steps: int = 3
    #: lora_lr_too_low: a PEFT run configured below this learning rate is flagged
    #: (full fine-tune defaults are 2e-5 for SFT, 1e-6 for GRPO/DPO; LoRA wants ~1e-4).
    lora_lr_floor: float = 3e-5
    #: kl_missing: log reports with a loss but no `kl` key (beta > 0) before it fires.
    kl_missing_logs: int = 2
    #: kl_stuck_zero: consecutive log reports with `kl` exactly 0 (after warmup) before it fires.
    kl_zero_logs: int = 3
    #: zero_reward_variance: consecutive log reports with frac_reward_zero_std == 1, or with a
    #: rewards/<fn>/std == 0 (a single such step happens on healthy tiny runs).
    zero_reward_logs: int = 4
    #: entropy_collapse / completion_length_collapse: log reports averaged for the baseline
    #: (the run's first reports) and for the current value (the latest reports).
    trend_logs: int = 3
    #: entropy_collapse: fires when current entropy < baseline * (1 - this).
    entropy_drop: float = 0.4
    #: completion_length_collapse: fires when current mean length < baseline * (1 - this).
    length_drop: float = 0.4
    #: dpo_likelihood_collapse: log reports in the window over which chosen and rejected
    #: rewards must both fall (and stay below the reference) while the margin grows.
    dpo_window: int = 5
    #: adapter_bloat: non-LoRA parameters saved in an adapter, relative to its LoRA parameters.
    adapter_bloat_ratio: float = 1.0
    #: zero_gradient: consecutive log reports (at lr > 0) with grad_norm exactly 0.
    zero_gradient_logs: int = 3
    #: optimizer_steps_skipped: consecutive optimizer steps the optimizer skipped (fp16 loss
    #: scaling saw inf/NaN gradients) before it fires.
    skipped_steps: int = 3
    #: completions_truncated: consecutive log reports in which every completion hit
    #: max_completion_length (clipped_ratio 1, no terminated completion).
    truncated_logs: int = 4
    #: dataset_shrunk: fraction of the given training rows the trainer dropped before it fires.
    dataset_drop_fraction: float = 0.05
    #: low_precision_update: fraction of the optimizer's elements held in bf16/fp16 (updated
    #: without an fp32 master copy) before it fires.
    low_precision_fraction: float = 0.5
