"""The contract every update kernel keeps: the figures it returns and the snapshot layout.

A kernel copies the watched tensors into a snapshot (``refresh``) and, after a step, returns
per tensor the ``FIGURES`` columns below (``run``). The native C kernel (``native``), the CPU
torch kernel (``chunked``) and the accelerator kernel (``device``) all keep it, so the probe
can take whichever is fastest for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .stats import Fence

#: Figures per tensor in the output: update sq sum, weight sq sum, bytes differ, non-finite,
#: elements whose bytes are unchanged (the C kernel's ABI has the same columns).
FIGURES = 5
#: Byte alignment of each tensor's slot in the flat snapshot (a cache line).
ALIGN = 64


def flat_snapshot(sources: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Contiguous snapshot views carved from one byte buffer per device."""
    offsets: list[int] = []
    sizes: dict[torch.device, int] = {}
    for src in sources:
        start = -(-sizes.get(src.device, 0) // ALIGN) * ALIGN
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


#: Columns of the per-tensor figures every kernel returns (float64, on the host).
UPDATE_SQ, WEIGHT_SQ, CHANGED, NONFINITE, SAME_ELEMENTS = range(FIGURES)
#: Bytes of source per chunk of the CPU torch kernel: its five ops over a chunk run in the L2
#: cache, so only the first read of each byte comes from memory.
CHUNK_BYTES = 256 * 1024


def int_view(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width, to compare bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def wide(dtype: torch.dtype) -> torch.dtype | None:
    """Accumulation dtype for norms of 16-bit tensors (their own would keep three digits)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else None



class Kernel(Protocol):
    """What UpdateProbe needs from a kernel."""

    snapshot_bytes: int

    def refresh(self) -> None:
        """Copy the sources into the snapshot."""

    def run(self) -> tuple[Callable[[], torch.Tensor], list[Fence]]:
        """Queue the measurement: a reader of the (tensors x FIGURES) figures, to call once
        the fences have passed."""

