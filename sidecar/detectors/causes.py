"""The causal graph of the detectors: which verdict can be a symptom of which.

Each spec names its direct causes (``symptom_of``). From those edges alone come the order every
list of verdicts reads in (console, ``status``, report, summary, inspect: a cause before each of
its symptoms, the phase order breaking ties), the fix shown first (the first cause's), the
inhibitions (a firing cause keeps its symptoms' pages quiet on the run, in Alertmanager and in
the rules) and the reach of a silence (a silenced cause keeps quiet every symptom it inhibits).
The graph is checked once when it is built: an unknown id or a cycle is an error at import.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .spec import PHASE_ORDER, DetectorSpec, Severity

#: Lower is more severe: a cause inhibits a symptom only when it is at least as severe, so an
#: inhibition never turns a critical page into a warning's ticket.
_SEVERITY_RANK = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}


class CausalGraph:
    """The detectors and their ``symptom_of`` edges, closed transitively."""

    def __init__(self, specs: Iterable[DetectorSpec],
                 phases: Sequence[str] = PHASE_ORDER) -> None:
        self._specs = {spec.id: spec for spec in specs}
        for spec in self._specs.values():
            for cause in spec.symptom_of:
                if cause not in self._specs or cause == spec.id:
                    raise ValueError(f"{spec.id}: symptom_of names {cause!r}, which is no "
                                     "other detector")
        #: Every detector, each cause before its symptoms, ties in phase order.
        self.order: tuple[str, ...] = self._topological(phases)
        self._rank = {detector: rank for rank, detector in enumerate(self.order)}
        self._causes = {d: self._closure(d) for d in self.order}
        symptoms: dict[str, list[str]] = {d: [] for d in self.order}
        for detector, causes in self._causes.items():
            for cause in causes:
                symptoms[cause].append(detector)
        self._symptoms = {d: tuple(sorted(s, key=self.rank)) for d, s in symptoms.items()}

    def _direct_causes(self, detector: str) -> tuple[str, ...]:
        return self._specs[detector].symptom_of

    def _topological(self, phases: Sequence[str]) -> tuple[str, ...]:
        """Kahn's order: of the detectors whose causes are all placed, the first in phase
        order goes next (ids the phase order lacks after it, by name)."""
        phase = {d: n for n, d in enumerate(phases)}

        def key(detector: str) -> tuple[int, str]:
            return phase.get(detector, len(phase)), detector

        waiting = {d: len(set(spec.symptom_of)) for d, spec in self._specs.items()}
        symptoms: dict[str, list[str]] = {d: [] for d in self._specs}
        for detector, spec in self._specs.items():
            for cause in set(spec.symptom_of):
                symptoms[cause].append(detector)
        ready = [key(d) for d, n in waiting.items() if n == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            _, detector = heapq.heappop(ready)
            order.append(detector)
            for symptom in symptoms[detector]:
                waiting[symptom] -= 1
                if waiting[symptom] == 0:
                    heapq.heappush(ready, key(symptom))
        if len(order) < len(self._specs):
            cycle = sorted(set(self._specs) - set(order))
            raise ValueError(f"symptom_of has a cycle among {', '.join(cycle)}")
        return tuple(order)

    def _closure(self, detector: str) -> tuple[str, ...]:
        """Every cause reachable from the detector through ``symptom_of``, in order."""
        seen: set[str] = set()
        todo = list(self._direct_causes(detector))
        while todo:
            cause = todo.pop()
            if cause not in seen:
                seen.add(cause)
                todo.extend(self._direct_causes(cause))
        return tuple(sorted(seen, key=self.rank))

    # -- what the rest of deadweight asks ----------------------------------------------------

    def rank(self, detector: str) -> int:
        """Where a detector's verdict goes in a list (lower first); unknown ids go last."""
        return self._rank.get(detector, len(self._rank))

    def causes_first(self, detectors: Iterable[str]) -> list[str]:
        """The ids once each, every cause before its symptoms; information that causes none
        of the others listed after what is wrong (a list leads with its root cause, not with
        a note such as ``no_kl_anchor``); ids the graph does not know keep their given order
        after the known ones."""
        ids = list(dict.fromkeys(detectors))
        causing = {c for d in ids for c in self.causes_of(d)}

        def key(detector: str) -> tuple[bool, int]:
            spec = self._specs.get(detector)
            note = (spec is not None and spec.severity is Severity.INFO
                    and detector not in causing)
            return note, self.rank(detector)

        return sorted(ids, key=key)

    def edges(self) -> list[tuple[str, str]]:
        """(cause, symptom) as the specs declare them, in order."""
        return [(cause, d) for d in self.order for cause in self._specs[d].symptom_of]

    def causes_of(self, detector: str) -> tuple[str, ...]:
        """Every detector whose fault can produce this one's verdict, directly or through
        another symptom, in order (() for a root cause or an unknown id)."""
        return self._causes.get(detector, ())

    def symptoms_of(self, detector: str) -> tuple[str, ...]:
        """Every detector this one's fault can produce, in order."""
        return self._symptoms.get(detector, ())

    def inhibitors_of(self, detector: str) -> tuple[str, ...]:
        """The causes whose firing keeps this detector's page quiet on the same run, and whose
        silence quiets it while they fire: its causes at least as severe as itself."""
        spec = self._specs.get(detector)
        if spec is None:
            return ()
        level = _SEVERITY_RANK[spec.severity]
        return tuple(c for c in self.causes_of(detector)
                     if _SEVERITY_RANK[self._specs[c].severity] <= level)

    def inhibits(self, cause: str) -> tuple[str, ...]:
        """The detectors whose page this cause inhibits (its symptoms it is as severe as)."""
        return tuple(s for s in self.symptoms_of(cause) if cause in self.inhibitors_of(s))
