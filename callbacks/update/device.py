"""The accelerator kernel of the update measurement: multi-tensor ops, no host sync."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernel import FIGURES, flat_snapshot, wide
from .stats import Fence


class DeviceKernel:
    """Multi-tensor ops for accelerators: no per-tensor launch loop and no host sync.

    The figures are computed on the device and copied to pinned host memory without blocking;
    the training thread never waits (see PendingStats). "Changed" is a count of elements with
    sign(old - new) != 0, so there +0.0 and -0.0 count as equal.
    """

    def __init__(self, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        self._buffers, self.snapshot = flat_snapshot(sources)
        self.snapshot_bytes = sum(b.numel() for b in self._buffers)
        parts: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i, src in enumerate(sources):
            parts.setdefault(src.device, {}).setdefault(src.dtype, []).append(i)
        self._devices = [
            (device, torch.tensor([i for idx in by_dtype.values() for i in idx]),
             [(dtype, [sources[i] for i in idx], [self.snapshot[i] for i in idx])
              for dtype, idx in by_dtype.items()])
            for device, by_dtype in parts.items()
        ]
        self._numel = torch.tensor([float(s.numel()) for s in sources], dtype=torch.float64)

    def refresh(self) -> None:
        torch._foreach_copy_(self.snapshot, self._sources)

    def run(self) -> tuple[Callable[[], torch.Tensor], list[Fence]]:
        hosts: list[tuple[torch.Tensor, torch.Tensor]] = []
        fences: list[Fence] = []
        with torch.no_grad():
            for device, rows, parts in self._devices:
                on_device = torch.cat([self._run(*part) for part in parts], dim=1)
                host = torch.empty(on_device.shape, dtype=torch.float64,
                                   pin_memory=device.type == "cuda")
                host.copy_(on_device, non_blocking=True)
                fences.append(Fence(device))
                hosts.append((rows, host))
        return _DeviceFigures(hosts, self._numel, len(self._sources)).finish, fences

    @staticmethod
    def _run(dtype: torch.dtype, srcs: list[torch.Tensor],
             snaps: list[torch.Tensor]) -> torch.Tensor:
        """(3 x tensors) float64 on the device: update L2, weight L2, changed elements."""
        accumulate = wide(dtype)
        torch._foreach_sub_(snaps, srcs)  # snapshot := old - new
        diff_l2 = torch._foreach_norm(snaps, 2, dtype=accumulate)
        weight_l2 = torch._foreach_norm(srcs, 2, dtype=accumulate)
        torch._foreach_sign_(snaps)
        moved = torch._foreach_norm(snaps, 1, dtype=accumulate)  # NaN where a value is not finite
        torch._foreach_copy_(snaps, srcs)  # refreshed for the next step
        return torch.stack([torch.stack(diff_l2).double(), torch.stack(weight_l2).double(),
                            torch.stack(moved).double()])


class _DeviceFigures:
    """Lazily turns the raw (3 x tensors) device rows into the (tensors x FIGURES) figures."""

    def __init__(self, hosts: list[tuple[torch.Tensor, torch.Tensor]], numel: torch.Tensor,
                 count: int) -> None:
        self._hosts = hosts
        self._numel = numel
        self._count = count

    def finish(self) -> torch.Tensor:
        out = torch.zeros(self._count, FIGURES, dtype=torch.float64)
        for rows, host in self._hosts:
            moved = host[2]
            finite = torch.isfinite(host[0]) & torch.isfinite(moved)
            out[rows] = torch.stack([
                host[0].square(), host[1].square(), (moved != 0).double(),
                (~finite).double(), torch.where(finite, self._numel[rows] - moved, 0.0),
            ], dim=1)
        return out

