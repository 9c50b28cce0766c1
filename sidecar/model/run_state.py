"""What the sidecar knows about one run: its start facts, per-rank steps, logs and checkpoints.

State is plain data, changed only by the registry (``registry.events`` applies wire events,
``registry.restart`` reads a run back from the store) and read by detectors, the exporter and
``deadweight status``. Every collection is bounded: a hostile or buggy client
cannot grow the sidecar's memory without limit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ...proto import pb
from .inspection import CheckpointInspection
from .position import AFTER_ALL_PASSES, BEGAN, OPTIMIZER_PHASE, PHASES, Position
from .sharded_steps import ShardedSteps
from .step_point import StepPoint

#: Optimizer steps kept per rank for windowed detectors.
STEP_WINDOW = 256
#: Values kept per log key.
LOG_WINDOW = 256
#: Distinct log keys kept per run; further keys are counted, not stored.
MAX_LOG_KEYS = 512
#: Checkpoints remembered per run.
CHECKPOINT_WINDOW = 64
#: Newest checkpoints of a run that keep their per-tensor digest maps (up to 65536 names
#: each): the newest is compared with the one before it, tensor by tensor.
DIGEST_MAPS_KEPT = 2
#: Refused checkpoint paths remembered per run (the count goes on).
REFUSED_WINDOW = 16
#: Logged steps remembered since the last optimizer step.
UNSTEPPED_WINDOW = 256
#: Per rank: steps whose local seconds are kept, and replica samples kept.
LOCAL_SECONDS_WINDOW = 64
REPLICA_WINDOW = 2


@dataclass(frozen=True)
class ReplicaSample:
    """One rank's sample of its replicated weights at one step (``ReplicaDigest``)."""

    step: int
    structure: str
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    values: tuple[float, ...]


@dataclass
class CheckpointPoint:
    """A checkpoint the run reported (and, later, that the watcher inspected).

    The digest fields come from the callback's in-memory digest; ``inspection`` holds what
    the sidecar found in the files on disk once the folder was complete.
    """

    step: int
    path: str
    combined_digest: str
    tensor_digests: dict[str, str]
    adapter_bytes: int
    time: float
    inspection: CheckpointInspection | None = None
    #: What it equals ("initial" or "previous (step N)"), "" when it differs or is unknown.
    unchanged_from: str = ""
    #: Whether deadweight_checkpoint_unchanged_total already counted this checkpoint.
    counted_unchanged: bool = False

    @property
    def digest(self) -> str:
        """The files' digest once inspected, else the callback's."""
        if self.inspection is not None and self.inspection.adapter_digest:
            return self.inspection.adapter_digest
        return self.combined_digest


@dataclass
class RankState:
    """One rank of a run."""

    rank: int
    last_seq: int = 0
    last_seen: float = 0.0
    #: When this sidecar first heard from the rank (stall clocks start here, not at run start).
    first_seen: float = 0.0
    step: int = 0
    last_step_time: float = 0.0
    dropped_events: int = 0
    membership: pb.OptimizerMembership = field(default_factory=pb.OptimizerMembership)
    steps: deque[StepPoint] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    connected: bool = False
    #: The newest step the rank's loop has begun (heartbeats), and when the sidecar learnt it.
    began_step: int = 0
    began_time: float = 0.0
    #: Where the rank's training thread was at its last heartbeat ("collective": waiting).
    where: str = ""
    #: Evaluation batches the rank has finished (heartbeats), and when the count last grew.
    evaluated_batches: int = 0
    evaluated_time: float = 0.0
    #: The phase of a step the rank last entered (heartbeats; 0: not reported), the step and
    #: micro-batch it belongs to, and when the rank entered it (the sidecar's clock).
    phase: int = 0
    phase_step: int = 0
    phase_pass: int = 0
    phase_time: float = 0.0
    #: Per phase name: when the rank last entered it, as far as the sidecar heard.
    phase_times: dict[str, float] = field(default_factory=dict)
    #: (step, seconds of the rank's own work before its last forward ended), newest last.
    local_seconds: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=LOCAL_SECONDS_WINDOW))
    #: (step, seconds since the rank's previous optimizer step ended), newest last.
    step_seconds: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=LOCAL_SECONDS_WINDOW))
    #: The rank's newest replica samples, newest last.
    replicas: deque[ReplicaSample] = field(default_factory=lambda: deque(maxlen=REPLICA_WINDOW))
    #: Step reports held back, each behind ``step`` and newer than the one before (with their
    #: report and its encoding): enough of them re-anchor the rank (``limits.REANCHOR_REPORTS``).
    behind: list[tuple[StepPoint, pb.StepReport, bytes]] = field(default_factory=list)

    @property
    def progress(self) -> int:
        """The furthest the rank got: its last optimizer step, or the step it began."""
        return max(self.step, self.began_step)

    @property
    def progress_time(self) -> float:
        """When the sidecar last saw the rank advance (0: never): its last step, or when it
        learnt of a step begun past it (a heartbeat's news of a step already done is older
        than that step's own report)."""
        return self.began_time if self.began_step > self.step else self.last_step_time

    @property
    def position(self) -> Position:
        """The furthest mark the rank reported: a phase inside a step (heartbeats), the step
        it began, or its last optimizer step; on a tie the phase's own time wins (it says
        when the rank got there, not when the sidecar heard of it)."""
        found: list[Position] = []
        if self.phase in PHASES:
            micro = AFTER_ALL_PASSES if self.phase == OPTIMIZER_PHASE else self.phase_pass
            found.append(Position((self.phase_step, micro, self.phase), self.phase_step,
                                  PHASES[self.phase], self.phase_time))
        found.append(Position((self.step, AFTER_ALL_PASSES, OPTIMIZER_PHASE), self.step,
                              "optimizer_step", self.last_step_time))
        if self.began_step > self.step:
            found.append(Position((self.began_step, 0, 0), self.began_step, BEGAN,
                                  self.began_time))
        return max(found, key=lambda p: p.key)  # the first of equal keys


