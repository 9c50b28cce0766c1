"""What the sidecar knows about one run: its start facts, per-rank steps, logs and checkpoints.

State is plain data, changed only by the registry (``registry.events`` applies wire events,
``registry.restart`` reads a run back from the store) and read by detectors, the exporter and
``deadweight status``. Every collection is bounded: a hostile or buggy client
cannot grow the sidecar's memory without limit.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from deadweight.proto import pb
from deadweight.sidecar.checkpoint_inspector import CheckpointInspection

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
#: Adapters kept per optimizer step (a model with more is not a LoRA run this tracks), and
#: the longest adapter name kept: 1024 groups with 4 kB names per step cost 260 MB in 60 steps.
MAX_ADAPTERS_PER_STEP = 64
MAX_GROUP_NAME = 128
#: Module kinds kept per optimizer step (q_proj, lm_head, ...), and the longest dtype text kept.
MAX_MODULE_KINDS_PER_STEP = 64
MAX_DTYPE_TEXT = 64
#: Refused checkpoint paths remembered per run (the count goes on).
REFUSED_WINDOW = 16


#: One adapter's figures in a step: (name, update_sq_sum, unchanged_tensors, tensors).
AdapterFigures = tuple[str, float, int, int]
#: One module kind's figures in a step: (kind, dtype, elements, unchanged_elements).
ModuleFigures = tuple[str, str, int, int]


class StepGroups:
    """A step's per-adapter and per-module-kind figures, read off its report on first use.

    Reading the groups of a LoRA step report (one per module kind and adapter) costs more than
    the rest of the step put together, and most of the steps a rank keeps are never read
    group by group: the detectors that do read the newest few. So a received step keeps its
    report's bytes (which the history needs anyway) and decodes them once, when first asked.
    Groups already known (summed over a sharded run's ranks) are held as they are.
    """

    __slots__ = ("_adapters", "_encoded", "_modules")

    def __init__(self, adapters: tuple[AdapterFigures, ...] = (),
                 modules: tuple[ModuleFigures, ...] = ()) -> None:
        self._encoded: bytes | None = None
        self._adapters = adapters
        self._modules = modules

    @classmethod
    def encoded(cls, report_bytes: bytes) -> StepGroups:
        """The groups of a serialized ``StepReport``, decoded when first read."""
        groups = cls()
        groups._encoded = report_bytes
        return groups

    @property
    def decoded(self) -> bool:
        """Whether the figures were read off the report (or were never encoded)."""
        return self._encoded is None

    @property
    def adapters(self) -> tuple[AdapterFigures, ...]:
        if self._encoded is not None:
            self._decode(self._encoded)
        return self._adapters

    @property
    def modules(self) -> tuple[ModuleFigures, ...]:
        if self._encoded is not None:
            self._decode(self._encoded)
        return self._modules

    def _decode(self, encoded: bytes) -> None:
        # Two threads may both decode (the registry lock is not always held by readers): each
        # writes the same figures, and the bytes are dropped only after both are set.
        adapters: list[AdapterFigures] = []
        modules: list[ModuleFigures] = []
        intern = sys.intern
        for group in pb.StepReport.FromString(encoded).groups:
            kind = group.kind
            if kind == "adapter":
                if len(adapters) < MAX_ADAPTERS_PER_STEP:
                    adapters.append((intern(group.name[:MAX_GROUP_NAME]), group.update_sq_sum,
                                     group.unchanged_tensors, group.tensors))
            elif kind == "module" and len(modules) < MAX_MODULE_KINDS_PER_STEP:
                elements = group.elements
                if elements > 0:
                    modules.append((intern(group.name[:MAX_GROUP_NAME]),
                                    intern(group.dtype[:MAX_DTYPE_TEXT]), elements,
                                    group.unchanged_elements))
        self._adapters, self._modules = tuple(adapters), tuple(modules)
        self._encoded = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepGroups):
            return NotImplemented
        return (self.adapters, self.modules) == (other.adapters, other.modules)

    def __hash__(self) -> int:
        return hash((self.adapters, self.modules))

    def __repr__(self) -> str:
        return f"StepGroups(adapters={self.adapters!r}, modules={self.modules!r})"


NO_GROUPS = StepGroups()


@dataclass(frozen=True)
class StepPoint:
    """One optimizer step as one rank measured it."""

    step: int
    time: float
    learning_rate: float
    update_sq_sum: float
    param_sq_sum: float
    watched_tensors: int
    watched_params: int
    optimizer_params: int
    unchanged_tensors: int
    nonfinite_update_tensors: int
    grad_not_in_optimizer_tensors: int
    grad_not_in_optimizer_params: int
    sampled: bool
    #: Per adapter and per module kind, from the step's groups (see StepGroups).
    groups: StepGroups = NO_GROUPS
    #: The optimizer skipped this step (fp16 loss scaling saw inf/NaN gradients).
    skipped: bool = False
    #: AdaLoRA only: whether a rank_pattern had been allocated by this step.
    adalora_allocated: bool | None = None

    @classmethod
    def from_report(cls, report: pb.StepReport, at: float,
                    encoded: bytes | None = None) -> StepPoint:
        """The step a report describes; encoded: the report's bytes, if already serialized.

        Built once per step report received (the sidecar's hottest path): the fields go
        straight into the instance, as the generated frozen __init__ would put them, without
        its object.__setattr__ per field (ten times the cost). Every field is set here
        (tests/test_step_point.py checks it).
        """
        point = object.__new__(cls)
        point.__dict__.update(
            step=report.step,
            time=at,
            learning_rate=report.learning_rate,
            update_sq_sum=report.update_sq_sum,
            param_sq_sum=report.param_sq_sum,
            watched_tensors=report.watched_tensors,
            watched_params=report.watched_params,
            optimizer_params=report.optimizer_params,
            unchanged_tensors=report.unchanged_tensors,
            nonfinite_update_tensors=report.nonfinite_update_tensors,
            grad_not_in_optimizer_tensors=report.grad_not_in_optimizer_tensors,
            grad_not_in_optimizer_params=report.grad_not_in_optimizer_params,
            sampled=report.sampled,
            groups=StepGroups.encoded(report.SerializeToString() if encoded is None
                                      else encoded) if report.groups else NO_GROUPS,
            skipped=report.optimizer_step_skipped,
            adalora_allocated=report.adalora_rank_pattern_set
            if report.HasField("adalora_rank_pattern_set") else None,
        )
        return point

    @property
    def adapter_updates(self) -> tuple[AdapterFigures, ...]:
        """Per adapter: (name, update_sq_sum, unchanged_tensors, tensors)."""
        return self.groups.adapters

    @property
    def module_elements(self) -> tuple[ModuleFigures, ...]:
        """Per module kind with elements: (kind, dtype, elements, unchanged_elements)."""
        return self.groups.modules

    @property
    def update_norm(self) -> float:
        return math.sqrt(self.update_sq_sum) if self.update_sq_sum > 0 else 0.0

    @property
    def update_ratio(self) -> float | None:
        """Scale-free update: L2 / (lr * sqrt(n)); 0 when nothing moved, None when lr is 0."""
        if self.update_sq_sum == 0:
            return 0.0
        n = self.optimizer_params or self.watched_params
        if self.learning_rate <= 0 or n <= 0:
            return None
        return self.update_norm / (self.learning_rate * math.sqrt(n))

    @property
    def frozen(self) -> bool:
        """Every watched tensor kept every byte (or nothing is watched at all)."""
        return self.update_sq_sum == 0 and self.nonfinite_update_tensors == 0


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


@dataclass
class RunState:
    """One training run across its ranks."""

    run_id: str
    created: float = field(default_factory=time.time)
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
    ended: bool = False
    end_reason: str = ""
    ended_at: float = 0.0
    #: The registry's clock at the latest evaluation (time-based detectors read it).
    evaluated_at: float = 0.0

    # -- derived views ---------------------------------------------------------------------

    @property
    def trainer(self) -> str:
        return self.start.trainer if self.start is not None else ""

    @property
    def config(self) -> dict[str, float]:
        return dict(self.start.config) if self.start is not None else {}

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
        by_step: dict[int, list[StepPoint]] = {}
        for r in ordered:
            for point in self.ranks[r].steps:
                by_step.setdefault(point.step, []).append(point)
        combined = []
        for step in sorted(by_step):
            points = by_step[step]
            if len(points) < len(ordered):
                continue
            first = points[0]
            combined.append(
                StepPoint(
                    step=step,
                    time=max(p.time for p in points),
                    learning_rate=first.learning_rate,
                    update_sq_sum=sum(p.update_sq_sum for p in points),
                    param_sq_sum=sum(p.param_sq_sum for p in points),
                    watched_tensors=sum(p.watched_tensors for p in points),
                    watched_params=sum(p.watched_params for p in points),
                    optimizer_params=sum(p.optimizer_params for p in points),
                    unchanged_tensors=sum(p.unchanged_tensors for p in points),
                    nonfinite_update_tensors=sum(p.nonfinite_update_tensors for p in points),
                    grad_not_in_optimizer_tensors=sum(
                        p.grad_not_in_optimizer_tensors for p in points
                    ),
                    grad_not_in_optimizer_params=sum(
                        p.grad_not_in_optimizer_params for p in points
                    ),
                    sampled=any(p.sampled for p in points),
                    skipped=any(p.skipped for p in points),
                    adalora_allocated=first.adalora_allocated,
                    groups=StepGroups(modules=_sum_module_elements(points)),
                )
            )
        return combined

    def newest_combined_step(self) -> StepPoint | None:
        """``combined_steps()[-1]`` without building the list (asked for every step received):
        unsharded, the lowest rank's newest step."""
        if not self.ranks:
            return None
        if self.start is None or not self.start.sharded or len(self.ranks) == 1:
            steps = self.ranks[min(self.ranks)].steps
            return steps[-1] if steps else None
        combined = self.combined_steps()
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

    # -- updates ---------------------------------------------------------------------------

    def record_log(self, step: int, values: dict[str, float]) -> None:
        self.log_steps += 1
        for key, value in values.items():
            if key not in self.log_history:
                if len(self.log_history) >= MAX_LOG_KEYS:
                    self.dropped_log_keys += 1
                    continue
                self.log_history[key] = deque(maxlen=LOG_WINDOW)
            self.log_history[key].append((step, value))
            self.logs[key] = value


def _sum_module_elements(points: list[StepPoint]) -> tuple[ModuleFigures, ...]:
    """Each module kind's element counts summed over the ranks' shards (dtype of the first)."""
    summed: dict[str, tuple[str, int, int]] = {}
    for point in points:
        for kind, dtype, elements, unchanged in point.module_elements:
            first, total, still = summed.get(kind, (dtype, 0, 0))
            summed[kind] = (first, total + elements, still + unchanged)
    return tuple((k, d, n, u) for k, (d, n, u) in summed.items())[:MAX_MODULE_KINDS_PER_STEP]
