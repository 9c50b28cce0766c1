"""A fixed sample of the replicated weights, read at a low cadence, for the sidecar to compare.

Under data parallelism every rank holds the same weights; a model never wrapped (each rank
trains on its own data), a rank restored from another checkpoint or a gradient sync that did
not happen leaves each rank's loss looking fine while the replicas train apart. Each rank reads
the same few elements of the same tensors at the same steps (a step schedule, so every rank
samples together); the sidecar compares the ranks. Sharded layouts are never sampled: their
shards differ by design.

Cost: at most ``MAX_TENSORS`` small gathers on the training thread at the sampled steps (the
first few steps, then every ``EVERY_STEPS``); on an accelerator the values are copied to
pinned host memory without waiting, and the sender thread reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Tensors sampled (spread over the watched tensors in their order) and elements per tensor.
MAX_TENSORS = 32
ELEMENTS = 16
#: After the first steps (1, 2, 4, ..., up to this), one sample every this many steps.
EVERY_STEPS = 64


def due(step: int) -> bool:
    """Whether step is a sampled step: 1, 2, 4, ... up to ``EVERY_STEPS``, then its multiples."""
    if step <= 0:
        return False
    if step <= EVERY_STEPS:
        return step & (step - 1) == 0
    return step % EVERY_STEPS == 0


@dataclass(frozen=True)
class ReplicaRecord:
    """One rank's sample at one step; ``values`` may still be on its way from a device."""

    step: int
    structure: str
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    values: torch.Tensor
    ready: torch.cuda.Event | None = None

    def host_values(self) -> list[float]:
        """The sampled values as floats (called on the sender thread)."""
        if self.ready is not None:
            self.ready.synchronize()
        return [float(v) for v in self.values.tolist()]


class ReplicaSampler:
    """The fixed sample of one rank: which tensors and which of their elements."""

    def __init__(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        chosen = _spread(len(tensors), MAX_TENSORS)
        self._tensors = [tensors[i] for i in chosen]
        self.names = tuple(names[i] for i in chosen)
        self._index = [_positions(t) for t in self._tensors]
        self.sizes = tuple(int(i.numel()) for i in self._index)
        shapes = "|".join(f"{n}:{tuple(t.shape)}" for n, t in zip(self.names, self._tensors,
                                                                 strict=True))
        self.structure = hashlib.sha256(shapes.encode()).hexdigest()[:16]

    def sample(self, step: int) -> ReplicaRecord | None:
        """The sample at step (None when there is nothing to sample)."""
        if not self._tensors:
            return None
        with torch.no_grad():
            parts = [t.detach().reshape(-1).index_select(0, i).to(torch.float64)
                     for t, i in zip(self._tensors, self._index, strict=True)]
            values = torch.cat([p.to(parts[0].device) for p in parts])
        ready = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
            values = host
        return ReplicaRecord(step, self.structure, self.names, self.sizes, values, ready)


def _spread(count: int, most: int) -> list[int]:
    """Up to most indices spread evenly over range(count), first and last included."""
    if count <= most:
        return list(range(count))
    return sorted({round(k * (count - 1) / (most - 1)) for k in range(most)})


def _positions(tensor: torch.Tensor) -> torch.Tensor:
    """Up to ``ELEMENTS`` flat positions spread over the tensor, on its device."""
    n = tensor.numel()
    picks = _spread(n, ELEMENTS)
    return torch.tensor(picks, dtype=torch.long, device=tensor.device)
