"""The run registry: the one place where events become state and state becomes verdicts.

``ingest`` applies one batch from one rank, re-evaluates the run's detectors and hands every
transition (firing or resolved) to the actions; the answer carries the ack and any directive
for that rank. ``tick`` handles what time alone decides (stalled runs, expiry of ended runs).
Everything runs under one lock: readers (exporter, status) see a consistent run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog

from deadweight.proto import pb
from deadweight.sidecar import detectors, history, limits
from deadweight.sidecar.attestation import Attestor, ProcessIdentity, is_alive
from deadweight.sidecar.detectors import checkpoints
from deadweight.sidecar.detectors.base import Detector, Policy, Verdict
from deadweight.sidecar.detectors.frozen import FrozenWeights
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import CheckpointPoint, RunState, StepPoint
from deadweight.sidecar.store import RETENTION_SECONDS, Store

if TYPE_CHECKING:
    from deadweight.sidecar.checkpoint_inspector import CheckpointInspection


class CheckpointSink(Protocol):
    """Told where a run writes checkpoints and which ones it reported (the watcher)."""

    def watch(self, run_id: str, output_dir: str) -> None: ...

    def submit(self, run_id: str, path: str) -> None: ...


log = structlog.get_logger("deadweight.registry")

MAX_RUN_ID_LENGTH = 128
MAX_EVENTS_PER_BATCH = 4096
MAX_RANK = 65535
#: After a restart, a finding read back from the store stays firing until the detector
#: confirms it or the run has reported this many optimizer steps since (windows restart empty).
RESUME_HOLD_STEPS = 8
#: Seconds between checks that the registered processes of live runs still exist.
EXIT_CHECK_SECONDS = 5.0


class IngestError(ValueError):
    """A batch the sidecar refuses; the message says why and goes back to the client."""


class IdentityRejected(IngestError):
    """A batch for a rank that another (kernel-identified) process registered."""


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


@dataclass
class Peer:
    """Who is on the other end of a stream, as the transport (not the message) says.

    One per stream: ``identity`` is set once the stream's RunStart redeemed an attestation
    nonce (unix socket only); ``rejected`` tells the server to end the stream.
    """

    pid: int = 0
    uid: int = -1
    address: str = ""
    identity: ProcessIdentity | None = None
    rejected: str = ""


class ActionSink(Protocol):
    """Receives verdict transitions; returns directives to send to the run's ranks."""

    def fired(self, run: RunState, finding: Finding) -> list[pb.Directive]: ...

    def resolved(self, run: RunState, finding: Finding) -> None: ...

    def resumed(self, run: RunState, finding: Finding) -> list[pb.Directive]: ...

    def forget(self, run_id: str) -> None:
        """The run expired: drop what is kept per run in memory (the journal stays)."""
        ...


class LogOnlyActions:
    """An action sink that only logs (for tests and the observe-everything mode)."""

    def fired(self, run: RunState, finding: Finding) -> list[pb.Directive]:
        log.warning("finding", run_id=run.run_id, detector=finding.detector)
        return []

    def resolved(self, run: RunState, finding: Finding) -> None:
        return None

    def resumed(self, run: RunState, finding: Finding) -> list[pb.Directive]:
        return []

    def forget(self, run_id: str) -> None:
        return None


@dataclass
class _RunEntry:
    state: RunState
    findings: dict[str, Finding] = field(default_factory=dict)
    directives: list[pb.Directive] = field(default_factory=list)
    delivered: dict[int, int] = field(default_factory=dict)
    #: rank -> the process the kernel named when that rank registered.
    identities: dict[int, ProcessIdentity] = field(default_factory=dict)
    #: detectors whose firing finding was read back after a restart, not yet re-confirmed.
    held: set[str] = field(default_factory=set)
    exit_checked_at: float = 0.0
    #: The last optimizer step written to the store's history (for the run report).
    history_step: int = 0