@dataclass
class RunState:
    """One training run across its ranks."""

    run_id: str
    created: float = field(default_factory=time.time)
    #: Which life of the run id this is (``RunEntry.incarnation``; the journal keys by it).
    incarnation: int = 1
    start: pb.RunStart | None = None
    ranks: dict[int, RankState] = field(default_factory=dict)
    logs: dict[str, float] = field(default_factory=dict)
    log_history: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    log_steps: int = 0
    dropped_log_keys: int = 0
    checkpoints: deque[CheckpointPoint] = field(
        default_factory=lambda: deque(maxlen=CHECKPOINT_WINDOW)
    )
    checkpoints_total: int = 0
    checkpoints_unchanged: int = 0
    #: Client-named checkpoint paths the sidecar refused to read: (path, reason), latest last.
    refused_paths: deque[tuple[str, str]] = field(
        default_factory=lambda: deque(maxlen=REFUSED_WINDOW))
    refused_total: int = 0
    #: Step reports not applied because their step was no newer than the rank's newest (a
    #: new sequence number, so no re-send) or too far beyond it: (rank, step, newest, why)
    #: of the latest, and how many of each.
    bad_step: tuple[int, int, int, str] | None = None
    steps_out_of_order: int = 0
    steps_too_far: int = 0
    #: Other processes (or unattested streams) that tried to register a rank of this run
    #: while it was someone else's: how many RunStarts, and who the latest was.
    collisions: int = 0
    collision: str = ""
    #: Ranks whose registered process is stopped (SIGSTOP), as of the last exit check: a
    #: suspended job is silent without being gone or hung.
    suspended_ranks: frozenset[int] = frozenset()
    ended: bool = False
    end_reason: str = ""
    ended_at: float = 0.0
    #: The registry's clock at the latest evaluation (time-based detectors read it).
    evaluated_at: float = 0.0
    #: Log keys whose history is not in step order (a log went back): ``logged_at`` scans
    #: them instead of bisecting.
    unordered_log_keys: set[str] = field(default_factory=set)
    #: Logged steps received since the last optimizer step (bounded), and the most log
    #: reports seen between two optimizer steps so far (a loop that logs micro-batches).
    unstepped_logs: deque[int] = field(default_factory=lambda: deque(maxlen=UNSTEPPED_WINDOW))
    most_logs_between_steps: int = 0
    #: The highest learning rate of any optimizer step applied, and the first step applied (0:
    #: none yet): the step window forgets a long run's peak, a decaying schedule's tail is
    #: judged against it.
    peak_learning_rate: float = 0.0
    first_applied_step: int = 0
    _config: tuple[pb.RunStart, Mapping[str, float]] | None = field(
        default=None, repr=False, compare=False)
    _sharded: ShardedSteps | None = field(default=None, repr=False, compare=False)
    #: The frozen-weights streak as of the newest combined step, with what it was counted
    #: from ((newest step, ranks), settings): every /metrics scrape asks for it, a new step
    #: is what changes it.
    frozen_streak_memo: tuple[tuple[int, int], object, int] | None = field(
        default=None, repr=False, compare=False)
    #: The replica comparison of the newest common sample step, kept with the samples it
    #: compared: samples come every 64 steps, detectors run at every batch.
    replica_comparison: tuple[float, tuple[ReplicaSample, ...], object] | None = field(
        default=None, repr=False, compare=False)

    # -- derived views ---------------------------------------------------------------------

    @property
    def trainer(self) -> str:
        return self.start.trainer if self.start is not None else ""

    @property
    def config(self) -> Mapping[str, float]:
        """The RunStart's config, read off the message once per RunStart (detectors ask for
        it many times a batch)."""
        start = self.start
        if start is None:
            return _NO_CONFIG
        cached = self._config
        if cached is None or cached[0] is not start:
            cached = self._config = (start, MappingProxyType(dict(start.config)))
        return cached[1]

    @property
    def step(self) -> int:
        return max((r.step for r in self.ranks.values()), default=0)

    @property
    def last_seen(self) -> float:
        return max((r.last_seen for r in self.ranks.values()), default=self.created)

    def rank(self, rank: int) -> RankState:
        if rank not in self.ranks:
            self.ranks[rank] = RankState(rank)
        return self.ranks[rank]

    def combined_steps(self) -> list[StepPoint]:
        """Per optimizer step, one figure for the whole run.

        Replicated parameters (DDP) are identical on every rank: the lowest rank stands for
        all, so nothing is counted twice. Sharded parameters (FSDP, ZeRO-3) are split: squares
        are summed over ranks, for steps every rank has reported.
        """
        if not self.ranks:
            return []
        ordered = sorted(self.ranks)
        if self.start is None or not self.start.sharded or len(ordered) == 1:
            return list(self.ranks[ordered[0]].steps)
        return list(self._sharded_steps(ordered))

    def _sharded_steps(self, ordered: list[int]) -> deque[StepPoint]:
        """The combined steps of a sharded run of several ranks, kept between asks (see
        ``sharded_steps``; a new set of ranks starts them afresh)."""
        kept = self._sharded
        if kept is None or kept.ranks != tuple(ordered):
            kept = self._sharded = ShardedSteps(tuple(ordered))
        return kept.steps(self.ranks)

    def newest_combined_step(self) -> StepPoint | None:
        """``combined_steps()[-1]`` without building the list (asked for every step received):
        unsharded, the lowest rank's newest step."""
        if not self.ranks:
            return None
        if self.start is None or not self.start.sharded or len(self.ranks) == 1:
            steps = self.ranks[min(self.ranks)].steps
            return steps[-1] if steps else None
        combined = self._sharded_steps(sorted(self.ranks))
        return combined[-1] if combined else None

    def add_checkpoint(self, point: CheckpointPoint) -> None:
        """Remember a new checkpoint; the total is a counter, the window is bounded."""
        self.checkpoints.append(point)
        self.checkpoints_total += 1
        for older in list(self.checkpoints)[:-DIGEST_MAPS_KEPT]:
            if older.tensor_digests:
                older.tensor_digests = {}
            if older.inspection is not None and older.inspection.tensor_digests:
                older.inspection = dataclasses.replace(older.inspection, tensor_digests={})

    def checkpoint(self, path: str) -> CheckpointPoint | None:
        """The remembered checkpoint at path, if any."""
        for point in self.checkpoints:
            if point.path == path:
                return point
        return None

    def log_value(self, key: str) -> float | None:
        return self.logs.get(key)

    def history(self, key: str) -> list[tuple[int, float]]:
        return list(self.log_history.get(key, ()))

    def last_logged(self, key: str) -> tuple[int, float] | None:
        """The newest (step, value) logged for key, without copying its history."""
        entries = self.log_history.get(key)
        return entries[-1] if entries else None

    def logged_at(self, key: str, step: int) -> float | None:
        """The last finite value logged for key at step, or None.

        Detectors ask this for the few newest steps at every batch: a bisection of the
        history (a trainer logs in step order), where a map of the whole window per batch
        cost more than the rest of their work; a key logged out of order is scanned."""
        entries = self.log_history.get(key)
        if not entries:
            return None
        if key in self.unordered_log_keys:
            found = [v for s, v in entries if s == step and math.isfinite(v)]
            return found[-1] if found else None
        index = bisect_right(entries, step, key=_logged_step) - 1
        while index >= 0 and entries[index][0] == step:
            if math.isfinite(value := entries[index][1]):
                return value
            index -= 1
        return None

    # -- updates ---------------------------------------------------------------------------

    def stepped(self, point: StepPoint) -> None:
        """An optimizer step arrived: the logs before it were not left unstepped."""
        if math.isfinite(point.learning_rate):
            self.peak_learning_rate = max(self.peak_learning_rate, point.learning_rate)
        if not self.first_applied_step:
            self.first_applied_step = point.step
        unstepped = self.unstepped_logs
        if unstepped:
            self.most_logs_between_steps = max(self.most_logs_between_steps, len(unstepped))
            unstepped.clear()

    def record_log(self, step: int, values: dict[str, float]) -> None:
        self.log_steps += 1
        self.unstepped_logs.append(step)
        for key, value in values.items():
            if key not in self.log_history:
                if len(self.log_history) >= MAX_LOG_KEYS:
                    self.dropped_log_keys += 1
                    continue
                self.log_history[key] = deque(maxlen=LOG_WINDOW)
            entries = self.log_history[key]
            if entries and step < entries[-1][0]:
                self.unordered_log_keys.add(key)
            entries.append((step, value))
            self.logs[key] = value


_NO_CONFIG: Mapping[str, float] = MappingProxyType({})


def _logged_step(entry: tuple[int, float]) -> int:
    return entry[0]
