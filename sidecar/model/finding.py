"""A detector's standing verdict on a run, and the contract of whoever acts on it.

The registry makes findings; the actions and the enforcer act on them. Both sides import
this module and neither imports the other: a finding is plain data, and what it is handed
with is a frozen view of the run (``RunFacts``), never the live state the registry guards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from ...proto import pb, run_summary
from .process import ProcessIdentity

log = structlog.get_logger("deadweight.registry")

#: The states of a verdict a person reads. A run's end alone never resolves a verdict: one
#: still firing when its run ended stays so (``FIRING_AT_END``), in status, report, /metrics
#: and on-call, until the run restarts or expires or an operator silences it.
#: One spelling for the sidecar and the summary file beside the adapter (``run_summary``).
FIRING, FIRING_AT_END, RESOLVED = run_summary.FIRING, run_summary.FIRING_AT_END, \
    run_summary.RESOLVED
#: The ``detector`` label of actions on-call took by hand (not a detector's verdict).
OPERATOR = "operator"
#: How status and the report word an action's result where the journal's value would puzzle
#: a reader (``--json`` and the journal keep the values).
RESULT_WORDS = {"no_pager": "not paged, no pager configured (--alertmanager-url, --webhook-url)"}
#: Severities in the order a reader needs them (after root causes, which lead).
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def evidence_pairs(at_firing: Mapping[str, str], latest: Mapping[str, str]
                   ) -> list[tuple[str, str]]:
    """(key, value) as at firing, the latest value beside it where it differs: the one
    reading of a verdict's evidence that status and the report share."""
    pairs = []
    for key in sorted(at_firing.keys() | latest.keys()):
        then, now = at_firing.get(key), latest.get(key)
        if then is None:
            pairs.append((key, f"{now} (latest)"))
        elif now is None or now == then:
            pairs.append((key, then))
        else:
            pairs.append((key, f"{then} (latest {now})"))
    return pairs


def fired_and_latest(step: int, summary: str) -> str:
    """``fired at step N; latest: SUMMARY``: a finding keeps the step it fired at while its
    summary follows each later evaluation, which may name a later step (a checkpoint's); one
    line must not read as if both were the same moment."""
    return f"fired at step {step}; latest: {summary}" if summary else f"fired at step {step}"


def verdict_state(firing: bool, run_ended: bool, resolved_at: float | None = None,
                  ended_at: float = 0.0) -> str:
    """firing / firing at end / resolved: the one rule every listing uses.

    "resolved" means the condition cleared while the run was live; a verdict that the run's
    end itself closed (resolved at or after ``ended_at``) stood until the end."""
    closed_by_end = run_ended and resolved_at is not None and resolved_at >= ended_at
    if not firing and not closed_by_end:
        return RESOLVED
    return FIRING_AT_END if run_ended else FIRING


@dataclass
class Finding:
    """A detector's standing verdict on one run, kept across evaluations."""

    detector: str
    severity: str
    policy: str
    firing: bool = False
    step: int = 0
    summary: str = ""
    #: The latest evidence (updated at each evaluation while it fires).
    evidence: dict[str, str] = field(default_factory=dict)
    #: The evidence as it stood when the verdict fired (what the page quoted).
    fired_evidence: dict[str, str] = field(default_factory=dict)
    fired_at: float = 0.0
    resolved_at: float = 0.0
    incidents: int = 0

    @property
    def incident_id(self) -> str:
        return f"{self.detector}#{self.incidents}"

    def copy(self) -> Finding:
        """A copy that later evaluations of the run do not change."""
        return Finding(**{**vars(self), "evidence": dict(self.evidence),
                          "fired_evidence": dict(self.fired_evidence)})


class RunFacts(Protocol):
    """What an action needs to know about a run (``RunState`` and ``RunSnapshot`` have it)."""

    @property
    def run_id(self) -> str: ...

    @property
    def trainer(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def incarnation(self) -> int: ...


@dataclass(frozen=True)
class RunSnapshot:
    """The facts of a run at the moment a verdict changed, safe to read without a lock.

    ``processes`` are the ranks' processes bound to this very incarnation when the verdict
    fired: the only ones an escalation of it may ever signal."""

    run_id: str
    trainer: str
    step: int
    incarnation: int = 1
    processes: tuple[tuple[int, ProcessIdentity], ...] = ()
    #: Copies of the run's findings firing at that moment (the changed one as it is now):
    #: whether a silenced root cause still holds its symptoms' pages back.
    firing: tuple[Finding, ...] = ()

    @classmethod
    def of(cls, run: RunFacts) -> RunSnapshot:
        if isinstance(run, RunSnapshot):
            return run
        return cls(run.run_id, run.trainer, run.step, run.incarnation)


class ActionSink(Protocol):
    """Receives verdict transitions; returns directives to send to the run's ranks."""

    def fired(self, run: RunFacts, finding: Finding) -> list[pb.Directive]: ...

    def resolved(self, run: RunFacts, finding: Finding) -> None: ...

    def resumed(self, run: RunFacts, finding: Finding) -> list[pb.Directive]: ...

    def resumed_operator_stop(self, run: RunFacts) -> list[pb.Directive]:
        """A live run read back after a restart: the STOP on-call sent it by hand, again."""
        ...

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

    def resumed_operator_stop(self, run: RunFacts) -> list[pb.Directive]:
        return []

    def forget(self, run_id: str) -> None:
        return None
