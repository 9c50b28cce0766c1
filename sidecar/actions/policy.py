"""Turn a verdict into what its policy asks for: a log line, a page, a STOP, a kill.

Policies are levels, each including the ones before: ``observe`` logs, ``page`` also pages
on-call, ``stop`` also sends STOP over the run's stream, ``kill`` also hands the incident to the
enforcer, which escalates to SIGTERM and SIGKILL. Every action is journaled in the store,
counted by (action, result) for ``deadweight_actions_total`` and logged with its evidence;
``dry_run`` logs and journals what would have been done and does nothing. An incident is paged
and stopped at most once, also across restarts (the journal is checked first). A detector
silenced on the run (``silences``) does not page: the page is journaled ``silenced`` and sent
when the silence expires if the verdict still stands (``unsilenced``). A silenced root cause
keeps inhibiting its symptoms (the causal graph, ``symptom_of``) while it fires, as the Alertmanager
inhibition does for a cause that pages: their pages are held the same way (journaled
``silenced`` with ``by`` the cause) until the silence ends or the cause clears. A silence
that takes back a page already out mutes it first where the pager can (``muting``: an
Alertmanager silence), so the resolution that follows never reads "resolved" on the pager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from ...proto import pb
from ..detectors import BY_ID, GRAPH, root_causes_of
from ..detectors.base import Policy
from ..detectors.spec import Severity
from ..model.finding import OPERATOR, Finding, RunFacts, RunSnapshot
from ..store.journal import ActionRow, Store, StoreWriteFailed
from .pager_health import PageSettler
from .silences import Silences

log = structlog.get_logger("deadweight.actions")

LEVEL = {Policy.OBSERVE: 0, Policy.PAGE: 1, Policy.STOP: 2, Policy.KILL: 3}
#: How long a mute outlasts its silence: time for the sidecar to page again what still fires,
#: so the pager never sees the alert resolved in between.
MUTE_GRACE_SECONDS = 120.0



def operator_stop_directive(reason: str) -> pb.Directive:
    """The STOP on-call sent by hand, in the words the trainer's console shows."""
    return pb.Directive(action=pb.Directive.ACTION_STOP, detector=OPERATOR,
                        reason=f"stopped by on-call: {reason}")


class Pager(Protocol):
    """Where pages go (``pagers.PagerSet``: the Alertmanager push and the webhooks).

    on_result hears "delivered" or "failed" (after the targets' retry budget); reassert marks
    the same page sent again after a restart (a webhook posts nothing for it). A journaled
    page's on_result is a ``PageSettler``: its action id goes with each delivery, so a
    restart settles the page too."""

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str], starts_at: float | None = None,
        on_result: Callable[[str], None] | None = None, reassert: bool = False,
    ) -> None: ...

    def resolve(self, run_id: str, detector: str, severity: str) -> None: ...


#: Takes over an incident whose policy is ``kill`` once STOP went out (``Enforcer.begin``):
#: called with the run as it was when the verdict fired (its incarnation and the processes
#: bound to it), the finding, when STOP went out and the run's step then.
Escalate = Callable[[RunSnapshot, Finding, float, int], None]
#: Ends the open escalations of one closed incarnation of a run id (``Enforcer.supersede``).
Supersede = Callable[[str, int], None]


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
    incarnation: int = 1


def policy_level(policy: str) -> int:
    return LEVEL[Policy(policy)]


def acting_level(finding: Finding) -> int:
    """How far a verdict acts: its policy's level, but an info verdict (worth knowing,
    nothing wrong by itself: a baseline deviation's first stage) is shown and never paged
    or acted on, whatever the policy; it pages if it steps up to a warning."""
    if finding.severity == Severity.INFO.value:
        return LEVEL[Policy.OBSERVE]
    return policy_level(finding.policy)


