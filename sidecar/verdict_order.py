"""Root causes first: the order in which the summary and the gate list a run's verdicts.

``empty_optimizer`` (nothing can learn) comes before ``frozen_weights`` (nothing learned),
which comes before the verdicts those two silence (``inhibited_by``: unchanged checkpoints,
zero reward spread...); the rest sit between, critical before warning, earliest step first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from deadweight.sidecar.detectors import BY_ID
from deadweight.sidecar.detectors.spec import ROOT_CAUSES

T = TypeVar("T")

#: The cause before its symptom: an empty optimizer is why the weights stay frozen.
_CAUSES = ("empty_optimizer", *[c for c in ROOT_CAUSES if c != "empty_optimizer"])
_SEVERITY = {"critical": 0, "warning": 1, "info": 2}


def rank(detector: str, severity: str, step: int) -> tuple[int, int, int, int, str]:
    if detector in _CAUSES:
        group, within = 0, _CAUSES.index(detector)
    else:
        known = BY_ID.get(detector)
        symptom = known is not None and bool(known.spec.inhibited_by)
        group, within = (2 if symptom else 1), 0
    return group, within, _SEVERITY.get(severity, 3), step, detector


def root_causes_first(items: Iterable[T], key: Callable[[T], tuple[str, str, int]]) -> list[T]:
    """items sorted by ``rank`` of key(item) = (detector, severity, step)."""
    return sorted(items, key=lambda item: rank(*key(item)))
