"""Every detector the sidecar runs, in evaluation order.

Add a detector by writing a class that follows ``base.Detector`` in a module of this package
and listing an instance in ``ALL``; its id must be one of the public contract.
"""

from __future__ import annotations

from deadweight.sidecar.detectors.base import Detector, Policy, Severity, Verdict
from deadweight.sidecar.detectors.frozen import FrozenWeights
from deadweight.sidecar.detectors.optimizer import EmptyOptimizer

ALL: tuple[Detector, ...] = (
    EmptyOptimizer(),
    FrozenWeights(),
)

BY_ID: dict[str, Detector] = {d.id: d for d in ALL}

__all__ = ["ALL", "BY_ID", "Detector", "Policy", "Severity", "Verdict"]
