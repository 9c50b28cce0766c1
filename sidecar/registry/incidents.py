"""The findings lifecycle: a detector's verdict fires an incident, recovers, or comes back.

``evaluate`` runs a run's detectors and turns each change of verdict into ``fire`` (a new
incident, numbered after every earlier one of the same run id, the store's included) or
``resolve`` (the condition cleared while the run was live: a run's end never resolves a
verdict, one still firing then stays firing at end); ``restore`` reads back the incidents
a previous sidecar left open. The actions are told through the run's outbox with a frozen
copy of the run and finding, so they run after the registry lock is released and never see a
half-applied batch.

A firing whose incident cannot be journaled (a full disk) is undone: the finding goes back to
not firing, its number is given back, and the next evaluation (every tick) fires it again, so
the verdict stays pending and its page, STOP or kill happen once the journal takes writes.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Sequence

import structlog

from ...proto import pb
from .. import detectors
from ..detectors.base import Detector, Policy, Verdict
from ..model.finding import SEVERITY_ORDER, ActionSink, Finding, RunSnapshot
from ..model.settings import DetectorSettings
from ..store.journal import Store, StoredIncident, StoreWriteFailed
from .run_table import RunEntry

log = structlog.get_logger("deadweight.registry")

#: After a restart, a finding read back from the store stays firing until the detector
#: confirms it or the run has reported this many optimizer steps since (windows restart empty);
#: likewise a firing finding when another rank joins the run (``RunEntry.hold_firing``).
RESUME_HOLD_STEPS = 8


def stepped_up(detector: Detector, finding: Finding, verdict: Verdict) -> bool:
    """Whether a firing verdict now carries a higher severity than its standing incident (its
    own, or its spec's when it names none)."""
    severity = verdict.severity or detector.severity
    return SEVERITY_ORDER[severity.value] < SEVERITY_ORDER.get(finding.severity, 3)


class FindingLifecycle:
    """Evaluates detectors and keeps each run's findings and incidents."""

    def __init__(self, detectors: Iterable[Detector], settings: DetectorSettings,
                 policies: dict[str, Policy], actions: ActionSink, store: Store,
                 resume_hold_steps: int = RESUME_HOLD_STEPS,
                 lock: threading.RLock | None = None) -> None:
        #: The registry's lock, taken again to undo a firing the journal refused.
        self.lock = lock or threading.RLock()
        #: Firings undone because the journal could not be written (exported).
        self.pending_verdicts = 0
        self.detectors = tuple(detectors)
        self.settings = settings
        self.policies = policies
        self.actions = actions
        self.store = store
        self.resume_hold_steps = resume_hold_steps

    def evaluate(self, entry: RunEntry, now: float | None = None) -> None:
        run = entry.state
        run.evaluated_at = time.time() if now is None else now
        for detector in self.detectors:
            finding = entry.findings.get(detector.id)
            if run.ended and detector.id not in detectors.ARTIFACT_IDS:
                # The run's end is no recovery: a verdict firing now stays firing (at end)
                # until the run restarts or expires; the training is no longer judged.
                continue
            if finding is not None and finding.firing and detector.latching:
                continue
            try:
                verdict = detector.evaluate(run, self.settings)
            except Exception:  # one broken detector must not blind the others
                log.exception("detector_failed", detector=detector.id, run_id=run.run_id)
                continue
            if verdict is None:
                continue
            if verdict.firing and (finding is None or not finding.firing):
                self.fire(entry, detector, verdict)
            elif verdict.firing and finding is not None and stepped_up(detector, finding, verdict):
                # A new incident at the higher severity: its page goes to that severity's
                # receiver; the lower one resolves, its page with it.
                self.resolve(entry, finding, "stepped up to "
                             f"{(verdict.severity or detector.severity).value}")
                self.fire(entry, detector, verdict)
            elif verdict.firing and finding is not None:
                finding.evidence = dict(verdict.evidence)  # the step it fired at stays
                finding.summary = verdict.summary
                entry.held.discard(detector.id)
            elif not verdict.firing and finding is not None and finding.firing:
                if detector.id in entry.held and (
                    len(run.combined_steps()) < self.resume_hold_steps
                ):
                    continue  # restart or rank join: too few fresh steps to clear it
                self.resolve(entry, finding, "recovered")
        self.settle_inherited(entry)

    def settle_inherited(self, entry: RunEntry) -> None:
        """The pages a previous incarnation left: a new incident of the same detector carries
        each on (same labels: no second page); once this incarnation has reported
        ``resume_hold_steps`` steps without it, the run restarted healthy and it resolves."""
        run = entry.state
        for detector, old in list(entry.inherited_pages.items()):
            finding = entry.findings.get(detector)
            if finding is not None and finding.firing:
                del entry.inherited_pages[detector]
            elif not run.ended and len(run.combined_steps()) >= self.resume_hold_steps:
                del entry.inherited_pages[detector]
                log.info("detector_resolved", run_id=run.run_id, detector=detector,
                         reason="the run restarted healthy")
                entry.outbox.add(functools.partial(self.actions.resolved,
                                                   entry.snapshot(), old))

    def fire(self, entry: RunEntry, detector: Detector, verdict: Verdict) -> None:
        run = entry.state
        finding = entry.findings.get(detector.id) or Finding(
            detector=detector.id,
            severity=detector.severity.value,
            policy=self.policies[detector.id].value,
        )
        finding.severity = (verdict.severity or detector.severity).value
        finding.firing = True
        finding.step = verdict.step
        finding.summary = verdict.summary
        finding.evidence = dict(verdict.evidence)
        finding.fired_evidence = dict(verdict.evidence)
        finding.fired_at = time.time()
        # Numbering continues from the journal (read when the run was admitted), so a run id
        # used again never shares an incident, and its actions, with the past.
        finding.incidents = max(finding.incidents, entry.last_incident.get(detector.id, 0)) + 1
        entry.last_incident[detector.id] = finding.incidents
        entry.findings[detector.id] = finding
        log.warning(
            "detector_fired", run_id=run.run_id, detector=detector.id,
            severity=finding.severity, policy=finding.policy, step=verdict.step,
            summary=verdict.summary, evidence=verdict.evidence,
        )
        # The processes bound to this incarnation now: all an escalation may ever signal.
        snapshot = entry.snapshot(processes=True)
        entry.outbox.add(functools.partial(self._journal_and_act, entry, finding, snapshot,
                                           finding.copy()))

    def _journal_and_act(self, entry: RunEntry, finding: Finding, run: RunSnapshot,
                         frozen: Finding) -> Sequence[pb.Directive] | None:
        """Journal the incident, then act on it; undo the firing when the journal fails."""
        try:
            self.store.open_incident(
                run.run_id, frozen.detector, frozen.incidents, frozen.severity, frozen.policy,
                frozen.step, frozen.summary, dict(frozen.evidence), frozen.fired_at,
                enforce=frozen.policy == Policy.KILL.value, incarnation=run.incarnation)
            return self.actions.fired(run, frozen)
        except StoreWriteFailed as err:
            with self.lock:
                if finding.firing and finding.incidents == frozen.incidents:
                    finding.firing = False
                    finding.incidents -= 1
                    entry.last_incident[frozen.detector] = finding.incidents
                self.pending_verdicts += 1
            log.error("verdict_pending", run_id=run.run_id, detector=frozen.detector,
                      error=str(err), note="the journal cannot be written; the verdict and "
                      "its actions are tried again at the next evaluation")
            return None

    def resolve(self, entry: RunEntry, finding: Finding, why: str, page: bool = True
                ) -> Finding:
        """The finding stops firing (journaled); page=False keeps its page held (the caller
        hands the returned copy on). Returns a copy as it resolved."""
        run = entry.state
        finding.firing = False
        finding.resolved_at = time.time()
        entry.held.discard(finding.detector)
        entry.outbox.add(functools.partial(
            self.store.resolve_incident, run.run_id, finding.detector, finding.incidents,
            finding.resolved_at, dict(finding.evidence), entry.incarnation))
        log.info("detector_resolved", run_id=run.run_id, detector=finding.detector,
                 reason=why)
        if page:
            entry.outbox.add(functools.partial(self.actions.resolved, entry.snapshot(),
                                               finding.copy()))
        return finding.copy()

    def restore(self, entry: RunEntry, incidents: list[StoredIncident]) -> None:
        """Findings from a previous sidecar's incidents (ordered by time: the last wins).

        Firing ones come back firing and held (no second page, STOP or kill for the same
        incident); the action sink re-asserts them once the outbox is flushed. Those of an
        ended run come back firing at end, and their pages are re-asserted too (the run
        ended with them: on-call still needs them until the run expires).
        """
        run = entry.state
        latest = {}
        for incident in incidents:
            entry.last_incident[incident.detector] = max(
                entry.last_incident.get(incident.detector, 0), incident.incident)
            if incident.incarnation == entry.incarnation:  # an older life's stay its own
                latest[incident.detector] = incident
        for detector, incident in latest.items():
            finding = Finding(
                detector=detector, severity=incident.severity, policy=incident.policy,
                firing=incident.resolved_at is None, step=incident.step,
                summary=incident.summary, evidence=dict(incident.latest_evidence),
                fired_evidence=dict(incident.evidence), fired_at=incident.fired_at,
                resolved_at=incident.resolved_at or 0.0,
                incidents=incident.incident,
            )
            entry.findings[detector] = finding
        snapshot = entry.snapshot()  # with every finding read back
        for finding in list(entry.findings.values()):
            if finding.firing:
                held = finding.copy()
                if not run.ended:
                    entry.held.add(finding.detector)
                elif held.policy in (Policy.STOP.value, Policy.KILL.value):
                    held.policy = Policy.PAGE.value  # ended: only its page is held again
                entry.outbox.add(functools.partial(self.actions.resumed, snapshot, held))