class Actions:
    """The action sink the registry calls on every verdict transition."""

    def __init__(self, pager: Pager | None = None, dry_run: bool = False,
                 store: Store | None = None, escalate: Escalate | None = None,
                 supersede: Supersede | None = None,
                 silences: Silences | None = None) -> None:
        self.pager = pager
        #: Detectors silenced by hand per run (``deadweight silence``): they do not page.
        self.silences = silences or Silences()
        self.dry_run = dry_run
        self.store = store or Store()
        self.escalate = escalate
        self.supersede = supersede
        self.counts: Counter[ActionKey] = Counter()
        #: run_id -> detector -> severity of the pages this sidecar holds firing: resolved
        #: when the verdict resolves, the run restarts, or the run expires; never at run end.
        self._held_pages: dict[str, dict[str, str]] = {}
        #: Page action id -> its run and the result it was last settled to (pager thread).
        self._settled: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()

    # -- the journal -----------------------------------------------------------------------

    def record(self, event: ActionEvent, at: float | None = None) -> int:
        """Journal, count and log one action with its result."""
        action_id = self.store.add_action(
            event.run_id, event.trainer, event.detector, event.incident, event.action,
            event.result, event.rank, event.pid, self.dry_run, event.detail, at=at,
            incarnation=event.incarnation,
        )
        self._count_and_log(event)
        return action_id

    def intend(self, event: ActionEvent) -> int:
        """Journal an action as pending before doing it (a crash then counts it as done)."""
        return self.store.add_action(
            event.run_id, event.trainer, event.detector, event.incident, event.action,
            "pending", event.rank, event.pid, self.dry_run, event.detail,
            incarnation=event.incarnation,
        )

    def settle(self, action_id: int, event: ActionEvent) -> None:
        """Write the result of an action journaled as pending."""
        self.store.set_result(action_id, event.result)
        self._count_and_log(event)

    def superseded(self, run_id: str, incarnation: int) -> None:
        """The run id started a new incarnation: escalations of the old one end here, so
        its processes' successors are never signalled for it."""
        if self.supersede is not None:
            self.supersede(run_id, incarnation)

    def forget(self, run_id: str) -> None:
        """Drop an expired run's counters, so memory and /metrics stay bounded, and resolve
        the pages its verdicts still held (the run left the sidecar's memory: the one
        resolution a run that ended with a firing verdict gets without an operator)."""
        with self._lock:
            for key in [k for k in self.counts if k.run_id == run_id]:
                del self.counts[key]
            for action_id in [a for a, (r, _) in self._settled.items() if r == run_id]:
                del self._settled[action_id]
            paged = self._held_pages.pop(run_id, {})
        if self.pager is not None:
            for detector, severity in sorted(paged.items()):
                self.pager.resolve(run_id, detector, severity)  # queued: never blocks
                log.info("page_resolved", run_id=run_id, detector=detector,
                         reason="the ended run expired from the sidecar's memory")

    def _count_and_log(self, event: ActionEvent) -> None:
        with self._lock:
            self.counts[ActionKey(event.run_id, event.trainer, event.detector, event.action,
                                  event.result)] += 1
        log.warning(
            "action", action=event.action, result=event.result, run_id=event.run_id,
            detector=event.detector, incident=f"{event.detector}#{event.incident}",
            # A page acts on the run; the rank its verdict names (a stalled rank) is told.
            rank=event.rank if event.rank is not None else event.evidence.get("rank"),
            pid=event.pid, evidence=event.evidence, dry_run=self.dry_run,
            **event.detail,
        )

    def _event(self, run: RunFacts, finding: Finding, action: str, result: str,
               **detail: Any) -> ActionEvent:
        return ActionEvent(run.run_id, run.trainer, finding.detector, finding.incidents,
                           action, result, evidence=dict(finding.evidence), detail=detail,
                           incarnation=run.incarnation)

    def _done(self, run: RunFacts, finding: Finding, action: str) -> bool:
        return self.store.has_action(run.run_id, finding.detector, finding.incidents, action,
                                     run.incarnation)

    def _paged(self, run: RunFacts, finding: Finding) -> bool:
        """A page went out for the incident (one held back by a silence does not count)."""
        return any(a.action == "page" and a.result != "silenced" for a in
                   self.store.actions(run.run_id, finding.detector, finding.incidents,
                                      run.incarnation))

    def _silenced(self, run: RunFacts, finding: Finding) -> bool:
        return bool(self.silenced_by(run, finding.detector))

    def silenced_by(self, run: RunFacts, detector: str) -> str:
        """What keeps the detector's page quiet on the run: the detector itself when it is
        silenced, else a cause of it (``root_causes_of``) silenced while it fires on the
        run (a silenced cause keeps inhibiting its symptoms); '' when nothing does."""
        if self.silences.active(run.run_id, detector):
            return detector
        firing = {f.detector for f in run.firing} if isinstance(run, RunSnapshot) else set()
        return next((cause for cause in root_causes_of(detector)
                     if cause in firing and self.silences.active(run.run_id, cause)), "")

    @staticmethod
    def symptoms(run: RunFacts, cause: str) -> list[Finding]:
        """The run's firing findings whose page the cause inhibits."""
        firing = run.firing if isinstance(run, RunSnapshot) else ()
        return [f for f in firing if cause in root_causes_of(f.detector)]

    # -- verdict transitions ---------------------------------------------------------------

    def fired(self, run: RunFacts, finding: Finding) -> list[pb.Directive]:
        level = acting_level(finding)
        directives: list[pb.Directive] = []
        if level >= LEVEL[Policy.PAGE] and not self._paged(run, finding):
            cover = self.silenced_by(run, finding.detector)
            if cover:
                detail = {} if cover == finding.detector else {"by": cover}
                self.record(self._event(run, finding, "page", "silenced", **detail))
            else:
                self._page(run, finding)
        if level >= LEVEL[Policy.STOP] and not self._done(run, finding, "stop"):
            now = time.time()
            if self.dry_run:
                self.record(self._event(run, finding, "stop", "dry_run", step=run.step), at=now)
            else:
                directives.append(self._stop_directive(finding))
                self.record(self._event(run, finding, "stop", "sent", step=run.step), at=now)
            if level >= LEVEL[Policy.KILL] and self.escalate is not None:
                self.escalate(RunSnapshot.of(run), finding, now, run.step)
        return directives

    def resumed(self, run: RunFacts, finding: Finding) -> list[pb.Directive]:
        """A firing incident read back after a restart: re-assert, never repeat.

        The page is re-asserted with its original start time (Alertmanager sees the same
        alert, not a new one) and STOP is queued again for ranks that reconnect; both are
        journaled as such, not as new actions. The enforcer resumes escalations itself.
        """
        level = acting_level(finding)
        directives: list[pb.Directive] = []
        if (level >= LEVEL[Policy.PAGE] and self.pager is not None and not self.dry_run
                and not self._silenced(run, finding) and self._paged(run, finding)):
            self._fire_pager(run, finding, reassert=True)
            self.record(self._event(run, finding, "page", "reasserted"))
        if level >= LEVEL[Policy.STOP] and not self.dry_run and self._done(run, finding, "stop"):
            directives.append(self._stop_directive(finding))
            self.record(self._event(run, finding, "stop", "requeued"))
        return directives

    def operator_stop(self, run: RunFacts) -> ActionRow | None:
        """The STOP on-call sent by hand to this incarnation of the run, if one went out."""
        return next((a for a in self.store.actions(run.run_id, OPERATOR)
                     if a.action == "stop" and a.result == "sent"
                     and a.incarnation == run.incarnation), None)

    def resumed_operator_stop(self, run: RunFacts) -> list[pb.Directive]:
        """A live run read back after a restart: a STOP on-call sent its incarnation before
        is queued again for the ranks that reconnect (journaled ``requeued``), like a
        verdict's; a STOP sent to another incarnation of the run id never reaches this one."""
        sent = self.operator_stop(run)
        if sent is None:
            return []
        reason = str(sent.detail.get("reason", ""))
        self.record(ActionEvent(run.run_id, run.trainer, OPERATOR, sent.incident, "stop",
                                "requeued", detail={"step": sent.detail.get("step", 0),
                                                    "reason": reason},
                                incarnation=run.incarnation))
        return [operator_stop_directive(reason)]

    def silenced(self, run: RunFacts, finding: Finding) -> None:
        """A silence began on a firing incident: the page already out resolves (on-call's
        pager quiets; the rules leave silenced detectors out too)."""
        if (acting_level(finding) >= LEVEL[Policy.PAGE] and self.pager is not None
                and not self.dry_run and self._paged(run, finding)):
            self.pager.resolve(run.run_id, finding.detector, finding.severity)

    def muting(self, run: RunFacts, cause: str, until: float, reason: str) -> None:
        """A silence began (or changed) on a firing verdict: the pages it takes back, its own
        and those of the symptoms it inhibits, are muted where the pager can (an Alertmanager
        silence) until a little after it ends. Both paths then resolve the alert, and a
        muted resolution reaches no pager: a silence never reads "resolved" for a fault that
        still stands. When it ends the sidecar pages again what still fires."""
        mute = getattr(self.pager, "mute", None)
        if self.dry_run or not callable(mute):
            return
        mute(run.run_id, [cause, *GRAPH.inhibits(cause)], until + MUTE_GRACE_SECONDS,
             reason or f"deadweight silence of {cause}")

    def unmuting(self, run_id: str, cause: str) -> None:
        """A silence ended: its mute ends once what still fires was paged again."""
        unmute = getattr(self.pager, "unmute", None)
        if not self.dry_run and callable(unmute):
            unmute(run_id, cause)

    def unsilenced(self, run: RunFacts, finding: Finding) -> None:
        """A silence ended on a firing incident: page it now (journaled once), or, if it was
        paged before the silence, assert that page again."""
        if acting_level(finding) < LEVEL[Policy.PAGE]:
            return
        if not self._paged(run, finding):
            self._page(run, finding)
        elif self.pager is not None and not self.dry_run:
            self._fire_pager(run, finding, reassert=True)
            self.record(self._event(run, finding, "page", "reasserted"))

    def resolved(self, run: RunFacts, finding: Finding) -> None:
        paged = acting_level(finding) >= LEVEL[Policy.PAGE]
        if paged and self.pager is not None and not self.dry_run:
            with self._lock:
                self._held_pages.get(run.run_id, {}).pop(finding.detector, None)
            self.pager.resolve(run.run_id, finding.detector, finding.severity)
        if self.silences.active(run.run_id, finding.detector):
            # A silenced cause that cleared holds its symptoms back no longer: what still
            # fires pages now, as it would have without the silence.
            for symptom in self.symptoms(run, finding.detector):
                if not self._silenced(run, symptom):
                    self.unsilenced(run, symptom)

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
        event = self._event(run, finding, "page", "queued")
        action_id = self.record(event)
        self._fire_pager(run, finding, on_result=PageSettler(action_id, functools.partial(
            self._page_settled, action_id, event)))

    def settle_restored_page(self, action_id: int, result: str) -> None:
        """A page a previous sidecar journaled, delivered or failed after the restart (the
        pager outbox sent it again): its journal row and counters move as any page's."""
        row = self.store.action(action_id)
        if row is None:
            return
        self._page_settled(action_id, ActionEvent(
            row.run_id, row.trainer, row.detector, row.incident, row.action, row.result,
            detail=dict(row.detail), incarnation=row.incarnation), result)

    def _page_settled(self, action_id: int, queued: ActionEvent, result: str) -> None:
        """A page's targets told what became of it (from their thread): the journal row goes
        from "queued" (or an earlier result) to result, and result is counted too (a counter
        never goes down: ``queued`` stays counted as what happened first)."""
        with self._lock:
            before = self._settled.get(action_id, (queued.run_id, queued.result))[1]
            self._settled[action_id] = (queued.run_id, result)
        # A failed write is counted and logged by the store; the counters still move.
        with contextlib.suppress(StoreWriteFailed):
            self.store.set_result(action_id, result)
        self._count_and_log(dataclasses.replace(queued, result=result,
                                                detail={**queued.detail, "was": before}))

    def _fire_pager(self, run: RunFacts, finding: Finding,
                    on_result: Callable[[str], None] | None = None,
                    reassert: bool = False) -> None:
        assert self.pager is not None
        with self._lock:
            self._held_pages.setdefault(run.run_id, {})[finding.detector] = finding.severity
        # The wording the Prometheus rule carries too (a detector outside ALL has none).
        detector = BY_ID.get(finding.detector)
        summary = (detector.spec.render_summary(run.run_id) if detector is not None
                   else f"{finding.detector} on run {run.run_id}")
        meaning = f"{detector.spec.meaning} " if detector is not None else ""
        self.pager.fire(  # the pager appends the evidence to the description
            run.run_id, finding.detector, finding.severity, summary=summary,
            description=f"Run {run.run_id}: {meaning}({finding.summary}).",
            evidence=dict(sorted(finding.evidence.items())),
            starts_at=finding.fired_at or None, on_result=on_result, reassert=reassert,
        )
