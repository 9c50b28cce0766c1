"""Turn a verdict into what its policy asks for: a log line, a page, a STOP, a kill.

Policies are levels, each including the ones before: ``observe`` logs, ``page`` also pages
on-call, ``stop`` also sends STOP over the run's stream, ``kill`` also escalates to signals.
Every action is counted by (action, result) for ``deadweight_actions_total`` and logged with
its evidence; ``dry_run`` logs what would have been done and does nothing.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import structlog

from deadweight.proto import pb
from deadweight.sidecar.detectors.base import Policy
from deadweight.sidecar.registry import Finding
from deadweight.sidecar.state import RunState

log = structlog.get_logger("deadweight.actions")

LEVEL = {Policy.OBSERVE: 0, Policy.PAGE: 1, Policy.STOP: 2, Policy.KILL: 3}


class Pager(Protocol):
    """Where pages go (the Alertmanager pusher implements this)."""

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str],
    ) -> None: ...

    def resolve(self, run_id: str, detector: str, severity: str) -> None: ...


@dataclass(frozen=True)
class ActionKey:
    """The labels of ``deadweight_actions_total``."""

    run_id: str
    trainer: str
    detector: str
    action: str
    result: str


class Actions:
    """The action sink the registry calls on every verdict transition."""

    def __init__(self, pager: Pager | None = None, dry_run: bool = False) -> None:
        self.pager = pager
        self.dry_run = dry_run
        self.counts: Counter[ActionKey] = Counter()
        self._lock = threading.Lock()

    def _count(self, run: RunState, finding: Finding, action: str, result: str) -> None:
        with self._lock:
            self.counts[ActionKey(run.run_id, run.trainer, finding.detector, action, result)] += 1
        log.warning(
            "action", action=action, result=result, run_id=run.run_id,
            detector=finding.detector, incident=finding.incident_id, step=finding.step,
            evidence=finding.evidence, dry_run=self.dry_run,
        )

    def fired(self, run: RunState, finding: Finding) -> list[pb.Directive]:
        level = LEVEL[Policy(finding.policy)]
        directives: list[pb.Directive] = []
        if level >= LEVEL[Policy.PAGE]:
            self._page(run, finding)
        if level >= LEVEL[Policy.STOP]:
            if self.dry_run:
                self._count(run, finding, "stop", "dry_run")
            else:
                directives.append(
                    pb.Directive(
                        action=pb.Directive.ACTION_STOP,
                        detector=finding.detector,
                        reason=finding.summary,
                    )
                )
                self._count(run, finding, "stop", "sent")
        return directives

    def resolved(self, run: RunState, finding: Finding) -> None:
        paged = LEVEL[Policy(finding.policy)] >= LEVEL[Policy.PAGE]
        if paged and self.pager is not None and not self.dry_run:
            self.pager.resolve(run.run_id, finding.detector, finding.severity)

    def _page(self, run: RunState, finding: Finding) -> None:
        if self.pager is None:
            self._count(run, finding, "page", "no_pager")
            return
        if self.dry_run:
            self._count(run, finding, "page", "dry_run")
            return
        evidence = ", ".join(f"{k}={v}" for k, v in sorted(finding.evidence.items()))
        self.pager.fire(
            run.run_id, finding.detector, finding.severity,
            summary=f"{finding.detector} on run {run.run_id}",
            description=f"{finding.summary}. Evidence: {evidence}",
            evidence=finding.evidence,
        )
        self._count(run, finding, "page", "queued")
