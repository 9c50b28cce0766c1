"""How far the watched tensors moved in one optimizer step, in one pass over memory.

The snapshot lives in one flat buffer per device. ``after_step`` reads the new weights and the
snapshot once, returns every figure of the step in one device-to-host transfer, and writes the
new weights into the snapshot in the same pass, so the snapshot is already fresh for the next
step. ``before_step`` (at ``on_pre_optimizer_step``) copies only when something wrote the
weights since that refresh: the tensors' version counters, bumped by every in-place write
(optimizers, ``copy_``, ``load_state_dict``), tell it. Writes through ``.data`` bypass the
counters; such a write between two steps is counted in the next step's update.

Two kernels compute the same figures; ``path="auto"`` takes the fastest one for the device:
``native`` (CPU, the default there) is a compiled C loop that does everything in one pass;
``torch`` (any device, the CUDA path) uses ``torch._foreach_*`` ops: no per-tensor kernel
launch loop and one host sync. "Unchanged" is exact, never a norm (a square underflows): the
native kernel and the CPU torch fallback compare bytes, the accelerator path tests the largest
absolute difference, so there +0.0 and -0.0 count as equal. A tensor holding a non-finite value
is counted as non-finite, never as unchanged.

Sampled mode (full fine-tuning, above ``max_full_elements``): each tensor contributes a fixed
sample of ``sample_per_tensor`` elements in evenly spaced contiguous runs, so the snapshot
stays small whatever the model size. Figures then cover the sample (``UpdateStats.sampled``):
"unchanged" means the sampled elements kept their bytes. On CUDA the sample views are not
dense, so the multi-tensor ops fall back to one launch per tensor there.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import update_native

#: Above this many watched elements, a fixed sample per tensor replaces the full copy.
DEFAULT_MAX_FULL_ELEMENTS = 200_000_000
#: Elements kept per tensor in sampled mode.
DEFAULT_SAMPLE_PER_TENSOR = 4096
#: Byte alignment of each tensor's slot in the flat snapshot (a cache line).
_ALIGN = 64

Path = Literal["auto", "native", "torch"]
_version = operator.attrgetter("_version")
_data_ptr = operator.methodcaller("data_ptr")


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


def _flat_snapshot(sources: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Contiguous snapshot views carved from one byte buffer per device."""
    offsets: list[int] = []
    sizes: dict[torch.device, int] = {}
    for src in sources:
        start = -(-sizes.get(src.device, 0) // _ALIGN) * _ALIGN
        offsets.append(start)
        sizes[src.device] = start + src.numel() * src.element_size()
    buffers = {dev: torch.empty(max(size, 1), dtype=torch.uint8, device=dev)
               for dev, size in sizes.items()}
    views = [
        buffers[src.device][off:off + src.numel() * src.element_size()]
        .view(src.dtype).view(src.shape)
        for src, off in zip(sources, offsets, strict=True)
    ]
    return list(buffers.values()), views


class _TorchPass:
    """Multi-tensor ops: no per-tensor kernel launch, one host transfer per device.

    On an accelerator the exact "changed" test is the largest absolute difference, computed
    with the norms and brought to the host in the same transfer. On CPU (``host_check``), where
    that reduction is slow and a host sync is free, a norm of 0 is re-checked on the bytes.
    """

    def __init__(self, sources: list[torch.Tensor], snapshots: list[torch.Tensor],
                 host_check: bool | None = None) -> None:
        parts: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i, src in enumerate(sources):
            parts.setdefault(src.device, {}).setdefault(src.dtype, []).append(i)
        self._devices = [
            (device, torch.tensor([i for idx in by_dtype.values() for i in idx]),
             [(dtype, [sources[i] for i in idx], [snapshots[i] for i in idx])
              for dtype, idx in by_dtype.items()])
            for device, by_dtype in parts.items()
        ]
        self._host_check = host_check
        self._count = len(sources)
        self._scratch: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def run(self) -> torch.Tensor:
        """(tensors x 4) float64 on the host: update sq, weight sq, changed, non-finite."""
        out = torch.zeros(self._count, update_native.FIGURES, dtype=torch.float64)
        with torch.no_grad():
            for device, rows, parts in self._devices:
                host_check = (device.type == "cpu" if self._host_check is None
                              else self._host_check)
                if host_check:
                    out[rows] = torch.cat([self._run_cpu(*part) for part in parts])
                    continue
                on_device = torch.cat([self._run_device(*part) for part in parts], dim=1)
                host = on_device.to("cpu")  # the one device-to-host transfer
                out[rows] = torch.stack([
                    host[0].square(), host[1].square(), (host[2] != 0).double(),
                    (~torch.isfinite(host[2])).double(),
                ], dim=1)
        return out

    @staticmethod
    def _run_device(dtype: torch.dtype, srcs: list[torch.Tensor],
                    snaps: list[torch.Tensor]) -> torch.Tensor:
        """(3 x tensors) float64 on the device: update L2, weight L2, largest |update|."""
        wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else None
        torch._foreach_sub_(snaps, srcs)  # snapshot := old - new
        diff_l2 = torch._foreach_norm(snaps, 2, dtype=wide)
        weight_l2 = torch._foreach_norm(srcs, 2, dtype=wide)
        diff_max = torch._foreach_norm(snaps, float("inf"))  # 0 only if every element is equal
        torch._foreach_copy_(snaps, srcs)  # refreshed for the next step
        return torch.stack([
            torch.stack(diff_l2).double(), torch.stack(weight_l2).double(),
            torch.stack(diff_max).double(),
        ])

    def _run_cpu(self, dtype: torch.dtype, srcs: list[torch.Tensor],
                 snaps: list[torch.Tensor]) -> torch.Tensor:
        """(tensors x 4): a norm of 0 (or NaN) is re-checked on the bytes before the refresh.

        A squared norm underflows and 16-bit CPU arithmetic flushes subnormals, so "changed"
        from the norm is certain but "unchanged" is not; only those tensors pay the compare.
        The difference goes to a scratch buffer kept across steps: allocating it every step
        costs more than the arithmetic (fresh pages fault in).
        """
        key = id(srcs)
        if key not in self._scratch:
            self._scratch[key] = _flat_snapshot(srcs)
        diffs = self._scratch[key][1]
        torch._foreach_copy_(diffs, srcs)
        torch._foreach_sub_(diffs, snaps)
        diff_l2 = torch.stack(torch._foreach_norm(diffs)).double()
        weight_l2 = torch.stack(torch._foreach_norm(srcs)).double()
        changed = (diff_l2 > 0).double()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            torch.empty(0, dtype=dtype).element_size()]
        for i in torch.nonzero(changed == 0).flatten().tolist():
            same = torch.equal(srcs[i].view(bits), snaps[i].view(bits))
            changed[i] = 0.0 if same else 1.0
        nonfinite = ~torch.isfinite(diff_l2)
        torch._foreach_copy_(snaps, srcs)  # refreshed for the next step
        return torch.stack([diff_l2.square(), weight_l2.square(), changed,
                            nonfinite.double()], dim=1)


