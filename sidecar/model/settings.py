"""Detector thresholds and windows: one typed object the registry hands every detector.

The defaults live here, on typed fields (``deadweight serve --setting NAME=VALUE`` uses these
names); the detector that reads a field says what it means and in which unit (its spec's
``thresholds``), and the README's table is generated from both. Tests shorten windows honestly
through this one object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DetectorSettings:
    """Tunable thresholds; each field is documented by the detector spec that reads it."""

    frozen_steps: int = 3
    frozen_ratio_floor: float = 0.01
    stalled_seconds: float = 300.0
    stalled_step_seconds: float = 1800.0
    inactive_adapter_steps: int = 2
    decay_only_steps: int = 3
    lora_lr_floor: float = 3e-5
    lora_lr_floor_preference: float = 3e-6
    kl_missing_logs: int = 2
    kl_zero_logs: int = 3
    zero_reward_logs: int = 4
    nonfinite_logs: int = 3
    trend_logs: int = 3
    entropy_drop: float = 0.4
    length_drop: float = 0.4
    dpo_window: int = 5
    adapter_bloat_ratio: float = 1.0
    zero_gradient_logs: int = 3
    skipped_steps: int = 3
    scale_calibration_skips: int = 16
    truncated_logs: int = 4
    dataset_drop_fraction: float = 0.05
    low_precision_fraction: float = 0.25
    low_precision_steps: int = 3
    resume_loss_drop: float = 0.1
    resume_loss_regain: float = 0.5
    divergence_factor: float = 10.0
    divergence_baseline_logs: int = 3
    divergence_logs: int = 2
    loss_scale_floor: float = 0.5
    divergence_update_rms: float = 1.0
    spike_z: float = 4.0
    spike_warmup_logs: int = 5
    spike_sigma_floor: float = 0.25
    no_step_logs: int = 8
    accumulating_logs: int = 8
    accumulating_growth: float = 3.0
    accumulating_loss_drop: float = 0.75
    negligible_update_steps: int = 3
    negligible_relative_update: float = 1e-6
    negligible_decayed_lr_share: float = 0.1
    out_of_order_steps: int = 3
    rank_stalled_seconds: float = 300.0
    straggler_steps: int = 8
    straggler_ratio: float = 1.5
    straggler_min_seconds: float = 0.05
    straggler_step_share: float = 0.2
    replica_tolerance: float = 1e-5
    rollout_stale_logs: int = 3
    rollout_logp_difference: float = 0.1
    rollout_rise: float = 3.0
    rollout_logp_ceiling: float = 0.5
    baseline_steps: int = 5
    baseline_escalate_steps: int = 15
    baseline_margin: float = 0.25
    baseline_module_steps: int = 2
