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
    kl_missing_logs: int = 2
    kl_zero_logs: int = 3
    zero_reward_logs: int = 4
    trend_logs: int = 3
    entropy_drop: float = 0.4
    length_drop: float = 0.4
    dpo_window: int = 5
    adapter_bloat_ratio: float = 1.0
    zero_gradient_logs: int = 3
    skipped_steps: int = 3
    truncated_logs: int = 4
    dataset_drop_fraction: float = 0.05
    low_precision_fraction: float = 0.25
    low_precision_steps: int = 3
    resume_loss_drop: float = 0.1
    resume_loss_regain: float = 0.5
