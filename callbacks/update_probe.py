"""How far the watched tensors moved in one optimizer step, measured with fused ops.

The snapshot is taken at ``on_pre_optimizer_step`` and diffed at ``on_optimizer_step``: grads
are present at both, the weights change only between them. Every figure for a step comes back
in one device-to-host transfer; there is no per-tensor Python loop on the hot path.

"Unchanged" is exact: for finite IEEE values ``new - old == 0`` only when ``new == old``, so a
tensor whose update has an L2 norm of exactly 0 kept every byte (below ~1e-22 per element the
square underflows; no weight a trainer can move moves by less).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: Above this many watched elements, a fixed sample per tensor replaces the full copy.
DEFAULT_MAX_FULL_ELEMENTS = 200_000_000
#: Elements kept per tensor in sampled mode.
DEFAULT_SAMPLE_PER_TENSOR = 4096


@dataclass(frozen=True)
class GroupStats:
    """Summed figures for one group of tensors (an adapter, or a module kind)."""

    name: str
    kind: str
    update_sq_sum: float
    tensors: int
    unchanged_tensors: int


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step did to the watched tensors."""

    update_sq_sum: float
    param_sq_sum: float
    watched_tensors: int
    watched_params: int
    unchanged_tensors: int
    nonfinite_update_tensors: int
    sampled: bool
    groups: list[GroupStats] = field(default_factory=list)


@dataclass(frozen=True)
class TensorGroup:
    """A named set of indices into the watched tensor list."""

    name: str
    kind: str
    indices: list[int]


class UpdateProbe:
    """Snapshot the watched tensors before a step and measure the update after it."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[TensorGroup] = (),
        max_full_elements: int = DEFAULT_MAX_FULL_ELEMENTS,
        sample_per_tensor: int = DEFAULT_SAMPLE_PER_TENSOR,
    ) -> None:
        self.watched_params = sum(t.numel() for t in tensors)
        self.sampled = self.watched_params > max_full_elements
        self._sources = [self._view(t.detach(), sample_per_tensor) for t in tensors]
        self._snapshot = [torch.empty_like(s, memory_format=torch.contiguous_format)
                          for s in self._sources]
        self._groups = list(groups)
        self._ready = False
        self._group_index = self._build_group_index(len(self._sources))

    def _view(self, tensor: torch.Tensor, sample: int) -> torch.Tensor:
        """The whole tensor, or in sampled mode a fixed strided sample of its elements."""
        if not self.sampled or tensor.numel() <= sample:
            return tensor
        flat = tensor.view(-1)
        stride = max(1, flat.numel() // sample)
        return flat[::stride][:sample]

    def _build_group_index(self, n: int) -> torch.Tensor | None:
        """A (groups x tensors) 0/1 matrix so group sums are one matmul, not a Python loop."""
        if not self._groups or n == 0:
            return None
        index = torch.zeros(len(self._groups), n, dtype=torch.float64)
        for row, group in enumerate(self._groups):
            index[row, group.indices] = 1.0
        return index

    def before_step(self) -> None:
        """Copy the watched tensors (called at on_pre_optimizer_step)."""
        if self._sources:
            torch._foreach_copy_(self._snapshot, self._sources)
        self._ready = True

    def after_step(self) -> UpdateStats | None:
        """Measure the update since before_step; None if no snapshot was taken."""
        if not self._ready:
            return None
        self._ready = False
        n = len(self._sources)
        if n == 0:
            return UpdateStats(0.0, 0.0, 0, 0, 0, 0, self.sampled, [])
        with torch.no_grad():
            torch._foreach_sub_(self._snapshot, self._sources)  # snapshot := old - new
            update_norms = torch._foreach_norm(self._snapshot)
            param_norms = torch._foreach_norm(self._sources)
            per_tensor = torch.stack(
                [torch.stack(update_norms).double(), torch.stack(param_norms).double()]
            ).to("cpu")  # the one device-to-host transfer of the step
        update_sq = per_tensor[0].square()
        finite = torch.isfinite(update_sq)
        groups: list[GroupStats] = []
        if self._group_index is not None:
            sums = self._group_index @ torch.where(finite, update_sq, 0.0)
            unchanged = self._group_index @ (per_tensor[0] == 0).double()
            counts = self._group_index.sum(dim=1)
            groups = [
                GroupStats(g.name, g.kind, float(sums[i]), int(counts[i]), int(unchanged[i]))
                for i, g in enumerate(self._groups)
            ]
        return UpdateStats(
            update_sq_sum=float(update_sq[finite].sum()),
            param_sq_sum=float(per_tensor[1].square().sum()),
            watched_tensors=n,
            watched_params=self.watched_params,
            unchanged_tensors=int((per_tensor[0] == 0).sum()),
            nonfinite_update_tensors=int((~finite).sum()),
            sampled=self.sampled,
            groups=groups,
        )
