"""The run registry: the one place where events become state and state becomes verdicts.

``ingest`` validates one batch from one rank, admits its stream (identity and binding),
applies its events, re-evaluates the run's detectors and answers with the ack and any
directive for that rank. ``tick`` handles what time alone decides (stalled runs, runs whose
processes are gone, expiry of ended runs); ``resume`` reads back a previous sidecar's runs.
State changes happen under one lock, so readers (exporter, status, enforcer) see a consistent
run; the SQLite writes and action calls they cause are queued in the run's outbox and done
after the lock is released. The jobs live in the modules beside this one:

- ``validation``: what a batch must satisfy before it touches state;
- ``batch``: one batch checked, applied in memory, then answered;
- ``admission``: what a batch's arrival means for its run id (join, register, a new
  incarnation, or a refusal), decided in one pass;
- ``identity``: attestations redeemed and ranks bound to processes;
- ``run_table``: the runs by id, how one enters and leaves;
- ``events``: applying a batch (and the one place a run ends);
- ``incidents``: the findings lifecycle (fire, resolve, restore);
- ``pending``: the outbox of writes and action calls done after the lock;
- ``restart`` and ``status_report``: reading the store back and resuming, rendering ``Status``.

Trust: on the unix socket a run is written only by processes the kernel identified, unless the
operator opted out (``allow_unattested``: logged and exported); ``trainer_uids`` narrows who
may report. A RunStart for an ended run, or from another process of the same uid for a bound
rank, starts a new incarnation: fresh state and sequence numbers, the old one ended
(``superseded``), its firing findings resolved and kept in the journal (their pages held
until the new incarnation proves healthy), its escalations closed and its streams refused.
Live runs that send nothing for ``silent_run_seconds`` end.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import structlog

from ...proto import pb
from .. import detectors
from ..actions.links import DEFAULT_RUNBOOK_URL_PATTERN
from ..detectors.base import Detector, Policy
from ..detectors.frozen import FrozenWeights
from ..model.finding import ActionSink, Finding, LogOnlyActions, RunSnapshot
from ..model.nonces import Attestor
from ..model.process import ProcessIdentity, exited, is_suspended
from ..model.process import state as process_state
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from ..store.journal import Store
from . import restart
from .admission import Decision, Refuse, Register, Rules, closes, decide, owner_of
from .batch import AppliedBatch, CheckedBatch
from .events import CheckpointSink, EventApplier, end_run
from .identity import IdentityGate, Peer, note_collision
from .incidents import RESUME_HOLD_STEPS, FindingLifecycle
from .notices import VerdictNotices
from .run_table import RunEntry, RunTable
from .status_report import status_response
from .validation import (
    MAX_RUN_ID_LENGTH,
    IdentityRejected,
    IngestError,
    forget_run_start_scan,
    remember_run_start,
    run_start_event,
    run_start_of,
    validate,
)

if TYPE_CHECKING:
    from ..model.inspection import CheckpointInspection
    from ..store.history_queue import HistoryQueue

log = structlog.get_logger("deadweight.registry")

#: A run id's past in the journal: per detector its last incident, and its last incarnation.
Numbering = tuple[dict[str, int], int]

#: Actions listed per run in a Status answer (the newest; the journal keeps them all).
MAX_STATUS_ACTIONS = 20

#: Seconds between checks that the registered processes of live runs still exist.
EXIT_CHECK_SECONDS = 5.0
#: A live run that sends nothing (not even a heartbeat) for this long ends as ``silent``.
SILENT_RUN_SECONDS = 3600.0


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
        max_ranks: int = 4096,
        history_queue: HistoryQueue | None = None,
        runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN,
        max_runs_per_process: int = 64,
        max_runs_per_uid: int = 256,
        reclaim_unstepped_seconds: float = 600.0,
    ) -> None:
        self.actions = actions or LogOnlyActions()
        self.store = store or Store()
        self.attestor = attestor
        self.settings = settings or DetectorSettings()
        self.detectors = tuple(active_detectors)
        self.policies = {d.id: d.default_policy for d in self.detectors}
        self.policies.update(policies or {})
        self._lock = threading.RLock()
        self._rules = Rules(attestor is not None, allow_unattested, frozenset(trainer_uids),
                            max_runs, max_ranks, max_runs_per_process, max_runs_per_uid,
                            reclaim_unstepped_seconds)
        self._table = RunTable(self.store, self.actions.forget, max_runs, ended_ttl_seconds)
        self._gate = IdentityGate(self.store, attestor)
        self._events = EventApplier(self.store, history_queue)
        self.notices = VerdictNotices(self.detectors, runbook_url_pattern)
        self._lifecycle = FindingLifecycle(self.detectors, self.settings, self.policies,
                                           self.actions, self.store, resume_hold_steps,
                                           lock=self._lock)
        self._events.judge = self._lifecycle.evaluate
        self.rejected_batches = 0
        self.silent_run_seconds = silent_run_seconds
        #: Refused batches by kind (attestation, identity, capacity, invalid): on /metrics.
        self.refusals: Counter[str] = Counter()
        #: Incarnations started by a rank rebound or a run id used again.
        self.incarnations_started = 0
        if attestor is not None and allow_unattested:
            log.warning("attestation_optional", note="unattested streams on the unix socket "
                        "may register runs; they can be paged and stopped, never signalled")

    @property
    def lock(self) -> threading.RLock:
        """The registry's lock: hold it to read live run state consistently (the exporter)."""
        return self._lock

    @property
    def allow_unattested(self) -> bool:
        return self._rules.allow_unattested

    @property
    def pending_verdicts(self) -> int:
        return self._lifecycle.pending_verdicts

    # -- settings the tests and the exporter read ----------------------------------------

    @property
    def max_runs(self) -> int:
        return self._table.max_runs

    @property
    def trainer_uids(self) -> frozenset[int]:
        """Uids whose attested processes may report (empty: any)."""
        return self._rules.trainer_uids

    @property
    def max_ranks(self) -> int:
        return self._rules.max_ranks

    @property
    def ended_ttl_seconds(self) -> float:
        return self._table.ended_ttl_seconds

    @property
    def resume_hold_steps(self) -> int:
        return self._lifecycle.resume_hold_steps

    @property
    def duplicate_events(self) -> int:
        return self._events.duplicate_events

    @property
    def capacity_refusals(self) -> Counter[tuple[str, str]]:
        """Runs refused for capacity, by (uid, reason: process, uid, table)."""
        return self._table.refused

    @property
    def evicted_live_runs(self) -> int:
        return self._table.evicted_live

    @property
    def steps_refused(self) -> Counter[str]:
        """Step reports not applied, by reason (out_of_order, too_far)."""
        return self._events.steps_refused

    @property
    def watcher(self) -> CheckpointSink | None:
        return self._events.watcher

    @property
    def history_queue(self) -> HistoryQueue | None:
        """Where step and log history waits for its commit (None: written with its batch)."""
        return self._events.history_queue

    # -- ingest ----------------------------------------------------------------------------

    def ingest(self, request: pb.StreamRequest, peer: Peer | None = None) -> pb.StreamResponse:
        """Apply one batch; answer with the ack, directives for this rank, or an error."""
        applied = self.apply(self.check(request), peer or Peer())
        assert applied is not None  # it waited for the lock
        return applied.answer()

    @staticmethod
    def check(request: pb.StreamRequest) -> CheckedBatch:
        """Validate a batch, once, outside the lock (``validation``)."""
        try:
            scanned = validate(request)
            return CheckedBatch(request, scanned, None, run_start_event(request))
        except IngestError as err:
            return CheckedBatch(request, [], err, None)
        finally:  # ``apply`` notes the RunStart again on the thread that applies the batch
            forget_run_start_scan()

    def apply(self, checked: CheckedBatch, peer: Peer, wait: bool = True
              ) -> AppliedBatch | None:
        """The in-memory half of ``ingest``: admit a checked batch, apply it and evaluate its
        run, under the lock. The store writes and action calls this decided stay in the
        run's outbox for ``AppliedBatch.answer``; when there are none the answer is ready at
        once (``AppliedBatch.ready``).

        wait=False: None, with nothing applied, when another thread holds the lock, so that
        the event loop never waits for it (it tries again later). A batch that carries a
        RunStart may read the store here: the event loop sends it to a worker thread."""
        request = checked.request
        if checked.error is not None:
            return AppliedBatch(self, request, peer, (None, None), error=checked.error)
        scanned = checked.scanned
        remember_run_start(request, checked.start)
        entry: RunEntry | None = None
        closed: RunEntry | None = None
        try:
            numbering = self._numbering_if_new(request)
            if not self._lock.acquire(blocking=wait):
                return None
            try:
                self._gate.redeem(request, peer)
                decision = decide(request, peer, self._table, self._rules, time.time())
                closed, entry = self._admit(request, peer, decision, numbering)
                if isinstance(decision, Refuse):
                    return AppliedBatch(self, request, peer, (closed, entry),
                                        error=decision.error)
                assert entry is not None
                if run_start_of(request) is not None or request.run_id not in peer.incarnations:
                    peer.incarnations[request.run_id] = entry.incarnation
                ack = self._events.apply(entry, request, scanned)
                self._lifecycle.evaluate(entry)
                applied = AppliedBatch(self, request, peer, (closed, entry), ack)
                if not applied.pending:  # nothing to write first: answer now, still locked
                    applied.ready = applied.response(entry)
                return applied
            finally:
                self._lock.release()
        except IngestError as err:
            return AppliedBatch(self, request, peer, (closed, entry), error=err)
        finally:
            forget_run_start_scan()

    def _admit(self, request: pb.StreamRequest, peer: Peer, decision: Decision,
               numbering: Numbering | None) -> tuple[RunEntry | None, RunEntry | None]:
        """Carry out admission's decision, under the lock: (the incarnation it closed, if
        any; the batch's run, or for a refusal the run it collided with, if any)."""
        run_id, rank = request.run_id, request.rank
        why = closes(decision)
        closed = self._table.get(run_id) if why else None
        if closed is not None:
            held = self._close_incarnation(closed)
            successor = self._table.succeed(closed, rank)
            successor.inherited_pages = held
            if why == "unattested":
                note_collision(successor, rank, "unattested streams (TCP, or the unix socket "
                               "unattested) reported this rank before this attested "
                               "process; what they sent was dropped with their incarnation")
        for eviction in decision.evict:
            self._table.evict(eviction, owner_of(peer) if eviction.live else None)
        entry = self._table.get(run_id)
        if isinstance(decision, Refuse):
            if decision.counted:
                self._table.count_refusal(decision.owner, decision.reason)
            if decision.collision and entry is not None:
                note_collision(entry, rank, decision.collision)
                self._lifecycle.evaluate(entry)  # run_id_in_use, on the owner's run
                return closed, entry  # its outbox is done with the refusal's answer
            return closed, None
        if isinstance(decision, Register):
            if numbering is None:  # the run expired since the unlocked look: read it now
                numbering = self._numbering(run_id)
            journaled = tuple(e for e in decision.evict if e.journal)
            entry = self._table.register(run_id, rank, *numbering, owner=decision.owner,
                                         evicted=journaled)
        assert entry is not None
        if decision.bind is not None:
            self._gate.bind(entry, rank, decision.bind)
        return closed, entry

    def _close_incarnation(self, old: RunEntry) -> dict[str, Finding]:
        """End old (superseded), resolve its firing findings and end its escalations; all
        of it stays in the journal. Under the lock; the effects go to old's outbox. Returns
        the findings whose pages stay held until the new incarnation proves healthy."""
        now = time.time()
        if not old.state.ended:
            end_run(old, self.store, "superseded", now)
        held = dict(old.inherited_pages)  # a restart that never proved healthy hands on
        for finding in old.findings.values():
            if finding.firing:
                held[finding.detector] = self._lifecycle.resolve(
                    old, finding, "incarnation closed", page=False)
        superseded = getattr(self.actions, "superseded", None)
        if callable(superseded):
            old.outbox.add(functools.partial(superseded, old.state.run_id, old.incarnation))
        self.incarnations_started += 1
        log.warning("run_incarnation_started", run_id=old.state.run_id,
                    incarnation=old.incarnation + 1, previous_step=old.state.step,
                    previous_end=old.state.end_reason)
        return held

    def _numbering_if_new(self, request: pb.StreamRequest) -> Numbering | None:
        """For a batch that may register a run: its past incident numbers and its last
        incarnation (read unlocked)."""
        if self._table.get(request.run_id) is not None or run_start_of(request) is None:
            return None
        return self._numbering(request.run_id)

    def _numbering(self, run_id: str) -> Numbering:
        return self.store.last_incidents(run_id), self.store.last_incarnation(run_id)

    def _flush(self, *entries: RunEntry) -> None:
        """Do the writes and action calls the entries' changes queued (outside the lock)."""
        for entry in entries:
            entry.outbox.flush(functools.partial(self._deliver, entry))

    def _deliver(self, entry: RunEntry, directives: Sequence[pb.Directive]) -> None:
        with self._lock:
            entry.directives.extend(directives)

    # -- the checkpoint watcher --------------------------------------------------------------

    def attach_watcher(self, watcher: CheckpointSink) -> None:
        """Route run output folders and reported checkpoints to watcher."""
        with self._lock:
            self._events.watcher = watcher
            for entry in self._table:
                folder = EventApplier.watched(entry.state)
                if folder:  # restored runs keep their attested uid (checkpoints are its own)
                    uids = [i.uid for i in entry.identities.values()]
                    watcher.watch(entry.state.run_id, folder, owner_uid=min(uids, default=None),
                                  incarnation=entry.incarnation)

    def _life(self, run_id: str, incarnation: int | None, path: str) -> RunEntry | None:
        """The run's entry when it is that life of the run id (None: any), else None: what
        the watcher found for one life never lands on the next (a relaunch under the same
        run id). Under the lock."""
        entry = self._table.get(run_id)
        if entry is not None and incarnation is not None and entry.incarnation != incarnation:
            log.info("checkpoint_of_another_incarnation_ignored", run_id=run_id, path=path,
                     incarnation=incarnation, current=entry.incarnation)
            return None
        return entry

    def record_refusal(self, run_id: str, path: str, reason: str,
                       incarnation: int | None = None) -> bool:
        """A checkpoint path of the run was not read (the watcher's refusal): a finding."""
        with self._lock:
            entry = self._life(run_id, incarnation, path)
            if entry is None:
                return False
            self._events.apply_refusal(entry, path, reason)
            self._lifecycle.evaluate(entry)
        self._flush(entry)
        return True

    def record_inspection(self, run_id: str, inspection: CheckpointInspection,
                          step: int = 0, incarnation: int | None = None) -> bool:
        """Attach what the files of a checkpoint hold to the run (with incarnation: only to
        that life of the run id); False for an unknown run or another life.

        A run that ended owns only the checkpoints it reported: one written later in its
        folder (a copy, another job reusing the output dir) is not its doing and is ignored.
        """
        with self._lock:
            entry = self._life(run_id, incarnation, inspection.path)
            if entry is None:
                return False
            if entry.state.ended and entry.state.checkpoint(inspection.path) is None:
                log.info("checkpoint_after_run_end_ignored", run_id=run_id,
                         path=inspection.path, reason=entry.state.end_reason)
                return False
            self._events.apply_inspection(entry, inspection, step)
            self._lifecycle.evaluate(entry)
        self._flush(entry)
        return True

    # -- time ------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Re-evaluate time-based verdicts and drop ended runs past their TTL, in one go (the
        server ticks run by run: ``tick_started``, ``tick_run``, ``flush``)."""
        now = time.time() if now is None else now
        entries = self.tick_started(now)
        assert entries is not None  # it waited for the lock
        for entry in entries:
            self.tick_run(entry, now)
        self.flush(entries)

    def tick_started(self, now: float, wait: bool = True) -> list[RunEntry] | None:
        """The tick's start: forget ended runs past their TTL, end the silent ones; the runs
        to evaluate (``tick_run``). None, with nothing done, when wait=False and another
        thread holds the lock."""
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            self._table.expire_ended(now)
            for silent in self._table.silent(now, self.silent_run_seconds):
                end_run(silent, self.store, "silent", now)
            return list(self._table)
        finally:
            self._lock.release()

    def tick_run(self, entry: RunEntry, now: float, wait: bool = True) -> bool:
        """One run's part of the tick, under the lock for this run alone: are its processes
        gone, and its detectors at ``now``. A run forgotten or superseded since the tick
        started is left alone. False, with nothing done, when wait=False and another thread
        holds the lock."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if self._table.get(entry.state.run_id) is entry:
                self._check_exits(entry, now)
                self._lifecycle.evaluate(entry, now)
            return True
        finally:
            self._lock.release()

    def flush(self, entries: Sequence[RunEntry]) -> None:
        """Do the writes and action calls the tick queued for entries (outside the lock)."""
        self._flush(*entries)

    def _check_exits(self, entry: RunEntry, now: float) -> None:
        """A run whose every registered process is gone has ended, run end or not; of the
        others, which ranks' processes are stopped (one read of each process's state)."""
        if entry.state.ended or now - entry.exit_checked_at < EXIT_CHECK_SECONDS:
            return
        if not entry.identities:
            return
        entry.exit_checked_at = now
        states = {rank: process_state(identity) for rank, identity in entry.identities.items()}
        if all(exited(letter) for letter in states.values()):
            end_run(entry, self.store, "process_exited", now)
            return
        entry.state.suspended_ranks = frozenset(
            rank for rank, letter in states.items() if is_suspended(letter))

    def mark_ended(self, run_id: str, reason: str, incarnation: int | None = None) -> None:
        """End a run from outside the stream (its processes were killed or are gone); with
        incarnation, only that life of the run id (a later one is not the one killed)."""
        with self._lock:
            entry = self._table.get(run_id)
            if entry is None or entry.state.ended or (
                    incarnation is not None and entry.incarnation != incarnation):
                return
            end_run(entry, self.store, reason, time.time())
            self._lifecycle.evaluate(entry)
        self._flush(entry)

    # -- restart ---------------------------------------------------------------------------

    def resume(self) -> int:
        """Read back the runs, bindings, checkpoints and incidents a previous sidecar left
        (``restart.resume``); the action sink re-asserts firing findings. Returns the number
        of runs restored."""
        restored = restart.resume(self.store, self._table, self._lifecycle, self._lock,
                                  self.silent_run_seconds, self._check_exits)
        self._flush(*restored)
        return len(restored)

    # -- readers ---------------------------------------------------------------------------

    def runs(self) -> list[tuple[RunState, list[Finding]]]:
        """Every run's state and a copy of its findings (for exporter and status)."""
        with self._lock:
            return [(entry.state, [f.copy() for f in entry.findings.values()])
                    for entry in self._table]

    def findings(self, run_id: str) -> dict[str, Finding]:
        with self._lock:
            entry = self._table.get(run_id)
            return {} if entry is None else {k: f.copy() for k, f in entry.findings.items()}

    def run(self, run_id: str) -> RunState | None:
        with self._lock:
            entry = self._table.get(run_id)
            return None if entry is None else entry.state

    def progress(self, run_id: str, incarnation: int | None = None
                 ) -> tuple[int, bool, frozenset[int]] | None:
        """(step, ended, ranks) of a run, read under the lock (for the enforcer's thread);
        with incarnation, None when the run id lives in another one."""
        with self._lock:
            entry = self._table.get(run_id)
            if entry is None or (incarnation is not None and entry.incarnation != incarnation):
                return None
            run = entry.state
            return run.step, run.ended, frozenset(run.ranks)

    def identities(self, run_id: str, incarnation: int | None = None
                   ) -> dict[int, ProcessIdentity]:
        """rank -> bound process of the run (with incarnation: {} for another one)."""
        with self._lock:
            entry = self._table.get(run_id)
            if entry is None or (incarnation is not None and entry.incarnation != incarnation):
                return {}
            return dict(entry.identities)

    def direct(self, run_id: str, directive: pb.Directive, incarnation: int | None = None
               ) -> RunSnapshot | None:
        """Queue directive for every rank of a live run (an operator's STOP); the run then,
        or None when the run is unknown or has ended (with incarnation: or lives in another
        one)."""
        with self._lock:
            entry = self._table.get(run_id)
            if entry is None or entry.state.ended or (
                    incarnation is not None and entry.incarnation != incarnation):
                return None
            entry.directives.append(directive)
            return RunSnapshot.of(entry.state)

    def finding_of(self, run_id: str, detector: str) -> tuple[RunSnapshot, Finding | None] | None:
        """The run and a copy of one detector's finding on it (None: an unknown run)."""
        with self._lock:
            entry = self._table.get(run_id)
            if entry is None:
                return None
            finding = entry.findings.get(detector)
            return entry.snapshot(), None if finding is None else finding.copy()

    def frozen_streak(self, run: RunState) -> int:
        return FrozenWeights.streak(run, self.settings)

    def status(self, run_id: str = "") -> pb.StatusResponse:
        """Every run (or the one named), with the actions journaled for it (read unlocked)."""
        runs = [(run, findings) for run, findings in self.runs()
                if not run_id or run.run_id == run_id]
        actions = {run.run_id: self.store.actions(
            run_id=run.run_id, incarnation=run.incarnation)[-MAX_STATUS_ACTIONS:]
                   for run, _ in runs}
        return status_response(runs, actions, time.time())


__all__ = [
    "EXIT_CHECK_SECONDS",
    "MAX_RUN_ID_LENGTH",
    "RESUME_HOLD_STEPS",
    "AppliedBatch",
    "CheckedBatch",
    "CheckpointSink",
    "IdentityRejected",
    "IngestError",
    "Peer",
    "Registry",
]
