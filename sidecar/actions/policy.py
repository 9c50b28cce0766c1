"""Turn a verdict into what its policy asks for: a log line, a page, a STOP, a kill.

Policies are levels, each including the ones before: ``observe`` logs, ``page`` also pages
on-call, ``stop`` also sends STOP over the run's stream, ``kill`` also hands the incident to the
enforcer, which escalates to SIGTERM and SIGKILL. Every action is journaled in the store,
counted by (action, result) for ``deadweight_actions_total`` and logged with its evidence;
``dry_run`` logs and journals what would have been done and does nothing. An incident is paged
and stopped at most once, also across restarts (the journal is checked first).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from ...proto import pb
from ..detectors import BY_ID
from ..detectors.base import Policy
from ..model.finding import Finding, RunFacts
from ..store.journal import Store

log = structlog.get_logger("deadweight.actions")

LEVEL = {Policy.OBSERVE: 0, Policy.PAGE: 1, Policy.STOP: 2, Policy.KILL: 3}


class Pager(Protocol):
    """Where pages go (the Alertmanager pusher implements this)."""

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str], starts_at: float | None = None,
    ) -> None: ...

    def resolve(self, run_id: str, detector: str, severity: str) -> None: ...


#: Takes over an incident whose policy is ``kill`` once STOP went out (``Enforcer.begin``):
#: called with the run, the finding, when STOP went out and the run's step then.
Escalate = Callable[[RunFacts, Finding, float, int], None]
#: Ends the open escalations of a run id that started a new incarnation (``Enforcer.supersede``).
Supersede = Callable[[str], None]


@dataclass(frozen=True)
class ActionKey:
    """The labels of ``deadweight_actions_total``."""

    run_id: str
    trainer: str
    detector: str
    action: str
    result: str


@dataclass(frozen=True)
class ActionEvent:
    """One action on one incident (and, for signals, one rank's process)."""

    run_id: str
    trainer: str
    detector: str
    incident: int
    action: str
    result: str
    rank: int | None = None
    pid: int | None = None
    evidence: dict[str, str] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


def policy_level(policy: str) -> int:
    return LEVEL[Policy(policy)]


class Actions:
    """The action sink the registry calls on every verdict transition."""

    def __init__(self, pager: Pager | None = None, dry_run: bool = False,
                 store: Store | None = None, escalate: Escalate | None = None,
                 supersede: Supersede | None = None) -> None:
        self.pager = pager
        self.dry_run = dry_run
        self.store = store or Store()
        self.escalate = escalate
        self.supersede = supersede
        self.counts: Counter[ActionKey] = Counter()
        self._lock = threading.Lock()

    # -- the journal -----------------------------------------------------------------------

    def record(self, event: ActionEvent, at: float | None = None) -> int:
        """Journal, count and log one action with its result."""
        action_id = self.store.add_action(
            event.run_id, event.trainer, event.detector, event.incident, event.action,
            event.result, event.rank, event.pid, self.dry_run, event.detail, at=at,
        )
        self._count_and_log(event)
        return action_id

    def intend(self, event: ActionEvent) -> int:
        """Journal an action as pending before doing it (a crash then counts it as done)."""
        return self.store.add_action(
            event.run_id, event.trainer, event.detector, event.incident, event.action,
            "pending", event.rank, event.pid, self.dry_run, event.detail,
        )

    def settle(self, action_id: int, event: ActionEvent) -> None:
        """Write the result of an action journaled as pending."""
        self.store.set_result(action_id, event.result)
        self._count_and_log(event)

    def superseded(self, run_id: str) -> None:
        """The run id started a new incarnation: escalations of the old one end here, so
        its processes' successors are never signalled for it."""
        if self.supersede is not None:
            self.supersede(run_id)

    def forget(self, run_id: str) -> None:
        """Drop an expired run's counters, so memory and /metrics stay bounded."""
        with self._lock:
            for key in [k for k in self.counts if k.run_id == run_id]:
                del self.counts[key]

    def _count_and_log(self, event: ActionEvent) -> None:
        with self._lock:
            self.counts[ActionKey(event.run_id, event.trainer, event.detector, event.action,
                                  event.result)] += 1
        log.warning(
            "action", action=event.action, result=event.result, run_id=event.run_id,
            detector=event.detector, incident=f"{event.detector}#{event.incident}",
            rank=event.rank, pid=event.pid, evidence=event.evidence, dry_run=self.dry_run,
            **event.detail,
        )

    def _event(self, run: RunFacts, finding: Finding, action: str, result: str,
               **detail: Any) -> ActionEvent:
        return ActionEvent(run.run_id, run.trainer, finding.detector, finding.incidents,
                           action, result, evidence=dict(finding.evidence), detail=detail)

    def _done(self, run: RunFacts, finding: Finding, action: str) -> bool:
        return self.store.has_action(run.run_id, finding.detector, finding.incidents, action)

    # -- verdict transitions ---------------------------------------------------------------

    def fired(self, run: RunFacts, finding: Finding) -> list[pb.Directive]:
        level = policy_level(finding.policy)
        directives: list[pb.Directive] = []
        if level >= LEVEL[Policy.PAGE] and not self._done(run, finding, "page"):
            self._page(run, finding)
        if level >= LEVEL[Policy.STOP] and not self._done(run, finding, "stop"):
            now = time.time()
            if self.dry_run:
                self.record(self._event(run, finding, "stop", "dry_run", step=run.step), at=now)
            else:
                directives.append(self._stop_directive(finding))
                self.record(self._event(run, finding, "stop", "sent", step=run.step), at=now)
            if level >= LEVEL[Policy.KILL] and self.escalate is not None:
                self.escalate(run, finding, now, run.step)
        return directives

    def resumed(self, run: RunFacts, finding: Finding) -> list[pb.Directive]:
        """A firing incident read back after a restart: re-assert, never repeat.

        The page is re-asserted with its original start time (Alertmanager sees the same
        alert, not a new one) and STOP is queued again for ranks that reconnect; both are
        journaled as such, not as new actions. The enforcer resumes escalations itself.
        """
        level = policy_level(finding.policy)
        directives: list[pb.Directive] = []
        if level >= LEVEL[Policy.PAGE] and self.pager is not None and not self.dry_run:
            self._fire_pager(run, finding)
            self.record(self._event(run, finding, "page", "reasserted"))
        if level >= LEVEL[Policy.STOP] and not self.dry_run and self._done(run, finding, "stop"):
            directives.append(self._stop_directive(finding))
            self.record(self._event(run, finding, "stop", "requeued"))
        return directives

    def resolved(self, run: RunFacts, finding: Finding) -> None:
        paged = policy_level(finding.policy) >= LEVEL[Policy.PAGE]
        if paged and self.pager is not None and not self.dry_run:
            self.pager.resolve(run.run_id, finding.detector, finding.severity)

    @staticmethod
    def _stop_directive(finding: Finding) -> pb.Directive:
        return pb.Directive(action=pb.Directive.ACTION_STOP, detector=finding.detector,
                            reason=finding.summary)

    def _page(self, run: RunFacts, finding: Finding) -> None:
        if self.dry_run:
            self.record(self._event(run, finding, "page", "dry_run"))
            return
        if self.pager is None:
            self.record(self._event(run, finding, "page", "no_pager"))
            return
        self.record(self._event(run, finding, "page", "queued"))
        self._fire_pager(run, finding)

    def _fire_pager(self, run: RunFacts, finding: Finding) -> None:
        assert self.pager is not None
        # The wording the Prometheus rule carries too (a detector outside ALL has none).
        detector = BY_ID.get(finding.detector)
        summary = (detector.spec.render_summary(run.run_id) if detector is not None
                   else f"{finding.detector} on run {run.run_id}")
        meaning = f"{detector.spec.meaning} " if detector is not None else ""
        self.pager.fire(  # the pager appends the evidence to the description
            run.run_id, finding.detector, finding.severity, summary=summary,
            description=f"Run {run.run_id}: {meaning}({finding.summary}).",
            evidence=dict(sorted(finding.evidence.items())),
            starts_at=finding.fired_at or None,
        )