class Registry:
    """All live runs, their findings and pending directives."""

    def __init__(
        self,
        actions: ActionSink | None = None,
        settings: DetectorSettings | None = None,
        policies: dict[str, Policy] | None = None,
        active_detectors: Iterable[Detector] = detectors.ALL,
        max_runs: int = 1000,
        ended_ttl_seconds: float = 900.0,
        store: Store | None = None,
        attestor: Attestor | None = None,
        resume_hold_steps: int = RESUME_HOLD_STEPS,
    ) -> None:
        self.actions = actions or LogOnlyActions()
        self.store = store or Store()
        self.attestor = attestor
        self.resume_hold_steps = resume_hold_steps
        self.settings = settings or DetectorSettings()
        self.watcher: CheckpointSink | None = None
        self.detectors = tuple(active_detectors)
        self.policies = {d.id: d.default_policy for d in self.detectors}
        self.policies.update(policies or {})
        self.max_runs = max_runs
        self.ended_ttl_seconds = ended_ttl_seconds
        self._lock = threading.RLock()
        self._runs: dict[str, _RunEntry] = {}
        self.rejected_batches = 0
        self.duplicate_events = 0

    # -- ingest ----------------------------------------------------------------------------

    def ingest(self, request: pb.StreamRequest, peer: Peer | None = None) -> pb.StreamResponse:
        """Apply one batch; answer with the ack, directives for this rank, or an error."""
        peer = peer or Peer()
        try:
            self._validate(request)
            with self._lock:
                binding = self._authorize(self._runs.get(request.run_id), request, peer)
                entry = self._entry(request)
                if binding is not None:
                    self._bind(entry, request.rank, binding)
                ack = self._apply(entry, request, peer)
                self._evaluate(entry)
                rank_directives = self._take_directives(entry, request.rank)
            return pb.StreamResponse(ack_seq=ack, directives=rank_directives)
        except IngestError as err:
            if isinstance(err, IdentityRejected):
                peer.rejected = str(err)
            self.rejected_batches += 1
            log.warning("batch_rejected", run_id=request.run_id[:MAX_RUN_ID_LENGTH],
                        reason=str(err))
            return pb.StreamResponse(error=str(err))

    def _validate(self, request: pb.StreamRequest) -> None:
        if not request.run_id:
            raise IngestError("run_id is empty")
        if len(request.run_id) > MAX_RUN_ID_LENGTH:
            raise IngestError(f"run_id longer than {MAX_RUN_ID_LENGTH} characters")
        if not request.run_id.isprintable():
            raise IngestError("run_id has non-printable characters")
        if not 0 <= request.rank <= MAX_RANK:
            raise IngestError(f"rank {request.rank} outside 0..{MAX_RANK}")
        if len(request.events) > MAX_EVENTS_PER_BATCH:
            raise IngestError(f"more than {MAX_EVENTS_PER_BATCH} events in one batch")
        problem = limits.batch_problem(request)
        if problem is not None:
            raise IngestError(problem)

    def _entry(self, request: pb.StreamRequest) -> _RunEntry:
        entry = self._runs.get(request.run_id)
        if entry is not None:
            return entry
        if not any(e.WhichOneof("body") == "run_start" for e in request.events):
            raise IngestError(f"unknown run_id {request.run_id!r}: send run_start first")
        if len(self._runs) >= self.max_runs and not self._evict_oldest_ended():
            raise IngestError(f"sidecar already tracks {self.max_runs} live runs")
        entry = _RunEntry(RunState(request.run_id))
        self.store.forget_bindings(request.run_id)  # a run id used again: old processes go
        self._runs[request.run_id] = entry
        log.info("run_registered", run_id=request.run_id, rank=request.rank)
        return entry

    # -- identity --------------------------------------------------------------------------

    def _authorize(
        self, entry: _RunEntry | None, request: pb.StreamRequest, peer: Peer
    ) -> ProcessIdentity | None:
        """Who may write to this rank; returns the identity to bind it to, if any.

        A rank registered by a kernel-identified process accepts batches only from streams
        that proved the same identity; a run with identified ranks accepts new ranks only
        from identified processes of the same uid. A pid in any message field counts for
        nothing.
        """
        start = next((e.run_start for e in request.events
                      if e.WhichOneof("body") == "run_start"), None)
        if start is not None and start.attestation and peer.identity is None:
            if self.attestor is None or not peer.address.startswith("unix:"):
                log.warning("attestation_ignored", run_id=request.run_id, rank=request.rank,
                            reason="only streams over the unix socket can attest")
            else:
                peer.identity = self.attestor.redeem(start.attestation)
                if peer.identity is None:
                    log.warning("attestation_refused", run_id=request.run_id,
                                rank=request.rank, reason="unknown, used or stale nonce")
                else:
                    peer.pid, peer.uid = peer.identity.pid, peer.identity.uid
        if entry is None:
            return peer.identity
        bound = entry.identities.get(request.rank)
        owner_uid = next(iter(entry.identities.values())).uid if entry.identities else None
        if bound is not None:
            if peer.identity == bound:
                return None
            if peer.identity is not None and peer.identity.uid == owner_uid and not is_alive(
                bound
            ):
                return peer.identity  # the rank's process was replaced (restarted rank)
            raise IdentityRejected(
                f"rank {request.rank} of run {request.run_id!r} is registered to another "
                "process; only that process may report for it"
            )
        if owner_uid is not None and request.rank not in entry.state.ranks and (
            peer.identity is None or peer.identity.uid != owner_uid
        ):
            raise IdentityRejected(
                f"run {request.run_id!r} was registered by attested processes of uid "
                f"{owner_uid}; a new rank must attest as the same uid"
            )
        return peer.identity

    def _bind(self, entry: _RunEntry, rank: int, identity: ProcessIdentity) -> None:
        entry.identities[rank] = identity
        self.store.bind(entry.state.run_id, rank, identity)
        log.info("rank_bound", run_id=entry.state.run_id, rank=rank, pid=identity.pid,
                 uid=identity.uid, start_time=identity.start_time)

    def progress(self, run_id: str) -> tuple[int, bool, frozenset[int]] | None:
        """(step, ended, ranks) of a run, read under the lock (for the enforcer's thread)."""
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                return None
            run = entry.state
            return run.step, run.ended, frozenset(run.ranks)

    def identities(self, run_id: str) -> dict[int, ProcessIdentity]:
        with self._lock:
            entry = self._runs.get(run_id)
            return {} if entry is None else dict(entry.identities)

    def _evict_oldest_ended(self) -> bool:
        """Make room for a new run by forgetting the run that ended first, if any ended."""
        ended = [(e.state.ended_at, run_id) for run_id, e in self._runs.items() if e.state.ended]
        if not ended:
            return False
        _, run_id = min(ended)
        self._expire(run_id, "max_runs")
        return True

    def _expire(self, run_id: str, reason: str) -> None:
        del self._runs[run_id]
        self.actions.forget(run_id)
        log.info("run_expired", run_id=run_id, reason=reason)

    def _apply(self, entry: _RunEntry, request: pb.StreamRequest, peer: Peer) -> int:
        run = entry.state
        if request.rank not in run.ranks and len(run.ranks) >= limits.MAX_RANKS_PER_RUN:
            raise IngestError(f"run already has {limits.MAX_RANKS_PER_RUN} ranks")
        rank = run.rank(request.rank)
        now = time.time()
        rank.last_seen = now
        rank.first_seen = rank.first_seen or now
        rank.connected = True
        for event in request.events:
            kind = event.WhichOneof("body")
            if event.seq and event.seq <= rank.last_seq:
                self.duplicate_events += 1
                continue
            rank.last_seq = max(rank.last_seq, event.seq)
            if kind == "run_start":
                self._on_run_start(run, request.rank, event.run_start)
            elif kind == "step":
                self._on_step(run, request.rank, event.step, now)
                self._record_step_history(entry, event.step, now)
            elif kind == "log":
                run.record_log(event.log.step, dict(event.log.values))
                series = history.log_series(dict(event.log.values))
                if series:
                    self.store.add_history(run.run_id, "log", event.log.step, series, now)
            elif kind == "checkpoint":
                self._on_checkpoint(run, event.checkpoint, now)
            elif kind == "heartbeat":
                rank.dropped_events = max(rank.dropped_events, event.heartbeat.dropped_events)
            elif kind == "run_end":
                run.ended = True
                run.end_reason = event.run_end.reason or "completed"
                run.ended_at = now
                self.store.end_run(run.run_id, run.end_reason, now)
                log.info("run_ended", run_id=run.run_id, reason=run.end_reason,
                         step=event.run_end.step)
        return rank.last_seq

    def _on_run_start(self, run: RunState, rank: int, start: pb.RunStart) -> None:
        start.trainer = limits.label_value(start.trainer)  # exported as a label
        if run.start is None or rank <= min(run.ranks, default=rank):
            run.start = start
            self.store.upsert_run(run.run_id, run.trainer, start)
        run.rank(rank).membership = start.membership
        run.ended = False
        if self.watcher is not None and start.output_dir:
            self.watcher.watch(run.run_id, start.output_dir)

    def _on_step(self, run: RunState, rank_id: int, report: pb.StepReport, now: float) -> None:
        rank = run.rank(rank_id)
        if rank.steps and report.step <= rank.steps[-1].step:
            self.duplicate_events += 1
            return  # a repeated or out-of-order step changes nothing
        rank.steps.append(StepPoint.from_report(report, now))
        rank.step = report.step
        rank.last_step_time = now

    def _record_step_history(self, entry: _RunEntry, report: pb.StepReport,
                             now: float) -> None:
        """Keep the newest combined step for the report, once every rank has reported it."""
        combined = entry.state.combined_steps()
        if not combined or combined[-1].step <= entry.history_step:
            return
        point = combined[-1]
        entry.history_step = point.step
        self.store.add_history(entry.state.run_id, "step", point.step,
                               history.step_series(point, report), now)

    def _on_checkpoint(self, run: RunState, report: pb.CheckpointReport, now: float) -> None:
        known = run.checkpoint(report.path)
        if known is not None:  # the watcher got there first: keep its inspection
            known.combined_digest = report.adapter.combined
            known.tensor_digests = dict(report.adapter.tensors)
            known.adapter_bytes = report.adapter.bytes
            checkpoints.judge(run, known)
            return
        point = CheckpointPoint(
            step=report.step,
            path=report.path,
            combined_digest=report.adapter.combined,
            tensor_digests=dict(report.adapter.tensors),
            adapter_bytes=report.adapter.bytes,
            time=now,
        )
        run.add_checkpoint(point)
        self.store.add_checkpoint(run.run_id, point)
        checkpoints.judge(run, point)
        if self.watcher is not None:
            self.watcher.submit(run.run_id, report.path)

    def attach_watcher(self, watcher: CheckpointSink) -> None:
        """Route run output folders and reported checkpoints to watcher."""
        with self._lock:
            self.watcher = watcher
            for entry in self._runs.values():
                start = entry.state.start
                if start is not None and start.output_dir and not entry.state.ended:
                    watcher.watch(entry.state.run_id, start.output_dir)

    def record_inspection(self, run_id: str, inspection: CheckpointInspection,
                          step: int = 0) -> bool:
        """Attach what the files of a checkpoint hold to the run; False for an unknown run."""
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                return False
            run = entry.state
            point = run.checkpoint(inspection.path)
            if point is None:
                point = CheckpointPoint(step=step, path=inspection.path,
                                        combined_digest=inspection.adapter_digest,
                                        tensor_digests=dict(inspection.tensor_digests),
                                        adapter_bytes=inspection.tensor_bytes, time=time.time())
                run.add_checkpoint(point)
                self.store.add_checkpoint(run.run_id, point)
            point.inspection = inspection
            point.adapter_bytes = inspection.tensor_bytes
            checkpoints.judge(run, point)
            self._evaluate(entry)
            return True

    # -- verdicts --------------------------------------------------------------------------

    def _evaluate(self, entry: _RunEntry, now: float | None = None) -> None:
        run = entry.state
        run.evaluated_at = time.time() if now is None else now
        for detector in self.detectors:
            finding = entry.findings.get(detector.id)
            if run.ended and detector.id not in detectors.ARTIFACT_IDS:
                if finding is not None and finding.firing:
                    self._resolve(entry, finding, "run ended")
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
                self._fire(entry, detector, verdict)
            elif verdict.firing and finding is not None:
                finding.evidence = dict(verdict.evidence)  # the step it fired at stays
                finding.summary = verdict.summary
                entry.held.discard(detector.id)
            elif not verdict.firing and finding is not None and finding.firing:
                if detector.id in entry.held and (
                    len(run.combined_steps()) < self.resume_hold_steps
                ):
                    continue  # read back after a restart: too few fresh steps to clear it
                self._resolve(entry, finding, "recovered")

    def _fire(self, entry: _RunEntry, detector: Detector, verdict: Verdict) -> None:
        finding = entry.findings.get(detector.id) or Finding(
            detector=detector.id,
            severity=detector.severity.value,
            policy=self.policies[detector.id].value,
        )
        finding.firing = True
        finding.step = verdict.step
        finding.summary = verdict.summary
        finding.evidence = dict(verdict.evidence)
        finding.fired_at = time.time()
        # Numbering continues from the journal, so a run id used again (or a run that
        # expired from memory) never shares an incident, and its actions, with the past.
        finding.incidents = max(finding.incidents, self.store.last_incident(
            entry.state.run_id, detector.id)) + 1
        entry.findings[detector.id] = finding
        self.store.open_incident(
            entry.state.run_id, finding.detector, finding.incidents, finding.severity,
            finding.policy, finding.step, finding.summary, finding.evidence,
            finding.fired_at, enforce=finding.policy == Policy.KILL.value,
        )
        log.warning(
            "detector_fired", run_id=entry.state.run_id, detector=detector.id,
            severity=finding.severity, policy=finding.policy, step=verdict.step,
            summary=verdict.summary, evidence=verdict.evidence,
        )
        entry.directives.extend(self.actions.fired(entry.state, finding))

    def _resolve(self, entry: _RunEntry, finding: Finding, why: str) -> None:
        finding.firing = False
        finding.resolved_at = time.time()
        entry.held.discard(finding.detector)
        self.store.resolve_incident(entry.state.run_id, finding.detector, finding.incidents,
                                    finding.resolved_at)
        log.info("detector_resolved", run_id=entry.state.run_id, detector=finding.detector,
                 reason=why)
        self.actions.resolved(entry.state, finding)

    def _take_directives(self, entry: _RunEntry, rank: int) -> list[pb.Directive]:
        start = entry.delivered.get(rank, 0)
        entry.delivered[rank] = len(entry.directives)
        return entry.directives[start:]

    # -- time ------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Re-evaluate time-based verdicts and drop ended runs past their TTL."""
        now = time.time() if now is None else now
        with self._lock:
            for run_id, entry in list(self._runs.items()):
                if entry.state.ended and now - entry.state.ended_at > self.ended_ttl_seconds:
                    self._expire(run_id, "ttl")
                    continue
                self._check_exits(entry, now)
                self._evaluate(entry, now)

    def _check_exits(self, entry: _RunEntry, now: float) -> None:
        """A run whose every registered process is gone has ended, run end or not."""
        run = entry.state
        if run.ended or not entry.identities or now - entry.exit_checked_at < EXIT_CHECK_SECONDS:
            return
        entry.exit_checked_at = now
        if not any(is_alive(identity) for identity in entry.identities.values()):
            self._end(entry, "process_exited", now)

    def _end(self, entry: _RunEntry, reason: str, now: float) -> None:
        run = entry.state
        run.ended = True
        run.end_reason = reason
        run.ended_at = now
        self.store.end_run(run.run_id, reason, now)
        log.info("run_ended", run_id=run.run_id, reason=reason, step=run.step)

    def mark_ended(self, run_id: str, reason: str) -> None:
        """End a run from outside the stream (its processes were killed or are gone)."""
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None or entry.state.ended:
                return
            self._end(entry, reason, time.time())
            self._evaluate(entry)

    # -- restart ---------------------------------------------------------------------------

    def resume(self) -> int:
        """Read back the runs, bindings, checkpoints and incidents a previous sidecar left.

        Firing findings come back firing (no second page, STOP or kill for the same
        incident); the action sink re-asserts them. Returns the number of runs restored.
        """
        now = time.time()
        restored = 0
        pruned = self.store.prune(ended_before=now - RETENTION_SECONDS)
        if pruned:
            log.info("state_pruned", runs=pruned, older_than_days=RETENTION_SECONDS / 86400)
        with self._lock:
            for stored in self.store.runs(ended_since=now - self.ended_ttl_seconds):
                if stored.run_id in self._runs or len(self._runs) >= self.max_runs:
                    continue
                run = RunState(stored.run_id, created=stored.created)
                run.start = stored.start
                entry = _RunEntry(run)
                entry.identities = self.store.bindings(stored.run_id)
                for rank in entry.identities:
                    run.rank(rank).last_seen = now  # stall clocks restart with the sidecar
                run.ended, run.end_reason, run.ended_at = (
                    stored.ended, stored.end_reason, stored.ended_at)
                checkpoints = self.store.checkpoints(stored.run_id)
                run.checkpoints.extend(checkpoints)
                run.checkpoints_total = len(checkpoints)
                self._runs[stored.run_id] = entry
                self._restore_findings(entry)
                restored += 1
        if restored:
            log.info("runs_resumed", runs=restored)
        return restored

    def _restore_findings(self, entry: _RunEntry) -> None:
        run = entry.state
        latest = {}
        for incident in self.store.incidents(run.run_id):
            latest[incident.detector] = incident  # ordered by time: the last one wins
        for detector, incident in latest.items():
            finding = Finding(
                detector=detector, severity=incident.severity, policy=incident.policy,
                firing=incident.resolved_at is None, step=incident.step,
                summary=incident.summary, evidence=dict(incident.evidence),
                fired_at=incident.fired_at, resolved_at=incident.resolved_at or 0.0,
                incidents=incident.incident,
            )
            entry.findings[detector] = finding
            if finding.firing and not run.ended:
                entry.held.add(detector)
                entry.directives.extend(self.actions.resumed(run, finding))

    # -- readers ---------------------------------------------------------------------------

    def runs(self) -> list[tuple[RunState, list[Finding]]]:
        """A consistent copy of every run's state and findings (for exporter and status)."""
        with self._lock:
            return [
                (entry.state, [Finding(**vars(f)) for f in entry.findings.values()])
                for entry in self._runs.values()
            ]

    def findings(self, run_id: str) -> dict[str, Finding]:
        with self._lock:
            entry = self._runs.get(run_id)
            return {} if entry is None else {k: Finding(**vars(f)) for k, f in
                                             entry.findings.items()}

    def run(self, run_id: str) -> RunState | None:
        with self._lock:
            entry = self._runs.get(run_id)
            return None if entry is None else entry.state

    def frozen_streak(self, run: RunState) -> int:
        return FrozenWeights.streak(run, self.settings)

    def status(self) -> pb.StatusResponse:
        now = time.time()
        response = pb.StatusResponse()
        for run, findings in self.runs():
            response.runs.append(
                pb.RunStatus(
                    run_id=run.run_id,
                    trainer=run.trainer,
                    ranks=sorted(run.ranks),
                    step=run.step,
                    last_seen_seconds=max(0.0, now - run.last_seen),
                    ended=run.ended,
                    findings=[
                        pb.Finding(
                            detector=f.detector, severity=f.severity, firing=f.firing,
                            step=f.step, summary=f.summary, evidence=f.evidence,
                            policy=f.policy,
                        )
                        for f in sorted(findings, key=lambda f: f.detector)
                    ],
                )
            )
        return response
