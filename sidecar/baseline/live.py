"""A live run's baseline and its figures measured against it.

The baseline arrives as text in the run's RunStart; it is parsed once per RunStart (kept by
the message's identity, like ``RunState.config``) and a damaged one is treated as none (the
``baseline_recipe_changed`` verdict says so). ``deviation`` is the one rule every
``baseline_*`` detector applies: a value outside the band, widened by a margin, for
``baseline_steps`` consecutive points; a single noisy step is never one. A deviation that
lasts ``baseline_escalate_steps`` points is persistent (``Deviation.escalated_step``): a
healthy run on other data can leave a band for a while, a broken recipe stays out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ...proto import pb
from ..model.run_state import RunState
from .model import Band, Baseline, BaselineError, margin

#: Parsed baselines by RunStart identity: (the message, the baseline or the error).
_PARSED: dict[int, tuple[pb.RunStart, Baseline | BaselineError]] = {}
_MAX_PARSED = 1024
_LOCK = threading.Lock()


def parsed(start: pb.RunStart | None) -> Baseline | BaselineError | None:
    """The baseline a RunStart carries (None: it names none; BaselineError: unreadable)."""
    if start is None or not start.HasField("baseline"):
        return None
    key = id(start)
    with _LOCK:
        cached = _PARSED.get(key)
        if cached is not None and cached[0] is start:
            return cached[1]
    result: Baseline | BaselineError
    try:
        result = Baseline.from_json(start.baseline, name=start.baseline_name)
    except BaselineError as err:
        result = err
    with _LOCK:
        if len(_PARSED) >= _MAX_PARSED:
            _PARSED.clear()
        _PARSED[key] = (start, result)
    return result


def baseline_of(run: RunState) -> Baseline | None:
    """The run's baseline, if it named a readable one."""
    found = parsed(run.start)
    return found if isinstance(found, Baseline) else None


def label(start: pb.RunStart | None) -> str:
    """Which baseline a run is judged against, in words ("" when none)."""
    found = parsed(start)
    if found is None or start is None:
        return ""
    name = start.baseline_name or "(unnamed)"
    if isinstance(found, BaselineError):
        return f"{name} (unreadable: {found})"
    runs = ", ".join(found.runs[:4]) + (f" +{len(found.runs) - 4}" if len(found.runs) > 4
                                         else "")
    return f"{name} (runs {runs}; {found.steps} steps)"


def total_steps(run: RunState, baseline: Baseline) -> int:
    """The run's own length when it said it (a Trainer's max steps), else the baseline's: a
    run's step is placed at the same fraction of its length as the baseline's bands."""
    total = run.config.get("total_steps", 0.0)
    return int(total) if total and total > 0 else baseline.steps


def side(value: float, band: Band, relative: float) -> int:
    """+1 above the widened band, -1 below it, 0 inside."""
    width = margin(band, relative)
    if value > band.high + width:
        return 1
    if value < band.low - width:
        return -1
    return 0


@dataclass(frozen=True)
class Deviation:
    """A quantity outside the baseline's band for a run of consecutive points."""

    quantity: str
    direction: int
    first_step: int
    reached_step: int
    step: int
    value: float
    band: Band
    points: int
    #: The step at which the streak reached the escalation length (None while shorter).
    escalated_step: int | None = None

    def factor(self) -> float:
        """How many times above the band's top (or below its bottom) the newest value is."""
        if self.direction > 0 and self.band.high > 0:
            return self.value / self.band.high
        if self.direction < 0 and self.value > 0:
            return self.band.low / self.value
        return float("inf")

    def words(self) -> str:
        where = "above" if self.direction > 0 else "under"
        factor = self.factor()
        times = f"{factor:.3g}x " if 1 < factor < float("inf") else ""
        return (f"{self.quantity} {times}{where} the baseline's band since step "
                f"{self.first_step} ({self.points} points; step {self.step}: {self.value:.4g}, "
                f"band {self.band.low:.4g}..{self.band.high:.4g})")

    def evidence(self) -> dict[str, str]:
        return {"quantity": self.quantity, "since_step": str(self.first_step),
                "step": str(self.step), "value": f"{self.value:.6g}",
                "band_low": f"{self.band.low:.6g}", "band_high": f"{self.band.high:.6g}",
                "points_outside": str(self.points)}


#: Points a walk goes back at most: a deviation this long is reported as "since" the step
#: that far back (its first step is older), and a run deviating on every figure costs the
#: sidecar a bounded walk per evaluation.
MAX_WALK = 64


def deviation(baseline: Baseline, quantity: str, newest_first: Iterable[tuple[int, float]],
              total: int, needed: int, relative: float, escalate: int = 0
              ) -> Deviation | None:
    """The trailing run of points (step, value), given newest first, outside the band on one
    side, when it is at least ``needed`` long; None otherwise (or when the baseline lacks the
    quantity). The walk stops at the first point inside the band (a healthy run costs one
    point per evaluation) and after MAX_WALK points. ``escalate``: the streak length that
    makes it persistent (0: never; at most MAX_WALK, the longest streak a walk sees)."""
    limits = baseline.limits(quantity, relative)
    if not limits:
        return None
    bins, total = len(limits), total or baseline.steps
    streak: list[tuple[int, float]] = []
    direction = 0
    for step, value in newest_first:
        if value != value:  # NaN: neither in nor out (nonfinite_loss speaks of it)
            continue
        inside = limits[max(0, min(bins - 1, (step - 1) * bins // total))]
        if inside is None:
            break
        where = 1 if value > inside[1] else -1 if value < inside[0] else 0
        if where == 0 or (direction and where != direction):
            break
        direction = where
        streak.append((step, value))
        if len(streak) >= MAX_WALK:
            break
    if len(streak) < needed:
        return None
    streak.reverse()
    step, value = streak[-1]
    band = baseline.band(quantity, step, total)
    assert band is not None  # its limits were there
    escalate = min(escalate, MAX_WALK)
    escalated = streak[escalate - 1][0] if 0 < escalate <= len(streak) else None
    return Deviation(quantity, direction, streak[0][0], streak[needed - 1][0], step, value,
                     band, len(streak), escalated)
