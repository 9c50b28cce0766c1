"""A detector's standing verdict on a run, and the contract of whoever acts on it.

The registry makes findings; the actions and the enforcer act on them. Both sides import
this module and neither imports the other: a finding is plain data, and what it is handed
with is a frozen view of the run (``RunFacts``), never the live state the registry guards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import structlog

from ...proto import pb

log = structlog.get_logger("deadweight.registry")


@dataclass
class Finding:
    """A detector's standing verdict on one run, kept across evaluations."""

    detector: str
    severity: str
    policy: str
    firing: bool = False
    step: int = 0
    summary: str = ""
    evidence: dict[str, str] = field(default_factory=dict)
    fired_at: float = 0.0
    resolved_at: float = 0.0
    incidents: int = 0

    @property
    def incident_id(self) -> str:
        return f"{self.detector}#{self.incidents}"

    def copy(self) -> Finding:
        """A copy that later evaluations of the run do not change."""
        return Finding(**{**vars(self), "evidence": dict(self.evidence)})


class RunFacts(Protocol):
    """What an action needs to know about a run (``RunState`` and ``RunSnapshot`` have it)."""

    @property
    def run_id(self) -> str: ...

    @property
    def trainer(self) -> str: ...

    @property
    def step(self) -> int: ...


@dataclass(frozen=True)
class RunSnapshot:
    """The facts of a run at the moment a verdict changed, safe to read without a lock."""

    run_id: str
    trainer: str
    step: int

    @classmethod
    def of(cls, run: RunFacts) -> RunSnapshot:
        return cls(run.run_id, run.trainer, run.step)


class ActionSink(Protocol):
    """Receives verdict transitions; returns directives to send to the run's ranks."""

    def fired(self, run: RunFacts, finding: Finding) -> list[pb.Directive]: ...

    def resolved(self, run: RunFacts, finding: Finding) -> None: ...

    def resumed(self, run: RunFacts, finding: Finding) -> list[pb.Directive]: ...

    def forget(self, run_id: str) -> None:
        """The run expired: drop what is kept per run in memory (the journal stays)."""
        ...


class LogOnlyActions:
    """An action sink that only logs (for tests and the observe-everything mode)."""

    def fired(self, run: RunFacts, finding: Finding) -> list[pb.Directive]:
        log.warning("finding", run_id=run.run_id, detector=finding.detector)
        return []

    def resolved(self, run: RunFacts, finding: Finding) -> None:
        return None

    def resumed(self, run: RunFacts, finding: Finding) -> list[pb.Directive]:
        return []

    def forget(self, run_id: str) -> None:
        return None