def _native_pass(sources: list[torch.Tensor],
                 snapshots: list[torch.Tensor]) -> update_native.NativePass | None:
    """The compiled CPU kernel when every tensor suits it and a compiler is available."""
    if not sources or not update_native.NativePass.supports(sources):
        return None
    lib = update_native.load()
    return None if lib is None else update_native.NativePass(lib, sources, snapshots)


def _sample_runs(sample: int) -> int:
    """How many runs a sample is cut into: its largest divisor up to 64, or single elements
    when it has no divisor of 8 or more (a prime, say)."""
    best = max(d for d in range(1, min(64, sample) + 1) if sample % d == 0)
    return best if best >= 8 else sample


class UpdateProbe:
    """Snapshot the watched tensors before a step and measure the update after it."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[TensorGroup] = (),
        max_full_elements: int = DEFAULT_MAX_FULL_ELEMENTS,
        sample_per_tensor: int = DEFAULT_SAMPLE_PER_TENSOR,
        path: Path = "auto",
    ) -> None:
        self.watched_params = sum(t.numel() for t in tensors)
        self.sampled = self.watched_params > max_full_elements
        self._tensors = list(tensors)
        self._sample = sample_per_tensor
        self._path = path
        self._groups = list(groups)
        self._ready = False
        self._group_index = self._build_group_index(len(self._tensors))
        self._bind()

    def _bind(self) -> None:
        """Alias the tensors' current storage and lay out the snapshot and the kernel.

        Runs again if a tensor's storage is replaced (``param.data = ...``, a device move):
        the old aliases would otherwise keep measuring memory the model no longer uses.
        """
        self._storage = list(map(_data_ptr, self._tensors))
        self._sources = [self._view(t.detach(), self._sample) for t in self._tensors]
        self._buffers, self._snapshot = _flat_snapshot(self._sources)
        self._valid_at: list[int] | None = None  # versions at which snapshot == weights
        native = None if self._path == "torch" else _native_pass(self._sources, self._snapshot)
        if self._path == "native" and native is None:
            raise RuntimeError("the native update kernel is unavailable for these tensors")
        self._kernel: update_native.NativePass | _TorchPass = (
            native if native is not None else _TorchPass(self._sources, self._snapshot)
        )
        self.path: str = "native" if native is not None else "torch"

    @property
    def snapshot_bytes(self) -> int:
        """Memory held by the snapshot."""
        return sum(b.numel() for b in self._buffers)

    def _view(self, tensor: torch.Tensor, sample: int) -> torch.Tensor:
        """The whole tensor, or in sampled mode a fixed sample of exactly ``sample`` elements.

        The sample is evenly spaced contiguous runs (a view, no copy): reading 4096 scattered
        elements costs a cache line and often a page walk each, runs of 64 cost one per run.
        """
        n = tensor.numel()
        if not self.sampled or n <= sample or not tensor.is_contiguous():
            return tensor
        runs = _sample_runs(sample)
        length = sample // runs
        gap = (n - length) // max(runs - 1, 1)
        return tensor.view(-1).as_strided((runs, length), (gap, 1))

    def _build_group_index(self, n: int) -> torch.Tensor:
        """A (1 + groups) x tensors 0/1 matrix: row 0 is every tensor, then one row per group,
        so totals and group sums come from one matmul, not a Python loop."""
        index = torch.zeros(1 + len(self._groups), n, dtype=torch.float64)
        index[0] = 1.0
        for row, group in enumerate(self._groups, start=1):
            index[row, group.indices] = 1.0
        self._group_sizes = [int(c) for c in index.sum(dim=1).tolist()[1:]]
        return index

    def before_step(self) -> None:
        """Make sure the snapshot holds the weights (called at on_pre_optimizer_step).

        After a measured step the snapshot is already fresh; it is copied again only when a
        version counter shows that something wrote a watched tensor since.
        """
        if list(map(_data_ptr, self._tensors)) != self._storage:
            self._bind()
        if self._sources and self._valid_at != list(map(_version, self._sources)):
            with torch.no_grad():
                torch._foreach_copy_(self._snapshot, self._sources)
            self._valid_at = list(map(_version, self._sources))
        self._ready = True

    def after_step(self) -> UpdateStats | None:
        """Measure the update since before_step; None if no snapshot was taken."""
        if not self._ready:
            return None
        self._ready = False
        n = len(self._sources)
        if n == 0:
            return UpdateStats(0.0, 0.0, 0, 0, 0, 0, self.sampled, [])
        figures = self._kernel.run()  # also refreshes the snapshot
        self._valid_at = list(map(_version, self._sources))
        return self._summarise(figures)

    def _summarise(self, figures: torch.Tensor) -> UpdateStats:
        """Totals and group sums from the per-tensor figures (already on the host)."""
        nonfinite = figures[:, 3] != 0
        columns = torch.stack([
            # update sq of finite tensors only (a NaN would poison every row of the matmul)
            torch.where(nonfinite | ~torch.isfinite(figures[:, 0]), 0.0, figures[:, 0]),
            figures[:, 1],
            ((figures[:, 2] == 0) & ~nonfinite).double(),  # unchanged
            nonfinite.double(),
        ], dim=1)
        sums = (self._group_index @ columns).tolist()
        total = sums[0]
        groups = [
            GroupStats(g.name, g.kind, row[0], size, int(row[2]))
            for g, row, size in zip(self._groups, sums[1:], self._group_sizes, strict=True)
        ]
        return UpdateStats(
            update_sq_sum=total[0],
            param_sq_sum=total[1],
            watched_tensors=len(self._sources),
            watched_params=self.watched_params,
            unchanged_tensors=int(total[2]),
            nonfinite_update_tensors=int(total[3]),
            sampled=self.sampled,
            groups=groups,
        )
