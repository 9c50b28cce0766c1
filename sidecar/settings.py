"""Detector thresholds and windows, with the defaults documented in the README."""

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
    #: stalled: seconds without a step or heartbeat before a live run is stalled.
    stalled_seconds: float = 300.0
