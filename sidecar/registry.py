"""The run registry: the one place where events become state and state becomes verdicts.

``ingest`` applies one batch from one rank, re-evaluates the run's detectors and hands every
transition (firing or resolved) to the actions; the answer carries the ack and any directive
for that rank. ``tick`` handles what time alone decides (stalled runs, expiry of ended runs).
Everything runs under one lock: readers (exporter, status) see a consistent run.

Trust: on the unix socket a run is written only by processes the kernel identified
(attestation), unless the operator opted out (``allow_unattested``, logged and exported). A
run's ranks are bound once: a RunStart from another process for a bound rank, or for a run
that ended, starts a new incarnation (fresh state and sequence numbers; the old one's verdicts
stay in the journal, its firing findings resolve). Unattested streams never write to an
attested run; a new rank must attest as the run's uid. Only the rank that started the
incarnation ends the run or sets its run-wide logs. Live runs that send nothing for
``silent_run_seconds`` end as ``silent``. A journal write that fails (a full disk) leaves the
verdict pending: it fires, with its actions, at the next evaluation once the write succeeds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog

from deadweight.proto import pb
from deadweight.sidecar import detectors, limits
from deadweight.sidecar.attestation import Attestor, ProcessIdentity, is_alive
from deadweight.sidecar.detectors import checkpoints
from deadweight.sidecar.detectors.base import Detector, Policy, Verdict
from deadweight.sidecar.detectors.frozen import FrozenWeights
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import CheckpointPoint, RunState, StepPoint
from deadweight.sidecar.store import RETENTION_SECONDS, Store, StoreWriteFailed

if TYPE_CHECKING:
    from deadweight.sidecar.checkpoint_inspector import CheckpointInspection


class CheckpointSink(Protocol):
    """Told where a run writes checkpoints and which ones it reported (the watcher)."""

    def watch(self, run_id: str, output_dir: str, owner_uid: int | None = None) -> None: ...

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
#: A live run that sends nothing (not even a heartbeat) for this long ends as ``silent``.
SILENT_RUN_SECONDS = 3600.0


class IngestError(ValueError):
    """A batch the sidecar refuses; the message says why and goes back to the client."""


class IdentityRejected(IngestError):
    """A batch for a rank that another (kernel-identified) process registered."""


class CapacityError(IngestError):
    """The sidecar holds as many runs as it may."""


def _refusal_kind(err: IngestError) -> str:
    """The ``kind`` label of a refused batch (a few fixed values: bounded cardinality)."""
    if isinstance(err, AttestationRequired):
        return "attestation"
    if isinstance(err, IdentityRejected):
        return "identity"
    if isinstance(err, CapacityError):
        return "capacity"
    return "invalid"


class AttestationRequired(IdentityRejected):
    """A stream on the unix socket that did not prove who it is (and no opt-out)."""


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
    #: run_id -> the incarnation this stream registered in; a newer one closes the stream.
    incarnations: dict[str, int] = field(default_factory=dict)


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
    #: Counts from 1 per run id in this sidecar; a rebind or a reuse starts the next one.
    incarnation: int = 1
    #: The rank whose RunStart started this incarnation: only it ends the run.
    leader: int | None = None


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
        allow_unattested: bool = False,
        silent_run_seconds: float = SILENT_RUN_SECONDS,
        trainer_uids: Iterable[int] = (),
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
        #: On the unix socket, streams need not attest (the operator's opt-out).
        self.allow_unattested = allow_unattested
        self.silent_run_seconds = silent_run_seconds
        #: Uids whose attested processes may report (empty: any uid that reaches the socket).
        self.trainer_uids = frozenset(trainer_uids)
        #: Refused batches by kind (attestation, identity, capacity, limits): on /metrics.
        self.refusals: Counter[str] = Counter()
        #: Incarnations started by a rebind or a run id used again.
        self.incarnations_started = 0
        #: Verdicts whose journal write failed; they fire once it succeeds.
        self.pending_verdicts = 0
        if attestor is not None and allow_unattested:
            log.warning("attestation_optional", note="unattested streams on the unix socket "
                        "may register runs; they can be paged and stopped, never signalled")

    @property
    def lock(self) -> threading.RLock:
        """The registry's lock: hold it to read live run state consistently (the exporter)."""
        return self._lock

    # -- ingest ----------------------------------------------------------------------------

    def ingest(self, request: pb.StreamRequest, peer: Peer | None = None) -> pb.StreamResponse:
        """Apply one batch; answer with the ack, directives for this rank, or an error."""
        peer = peer or Peer()
        try:
            self._validate(request)
            with self._lock:
                entry = self._runs.get(request.run_id)
                if entry is not None and self._starts_incarnation(entry, request, peer):
                    entry = self._new_incarnation(entry, request.rank, peer)
                binding = self._authorize(entry, request, peer)
                entry = self._entry(request)
                if binding is not None:
                    self._bind(entry, request.rank, binding)
                if self._has_run_start(request) or request.run_id not in peer.incarnations:
                    peer.incarnations[request.run_id] = entry.incarnation
                ack = self._apply(entry, request, peer)
                self._evaluate(entry)
                rank_directives = self._take_directives(entry, request.rank)
            return pb.StreamResponse(ack_seq=ack, directives=rank_directives)
        except IngestError as err:
            if isinstance(err, IdentityRejected):
                peer.rejected = str(err)
            self.refusals[_refusal_kind(err)] += 1
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

    @staticmethod
    def _has_run_start(request: pb.StreamRequest) -> bool:
        return any(e.WhichOneof("body") == "run_start" for e in request.events)

    def _entry(self, request: pb.StreamRequest) -> _RunEntry:
        entry = self._runs.get(request.run_id)
        if entry is not None:
            return entry
        if not self._has_run_start(request):
            raise IngestError(f"unknown run_id {request.run_id!r}: send run_start first")
        if len(self._runs) >= self.max_runs and not self._evict_oldest_ended():
            raise CapacityError(f"sidecar already tracks {self.max_runs} live runs")
        entry = _RunEntry(RunState(request.run_id), leader=request.rank)
        self._journal(self.store.forget_bindings, request.run_id)  # old processes go
        self._runs[request.run_id] = entry
        log.info("run_registered", run_id=request.run_id, rank=request.rank)
        return entry

    # -- incarnations ----------------------------------------------------------------------

    def _starts_incarnation(self, entry: _RunEntry, request: pb.StreamRequest,
                            peer: Peer) -> bool:
        """True when a RunStart begins a new life of this run id rather than joining it.

        That is a run that ended, a rank bound to another process (a rebind: the old process
        may be a pre-registered impostor or a restarted rank), or, for unattested runs, a rank
        whose sequence numbers start again (a new process)."""
        start_seq = next((e.seq for e in request.events
                          if e.WhichOneof("body") == "run_start"), None)
        if start_seq is None:
            return False
        if entry.state.ended:
            return True
        self._redeem(request, peer)
        bound = entry.identities.get(request.rank)
        if bound is not None and peer.identity is not None:
            # Rebinding a rank: the same uid (a restarted or reused job) or a process that is
            # gone. A live process of another uid keeps its run (_authorize refuses).
            return peer.identity != bound and (
                peer.identity.uid == bound.uid or not is_alive(bound))
        if entry.identities and peer.identity is not None:
            return False  # a new rank of an attested run: _authorize decides
        rank = entry.state.ranks.get(request.rank)
        return bool(rank is not None and not entry.identities and peer.identity is None
                    and rank.last_seq and start_seq and start_seq <= rank.last_seq
                    and peer.incarnations.get(request.run_id) != entry.incarnation)

    def _new_incarnation(self, old: _RunEntry, rank: int, peer: Peer) -> _RunEntry:
        """Close the old incarnation (its verdicts stay journaled) and start a fresh one."""
        run = old.state
        now = time.time()
        if not run.ended:
            self._end(old, "superseded", now)
        for finding in old.findings.values():
            if finding.firing:
                self._resolve(old, finding, "incarnation closed")
        superseded = getattr(self.actions, "superseded", None)
        if callable(superseded):
            superseded(run.run_id)
        entry = _RunEntry(RunState(run.run_id), incarnation=old.incarnation + 1, leader=rank)
        self._runs[run.run_id] = entry
        self._journal(self.store.forget_bindings, run.run_id)
        self.incarnations_started += 1
        log.warning("run_incarnation_started", run_id=run.run_id, incarnation=entry.incarnation,
                    rank=rank, previous_step=run.step, previous_end=run.end_reason,
                    pid=peer.identity.pid if peer.identity else None,
                    uid=peer.identity.uid if peer.identity else None)
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
        self._redeem(request, peer)
        if entry is None and not self._has_run_start(request):
            raise IngestError(f"unknown run_id {request.run_id!r}: send run_start first")
        if (peer.identity is None and self.attestor is not None and not self.allow_unattested
                and peer.address.startswith("unix:")):
            raise AttestationRequired(
                f"run {request.run_id!r} rank {request.rank}: this sidecar requires "
                "attestation on the unix socket (RunStart.attestation from the .attest socket)")
        if (self.trainer_uids and peer.identity is not None
                and peer.identity.uid not in self.trainer_uids):
            raise AttestationRequired(
                f"run {request.run_id!r}: uid {peer.identity.uid} is not a trainer uid of this "
                f"sidecar ({', '.join(str(u) for u in sorted(self.trainer_uids))})")
        if entry is None:
            return peer.identity
        known = peer.incarnations.get(request.run_id)
        if known is not None and known != entry.incarnation and not self._has_run_start(
                request):
            raise IdentityRejected(
                f"run {request.run_id!r} started incarnation {entry.incarnation}; this stream "
                f"belongs to incarnation {known}, which is closed: send run_start again")
        if entry.identities and peer.identity is None:
            raise IdentityRejected(
                f"run {request.run_id!r} is written by attested processes only; this stream "
                "did not attest")
        bound = entry.identities.get(request.rank)
        owner_uid = next(iter(entry.identities.values())).uid if entry.identities else None
        if bound is not None:
            if peer.identity == bound:
                return None
            raise IdentityRejected(
                f"rank {request.rank} of run {request.run_id!r} is registered to another "
                f"process (uid {bound.uid}); only that process may report for it"
            )
        if owner_uid is not None and request.rank not in entry.state.ranks and (
            peer.identity is None or peer.identity.uid != owner_uid
        ):
            raise IdentityRejected(
                f"run {request.run_id!r} was registered by attested processes of uid "
                f"{owner_uid}; a new rank must attest as the same uid"
            )
        return peer.identity

    def _redeem(self, request: pb.StreamRequest, peer: Peer) -> None:
        """Turn the RunStart's nonce into the stream's kernel identity (once per stream)."""
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

    def _bind(self, entry: _RunEntry, rank: int, identity: ProcessIdentity) -> None:
        entry.identities[rank] = identity
        self._journal(self.store.bind, entry.state.run_id, rank, identity)
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
                self._on_run_start(entry, request.rank, event.run_start)
            elif kind == "step":
                self._on_step(run, request.rank, event.step, now)
            elif kind == "log":
                if request.rank == entry.leader:  # run-wide values: the leader's only
                    run.record_log(event.log.step, dict(event.log.values))
            elif kind == "checkpoint":
                self._on_checkpoint(run, event.checkpoint, now)
            elif kind == "heartbeat":
                rank.dropped_events = max(rank.dropped_events, event.heartbeat.dropped_events)
            elif kind == "run_end":
                if request.rank != entry.leader:
                    log.info("rank_ended", run_id=run.run_id, rank=request.rank,
                             reason=event.run_end.reason, leader=entry.leader)
                    continue  # only the rank that started the run ends it
                run.ended = True
                run.end_reason = event.run_end.reason or "completed"
                run.ended_at = now
                self._journal(self.store.end_run, run.run_id, run.end_reason, now)
                log.info("run_ended", run_id=run.run_id, reason=run.end_reason,
                         step=event.run_end.step)
        return rank.last_seq

    def _on_run_start(self, entry: _RunEntry, rank: int, start: pb.RunStart) -> None:
        run = entry.state
        start.trainer = limits.label_value(start.trainer)  # exported as a label
        if run.start is None or rank == entry.leader:
            run.start = start
            self._journal(self.store.upsert_run, run.run_id, run.trainer, start)
        run.rank(rank).membership = start.membership
        if self.watcher is not None and start.output_dir:
            bound = entry.identities.get(rank)
            self.watcher.watch(run.run_id, start.output_dir,
                               owner_uid=bound.uid if bound is not None else None)

    def _on_step(self, run: RunState, rank_id: int, report: pb.StepReport, now: float) -> None:
        rank = run.rank(rank_id)
        if rank.steps and report.step <= rank.steps[-1].step:
            self.duplicate_events += 1
            return  # a repeated or out-of-order step changes nothing
        rank.steps.append(StepPoint.from_report(report, now))
        rank.step = report.step
        rank.last_step_time = now

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
        self._journal(self.store.add_checkpoint, run.run_id, point)
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

    def record_refusal(self, run_id: str, path: str, reason: str) -> bool:
        """A checkpoint path of the run was not read (the watcher's refusal): a finding."""
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                return False
            entry.state.refused_paths.append((path, reason))
            entry.state.refused_total += 1
            self._evaluate(entry)
            return True

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
                self._journal(self.store.add_checkpoint, run.run_id, point)
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
        previous = entry.findings.get(detector.id)
        finding = Finding(
            detector=detector.id,
            severity=detector.severity.value,
            policy=self.policies[detector.id].value,
            firing=True,
            step=verdict.step,
            summary=verdict.summary,
            evidence=dict(verdict.evidence),
            fired_at=time.time(),
            # Numbering continues from the journal, so a run id used again (or a run that
            # expired from memory) never shares an incident, and its actions, with the past.
            incidents=max(previous.incidents if previous else 0, self.store.last_incident(
                entry.state.run_id, detector.id)) + 1,
        )
        try:  # journal first: a verdict whose incident is not on disk has not fired yet
            self.store.open_incident(
                entry.state.run_id, finding.detector, finding.incidents, finding.severity,
                finding.policy, finding.step, finding.summary, finding.evidence,
                finding.fired_at, enforce=finding.policy == Policy.KILL.value,
            )
            directives = self.actions.fired(entry.state, finding)
        except StoreWriteFailed as err:
            self.pending_verdicts += 1
            log.error("verdict_pending", run_id=entry.state.run_id, detector=detector.id,
                      error=str(err), note="the journal cannot be written; the verdict and "
                      "its actions are tried again at the next evaluation")
            return
        entry.findings[detector.id] = finding
        log.warning(
            "detector_fired", run_id=entry.state.run_id, detector=detector.id,
            severity=finding.severity, policy=finding.policy, step=verdict.step,
            summary=verdict.summary, evidence=verdict.evidence,
        )
        entry.directives.extend(directives)

    def _resolve(self, entry: _RunEntry, finding: Finding, why: str) -> None:
        finding.firing = False
        finding.resolved_at = time.time()
        entry.held.discard(finding.detector)
        self._journal(self.store.resolve_incident, entry.state.run_id, finding.detector,
                      finding.incidents, finding.resolved_at)
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
                if (not entry.state.ended
                        and now - entry.state.last_seen > self.silent_run_seconds):
                    self._end(entry, "silent", now)
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
        self._journal(self.store.end_run, run.run_id, reason, now)
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

    def _journal(self, write: Callable[..., object], *args: object) -> None:
        """A journal write that may fail (a full disk) without losing the live state: the
        store counted and logged it; memory stays authoritative until the next start."""
        with contextlib.suppress(StoreWriteFailed):
            write(*args)

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
