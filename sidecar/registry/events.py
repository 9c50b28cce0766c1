"""Event application: the only code that changes a run from what a rank sent.

``EventApplier.apply`` walks one batch of one rank: repeated or out-of-order events are
counted and skipped, each new event goes to the handler for its kind. A run ends in one
place, ``end_run``, whether a rank said so, its processes are gone or the enforcer ended it.
Called under the registry lock; store writes go to the run's outbox.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import structlog

from ...proto import pb
from ...proto.kinds import EventKind
from ..detectors import checkpoints
from ..model import limits
from ..model.position import PHASES
from ..model.run_state import CheckpointPoint, RankState, ReplicaSample, RunState
from ..model.step_point import StepPoint
from ..store import history
from ..store.journal import Store
from .run_table import RunEntry
from .validation import IngestError, Scanned

if TYPE_CHECKING:
    from ..model.inspection import CheckpointInspection
    from ..store.history_queue import HistoryQueue

log = structlog.get_logger("deadweight.registry")

#: Steps of a multi-rank run held while not every rank has timed them (``_time_rank``).
RANK_TIMES_HELD = 64


class CheckpointSink(Protocol):
    """Told where a run writes checkpoints and which ones it reported (the watcher).

    Both calls only queue a request: they are made under the registry lock.
    """

    def watch(self, run_id: str, output_dir: str, owner_uid: int | None = None,
              incarnation: int = 1) -> None: ...

    def submit(self, run_id: str, path: str, incarnation: int = 1) -> None: ...


def end_run(entry: RunEntry, store: Store, reason: str, now: float, step: int | None = None
            ) -> None:
    """Mark the run ended (the one place a run ends) and queue the store write."""
    run = entry.state
    run.ended = True
    run.end_reason = reason
    run.ended_at = now
    entry.outbox.add(functools.partial(store.end_run, run.run_id, reason, now,
                                       entry.incarnation))
    for finding in entry.findings.values():
        if finding.firing:  # firing at end: the journal keeps what it showed last
            entry.outbox.add(functools.partial(store.note_evidence, run.run_id,
                                               finding.detector, finding.incidents,
                                               dict(finding.evidence), entry.incarnation))
    log.info("run_ended", run_id=run.run_id, reason=reason,
             step=run.step if step is None else step)


class EventApplier:
    """Applies batches to runs; counts the events it had to skip."""

    def __init__(self, store: Store, history_queue: HistoryQueue | None = None) -> None:
        self.store = store
        #: Where step and log history goes (None: the run's outbox, a commit per batch).
        self.history_queue = history_queue
        self.watcher: CheckpointSink | None = None
        #: Evaluates a run's detectors (the registry's): called at a run end, before it,
        #: so the steps that came with the end in one batch are judged (an ended run's
        #: training is no longer judged).
        self.judge: Callable[[RunEntry], None] | None = None
        self.duplicate_events = 0
        #: Step reports refused, by reason: out_of_order (no newer than the rank's newest,
        #: with a new sequence number), too_far (beyond ``limits.MAX_STEP_JUMP``), negative,
        #: and outlier (applied, then dropped when the reports after it re-anchored the rank).
        self.steps_refused: Counter[str] = Counter()
        #: The batch's step history rows, written in one transaction after it (under the
        #: registry lock, so one list serves every run).
        self._history: list[tuple[int, float, bytes | str]] = []
        #: The batch's log history rows (step, time, figures), written likewise.
        self._logs: list[tuple[int, float, dict[str, float]]] = []
        #: The batch's rank timings (``journal.RANKS``: step, time, figures), likewise.
        self._ranks: list[tuple[int, float, dict[str, float]]] = []
        #: Handlers of the kinds other than steps (``apply`` applies those itself).
        self._handlers: dict[EventKind, Callable[[RunEntry, int, pb.Event, float], None]] = {
            EventKind.RUN_START: self._on_run_start,
            EventKind.LOG: self._on_log,
            EventKind.CHECKPOINT: self._on_checkpoint,
            EventKind.HEARTBEAT: self._on_heartbeat,
            EventKind.RUN_END: self._on_run_end,
            EventKind.REPLICA: self._on_replica,
        }

    def apply(self, entry: RunEntry, request: pb.StreamRequest,
              scanned: Sequence[Scanned]) -> int:
        """Apply one rank's batch (``scanned``: what ``validation.scan`` found in it, event by
        event); returns the rank's highest sequence number (the ack).

        Step reports, nearly every event of a busy run, are applied here without a handler
        lookup each (``_accept``, shared with re-anchoring, is one call: about 0.1 us of the
        10 us a report costs); the other kinds go to their handler."""
        run = entry.state
        if request.rank not in run.ranks:
            if len(run.ranks) >= limits.MAX_RANKS_PER_RUN:
                raise IngestError(f"run already has {limits.MAX_RANKS_PER_RUN} ranks")
            if run.ranks:
                entry.hold_firing()  # a joining rank can move the run's combined steps
        rank_id = request.rank
        rank = run.rank(rank_id)
        now = time.time()
        rank.last_seen = now
        rank.first_seen = rank.first_seen or now
        rank.connected = True
        steps = rank.steps
        newest = steps[-1].step if steps else None  # the rank's newest step, kept up to date
        newest_is_own = self._newest_is_own(run, rank_id)
        from_report = StepPoint.from_report
        try:
            for event, found in zip(request.events, scanned, strict=True):
                seq = event.seq
                if seq:  # seq 0 (a run start) is never a duplicate and moves nothing
                    if seq <= rank.last_seq:
                        self.duplicate_events += 1
                        continue
                    rank.last_seq = seq
                if isinstance(found, bytes):  # a step report, serialized by the scan
                    report = event.step
                    point = from_report(report, now, found)
                    step = point.step
                    if step < 0:
                        self._bad_step(run, rank_id, step, newest or 0, "negative")
                        continue  # no optimizer counts below zero
                    if newest is not None and step <= newest:
                        # A new sequence number with an old step: not a re-send.
                        self.duplicate_events += 1
                        self._bad_step(run, rank_id, step, newest, "out_of_order")
                        held = self._reanchor(entry, rank, rank_id, point, report, found)
                        if not held:
                            continue  # a repeated or out-of-order step changes nothing
                        newest = steps[-1].step if steps else None
                        for point, report, found in held:
                            newest = self._accept(entry, rank, point, report, found, now,
                                                  newest_is_own)
                        continue
                    rank.behind.clear()  # the newest was no outlier: the run went on past it
                    if step > (limits.MAX_FIRST_STEP if newest is None
                               else newest + limits.MAX_STEP_JUMP):
                        self._bad_step(run, rank_id, step, newest or 0, "too_far")
                        continue  # refused: it would make every later step look old
                    newest = self._accept(entry, rank, point, report, found, now, newest_is_own)
                elif found is not None:
                    self._handlers[found](entry, rank_id, event, now)
                    if found is EventKind.RUN_START:  # may make the run sharded
                        newest_is_own = self._newest_is_own(run, rank_id)
        finally:
            self._keep_history(entry)
        return rank.last_seq

    def _accept(self, entry: RunEntry, rank: RankState, point: StepPoint,
                report: pb.StepReport, found: bytes, now: float, newest_is_own: bool) -> int:
        """Apply one step report that moves the rank on; returns the rank's newest step."""
        step = point.step
        rank.steps.append(point)
        rank.step = step
        rank.last_step_time = now
        entry.state.stepped(point)
        if report.HasField("local_seconds"):
            rank.local_seconds.append((step, report.local_seconds))
            if len(entry.state.ranks) > 1:
                self._time_rank(entry, step, report.local_seconds, now)
        if report.HasField("step_seconds"):
            rank.step_seconds.append((step, report.step_seconds))
        if newest_is_own:  # the run's newest combined step is this one
            if step > entry.history_step:
                entry.history_step = step
                self._history.append((step, now, found
                                      if len(found) <= history.MAX_STORED_STEP_BYTES
                                      else history.encode_step(point, report, True)))
        else:
            self._keep_step_history(entry, point, report, found, now)
        return step

    def _time_rank(self, entry: RunEntry, step: int, seconds: float, now: float) -> None:
        """Tally one rank's own seconds of a step (O(1): a count and the two largest); once
        every rank of the run timed it, the step's slowest over its next slowest goes to
        the rank history, what a baseline calibrates ``rank_straggler`` with."""
        tally = entry.rank_times
        count, top, second = tally.get(step, (0, 0.0, 0.0))
        if seconds > top:
            top, second = seconds, top
        elif seconds > second:
            second = seconds
        count += 1
        if count < len(entry.state.ranks):
            tally[step] = (count, top, second)
            if len(tally) > RANK_TIMES_HELD:  # a rank that stopped timing: forget the oldest
                del tally[next(iter(tally))]
            return
        tally.pop(step, None)
        if second > 0:
            self._ranks.append((step, now, {"slowest_over_next": top / second,
                                            "slowest_seconds": top, "next_seconds": second}))

    def _reanchor(self, entry: RunEntry, rank: RankState, rank_id: int, point: StepPoint,
                  report: pb.StepReport, found: bytes,
                  ) -> list[tuple[StepPoint, pb.StepReport, bytes]]:
        """Hold a step report behind the rank's newest; once ``limits.REANCHOR_REPORTS``
        reports in a row go on from below the newest, and they outnumber the points above
        them, those points were an outlier (one absurd step inside the jump bounds, or an
        absurd first step): they are dropped and the held reports returned, to be applied.
        Otherwise returns [] and the report changes nothing."""
        behind = rank.behind
        if behind and point.step <= behind[-1][0].step:
            behind.clear()  # not going on: a counter that repeats itself never re-anchors
        behind.append((point, report, found))
        if len(behind) > limits.STEP_WINDOW_HELD:
            del behind[0]
        first = behind[0][0].step
        outliers = sum(1 for kept in rank.steps if kept.step >= first)
        if len(behind) < limits.REANCHOR_REPORTS or outliers > len(behind):
            return []
        dropped = rank.steps[-1].step
        while rank.steps and rank.steps[-1].step >= first:
            rank.steps.pop()
        base = rank.steps[-1].step if rank.steps else 0
        rank.step = base
        entry.history_step = min(entry.history_step, base)
        held = list(behind)
        behind.clear()
        self._bad_step(entry.state, rank_id, dropped, base, "outlier")
        log.warning("steps_reanchored", run_id=entry.state.run_id, rank=rank_id,
                    dropped_steps=outliers, outlier=dropped, resumed_at=first)
        return held

    def _bad_step(self, run: RunState, rank: int, step: int, newest: int, why: str) -> None:
        """A step report not applied: counted on the run (the ``step_out_of_order`` finding)
        and sidecar-wide (``deadweight_steps_refused_total``)."""
        run.bad_step = (rank, step, newest, why)
        if why != "out_of_order":  # too_far, negative, outlier: absurd numbers, seen at once
            run.steps_too_far += 1
        else:
            run.steps_out_of_order += 1
        self.steps_refused[why] += 1
        if self.steps_refused[why] & (self.steps_refused[why] - 1) == 0:  # 1, 2, 4, ...
            log.warning("step_refused", run_id=run.run_id, rank=rank, step=step,
                        newest=newest, reason=why, count=self.steps_refused[why])

    def _keep_history(self, entry: RunEntry) -> None:
        """Hand the batch's step and log history to the queue (or the run's outbox)."""
        run_id, life, queue = entry.state.run_id, entry.incarnation, self.history_queue
        if self._history:
            if queue is not None:
                queue.add_steps(run_id, self._history, life)
            else:
                entry.outbox.add(functools.partial(self.store.add_step_history, run_id,
                                                   self._history, life))
            self._history = []
        if self._logs:
            if queue is not None:
                queue.add_logs(run_id, self._logs, life)
            else:
                entry.outbox.add(functools.partial(self.store.add_logs, run_id, self._logs,
                                                   life))
            self._logs = []
        if self._ranks:
            if queue is not None:
                queue.add_ranks(run_id, self._ranks, life)
            else:
                entry.outbox.add(functools.partial(self.store.add_rank_history, run_id,
                                                   self._ranks, life))
            self._ranks = []

    @staticmethod
    def _newest_is_own(run: RunState, rank: int) -> bool:
        """Whether each step this rank reports is, once applied, the run's newest combined
        step (``RunState.newest_combined_step``): an unsharded run's lowest rank, or a run
        of one rank. Fixed during a batch but for a RunStart in it (the batch's rank exists
        before its first event)."""
        start = run.start
        ranks = run.ranks
        return (len(ranks) == 1 or start is None or not start.sharded) and rank == min(ranks)

    # -- one handler per kind --------------------------------------------------------------

    def _on_run_start(self, entry: RunEntry, rank: int, event: pb.Event, now: float) -> None:
        run, start = entry.state, event.run_start
        start.trainer = limits.label_value(start.trainer)  # exported as a label
        if entry.leader is None:  # a run resumed after a restart with no rank bound
            entry.leader = rank
        if run.start is None or rank == entry.leader:
            run.start = start
            entry.outbox.add(functools.partial(self.store.upsert_run, run.run_id, run.trainer,
                                               start, entry.incarnation))
        run.rank(rank).membership = start.membership
        if self.watcher is not None and start.output_dir:
            bound = entry.identities.get(rank)
            self.watcher.watch(run.run_id, start.output_dir,
                               owner_uid=bound.uid if bound is not None else None,
                               incarnation=entry.incarnation)

    def _keep_step_history(self, entry: RunEntry, point: StepPoint, report: pb.StepReport,
                           encoded: bytes, now: float) -> None:
        """The newest combined step goes to the report's history once every rank sent it,
        as the report itself (turned into figures when the history is read)."""
        newest = entry.state.newest_combined_step()
        if newest is None or newest.step <= entry.history_step:
            return
        entry.history_step = newest.step
        self._history.append((newest.step, now, history.encode_step(newest, report,
                                                                     newest is point,
                                                                     encoded)))

    def _on_log(self, entry: RunEntry, rank: int, event: pb.Event, now: float) -> None:
        if rank != entry.leader:
            return  # run-wide values: only the rank that started the run sets them
        values = dict(event.log.values)
        entry.state.record_log(event.log.step, values)
        series = history.log_series(values)
        if series:
            self._logs.append((event.log.step, now, series))

    def _on_heartbeat(self, entry: RunEntry, rank_id: int, event: pb.Event, now: float) -> None:
        rank = entry.state.rank(rank_id)
        beat = event.heartbeat
        rank.dropped_events = max(rank.dropped_events, beat.dropped_events)
        if beat.began_step > rank.began_step:
            rank.began_step = beat.began_step
            rank.began_time = now
        if beat.evaluated_batches > rank.evaluated_batches:
            rank.evaluated_batches = beat.evaluated_batches
            rank.evaluated_time = now
        rank.where = beat.where
        if beat.phase in PHASES and math.isfinite(beat.phase_seconds_ago):
            rank.phase = beat.phase
            rank.phase_step = max(0, beat.phase_step)
            rank.phase_pass = max(0, beat.phase_pass)
            # Entered before the heartbeat was made; never before the sidecar heard the rank.
            rank.phase_time = max(now - max(0.0, beat.phase_seconds_ago), rank.first_seen)
            rank.phase_times[PHASES[beat.phase]] = rank.phase_time

    def _on_replica(self, entry: RunEntry, rank_id: int, event: pb.Event, now: float) -> None:
        digest = event.replica
        replicas = entry.state.rank(rank_id).replicas
        if replicas and digest.step <= replicas[-1].step:
            return  # a repeated or older sample changes nothing
        replicas.append(ReplicaSample(digest.step, digest.structure, tuple(digest.names),
                                      tuple(digest.sizes), tuple(digest.values)))

    def _on_run_end(self, entry: RunEntry, rank: int, event: pb.Event, now: float) -> None:
        if rank != entry.leader:  # only the rank that started the run ends it
            log.info("rank_ended", run_id=entry.state.run_id, rank=rank,
                     reason=event.run_end.reason, leader=entry.leader)
            return
        if self.judge is not None and not entry.state.ended:
            self.judge(entry)  # the last steps, often in this very batch
        end_run(entry, self.store, event.run_end.reason or "completed", now,
                step=event.run_end.step)

    def _on_checkpoint(self, entry: RunEntry, rank: int, event: pb.Event, now: float) -> None:
        run, report = entry.state, event.checkpoint
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
        self._add_checkpoint(entry, point)
        checkpoints.judge(run, point)
        if self.watcher is not None:
            self.watcher.submit(run.run_id, report.path, entry.incarnation)

    # -- from the checkpoint watcher -------------------------------------------------------

    def apply_inspection(self, entry: RunEntry, inspection: CheckpointInspection,
                         step: int) -> None:
        """Attach what the files of a checkpoint hold to the run."""
        run = entry.state
        point = run.checkpoint(inspection.path)
        if point is None:
            point = CheckpointPoint(step=step, path=inspection.path,
                                    combined_digest=inspection.adapter_digest,
                                    tensor_digests=dict(inspection.tensor_digests),
                                    adapter_bytes=inspection.tensor_bytes, time=time.time())
            self._add_checkpoint(entry, point)
        point.inspection = inspection
        point.adapter_bytes = inspection.tensor_bytes
        checkpoints.judge(run, point)

    def _add_checkpoint(self, entry: RunEntry, point: CheckpointPoint) -> None:
        run = entry.state
        run.add_checkpoint(point)
        entry.outbox.add(functools.partial(self.store.add_checkpoint, run.run_id, point,
                                           entry.incarnation))

    @staticmethod
    def apply_refusal(entry: RunEntry, path: str, reason: str) -> None:
        """A checkpoint path of the run that the watcher refused to read."""
        entry.state.refused_paths.append((path, reason))
        entry.state.refused_total += 1

    @staticmethod
    def watched(run: RunState) -> str:
        """The output folder of a live run, '' when there is none to watch."""
        if run.start is not None and run.start.output_dir and not run.ended:
            return run.start.output_dir
        return ""
