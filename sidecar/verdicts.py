"""How verdicts are listed to a person: root causes first, and in words that do not mislead.

The report and ``deadweight runs`` read incidents from the state database, the summary and the
gate read verdicts; all order and name them here, so they never disagree. A verdict closed
only because its run ended reads "firing at end": "resolved" is kept for a condition that
cleared while the run was live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from .detectors.spec import root_causes_first
from .model.finding import FIRING, FIRING_AT_END, RESOLVED, SEVERITY_ORDER, verdict_state
from .store.journal import StoredIncident, StoredRun

T = TypeVar("T")
__all__ = ["FIRING", "FIRING_AT_END", "RESOLVED", "causes_first", "state"]


def first_per_detector(incidents: Iterable[StoredIncident],
                       severities: Sequence[str] = ("critical", "warning")
                       ) -> list[StoredIncident]:
    """One incident per detector (its first), of the given severities, root causes first
    (``root_causes_first``), otherwise by severity and the step it fired at."""
    first: dict[str, StoredIncident] = {}
    for incident in sorted(incidents, key=lambda i: (i.fired_at, i.incident)):
        if incident.severity in severities:
            first.setdefault(incident.detector, incident)
    base = sorted(first.values(), key=lambda i: (SEVERITY_ORDER.get(i.severity, 3), i.step))
    return [first[d] for d in root_causes_first([i.detector for i in base])]


def last_per_detector(incidents: Iterable[StoredIncident]) -> list[StoredIncident]:
    """Each detector's latest incident (its final verdict), root causes first."""
    last: dict[str, StoredIncident] = {}
    for incident in sorted(incidents, key=lambda i: (i.fired_at, i.incident)):
        last[incident.detector] = incident
    base = sorted(last.values(), key=lambda i: (SEVERITY_ORDER.get(i.severity, 3), i.step))
    return [last[d] for d in root_causes_first([i.detector for i in base])]


def state(incident: StoredIncident, run: StoredRun) -> str:
    """firing / firing at end / resolved: a verdict closed at or after the run's end (the end
    closes run-scoped verdicts) stood until the end."""
    return verdict_state(incident.resolved_at is None, run.ended, incident.resolved_at,
                         run.ended_at)


def causes_first(items: Iterable[T], key: Callable[[T], tuple[str, str, int]]) -> list[T]:
    """items (verdicts of any shape) root causes first, then by severity and the step they
    fired at; key(item) is (detector, severity, step)."""
    keyed = sorted(items, key=lambda item: (SEVERITY_ORDER.get(key(item)[1], 3), key(item)[2]))
    place = {d: n for n, d in enumerate(root_causes_first([key(i)[0] for i in keyed]))}
    return sorted(keyed, key=lambda item: place[key(item)[0]])
