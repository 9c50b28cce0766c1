"""One optimizer step as one rank measured it (``StepPoint``), and its per-group figures.

Built for every step report the sidecar receives, its hottest path: the scalar figures are
read at once, the groups (one per module kind and adapter) are kept as the report's bytes and
decoded when a detector first asks (``StepGroups``). Every collection is capped: a hostile
client's thousand groups with long names cost no more than these caps allow.
"""

from __future__ import annotations

import math
import operator
import re
import sys
from typing import NamedTuple

from ...proto import pb

#: Adapters kept per optimizer step (a model with more is not a LoRA run this tracks), and
#: the longest adapter name kept: 1024 groups with 4 kB names per step cost 260 MB in 60 steps.
MAX_ADAPTERS_PER_STEP = 64
MAX_GROUP_NAME = 128
#: Module kinds kept per optimizer step (q_proj, lm_head, ...), and the longest dtype text kept.
MAX_MODULE_KINDS_PER_STEP = 64
MAX_DTYPE_TEXT = 64


_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


def module_label(kind: str) -> str:
    """A module kind as the run's stored history names it (and a baseline, from it)."""
    return _SAFE_NAME.sub("_", kind)[:64]


#: One adapter's figures in a step: (name, update_sq_sum, unchanged_tensors, tensors).
AdapterFigures = tuple[str, float, int, int]
#: One module kind's figures in a step: (kind, dtype, elements, unchanged_elements).
ModuleFigures = tuple[str, str, int, int]
#: One module kind's movement in a step: (kind, update_sq_sum, elements, tensors,
#: unchanged_tensors); read by the baseline comparison (which kinds move, and how far).
ModuleUpdate = tuple[str, float, int, int, int]


class StepGroups:
    """A step's per-adapter and per-module-kind figures, read off its report on first use.

    Reading the groups of a LoRA step report (one per module kind and adapter) costs more than
    the rest of the step put together, and most of the steps a rank keeps are never read
    group by group: the detectors that do read the newest few. So a received step keeps its
    report's bytes (which the history needs anyway) and decodes them once, when first asked.
    Groups already known (summed over a sharded run's ranks) are held as they are.
    """

    __slots__ = ("_adapters", "_encoded", "_modules", "_updates")

    def __init__(self, adapters: tuple[AdapterFigures, ...] = (),
                 modules: tuple[ModuleFigures, ...] = (),
                 updates: tuple[ModuleUpdate, ...] = ()) -> None:
        self._encoded: bytes | None = None
        self._adapters = adapters
        self._modules = modules
        self._updates = updates

    @classmethod
    def encoded(cls, report_bytes: bytes) -> StepGroups:
        """The groups of a serialized ``StepReport``, decoded when first read."""
        groups = object.__new__(cls)  # once per step received: no __init__ call
        groups._encoded = report_bytes
        groups._adapters = groups._modules = groups._updates = ()
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

    @property
    def updates(self) -> tuple[ModuleUpdate, ...]:
        if self._encoded is not None:
            self._decode(self._encoded)
        return self._updates

    def _decode(self, encoded: bytes) -> None:
        # Two threads may both decode (the registry lock is not always held by readers): each
        # writes the same figures, and the bytes are dropped only after both are set.
        adapters: list[AdapterFigures] = []
        modules: list[ModuleFigures] = []
        updates: list[ModuleUpdate] = []
        intern = sys.intern
        for group in pb.StepReport.FromString(encoded).groups:
            kind = group.kind
            if kind == "adapter":
                if len(adapters) < MAX_ADAPTERS_PER_STEP:
                    adapters.append((intern(group.name[:MAX_GROUP_NAME]), group.update_sq_sum,
                                     group.unchanged_tensors, group.tensors))
            elif kind == "module" and len(updates) < MAX_MODULE_KINDS_PER_STEP:
                elements = group.elements
                updates.append((intern(group.name[:MAX_GROUP_NAME]), group.update_sq_sum,
                                elements, group.tensors, group.unchanged_tensors))
                if elements > 0:
                    modules.append((intern(group.name[:MAX_GROUP_NAME]),
                                    intern(group.dtype[:MAX_DTYPE_TEXT]), elements,
                                    group.unchanged_elements))
        self._adapters, self._modules = tuple(adapters), tuple(modules)
        self._updates = tuple(updates)
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


#: How ``from_report`` reads a report's figures, in ``StepPoint``'s field order up to
#: ``sampled``: one C call for twelve fields (a third of what a field read each cost).
_read_figures = operator.attrgetter(
    "step", "learning_rate", "update_sq_sum", "param_sq_sum", "watched_tensors",
    "watched_params", "optimizer_params", "unchanged_tensors", "nonfinite_update_tensors",
    "grad_not_in_optimizer_tensors", "grad_not_in_optimizer_params", "sampled")


class StepPoint(NamedTuple):
    """One optimizer step as one rank measured it.

    A named tuple, not a dataclass: built for every step report received, it is one C call
    from the report's figures (``from_report``), and a rank's window of them holds no
    per-step ``__dict__``. Immutable like the frozen dataclass it was.
    """

    step: int
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
    time: float
    #: Per adapter and per module kind, from the step's groups (see StepGroups).
    groups: StepGroups = NO_GROUPS
    #: The optimizer skipped this step (fp16 loss scaling saw inf/NaN gradients).
    skipped: bool = False
    #: AdaLoRA only: whether a rank_pattern had been allocated by this step.
    adalora_allocated: bool | None = None
    #: Sum of squared gradients the step was given (None: not measured, e.g. under sharding).
    grad_sq_sum: float | None = None
    #: Tensors of the modules the user declared frozen, and those moved since train begin.
    declared_frozen_tensors: int = 0
    declared_frozen_moved: int = 0

    @classmethod
    def from_report(cls, report: pb.StepReport, at: float,
                    encoded: bytes | None = None) -> StepPoint:
        """The step a report describes; encoded: the report's bytes, if already serialized.

        Given its bytes, a step keeps them for its groups whether it has any or not (telling
        costs as much as keeping a few bytes); without them, a report with no groups shares
        ``NO_GROUPS`` and one with groups is serialized here.

        Built once per step report received (the sidecar's hottest path): the tuple is made
        from the report's figures read in one call, without the generated ``__new__``'s
        keyword handling. Every field is set here (tests/unit/test_step_point.py checks it).
        """
        if encoded is None:
            groups = StepGroups.encoded(report.SerializeToString()) if report.groups \
                else NO_GROUPS
        else:
            groups = StepGroups.encoded(encoded)
        return tuple.__new__(cls, (*_read_figures(report), at, groups,
                                   report.optimizer_step_skipped,
                                   report.adalora_rank_pattern_set
                                   if report.HasField("adalora_rank_pattern_set") else None,
                                   report.grad_sq_sum if report.grad_measured else None,
                                   report.declared_frozen_tensors,
                                   report.declared_frozen_moved_tensors))

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
