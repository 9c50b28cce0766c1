"""What one optimizer step did to the watched tensors, and that figure on its way.

``UpdateStats`` (with a ``GroupStats`` per adapter or module kind) is what the probe reports;
``PendingStats`` is one step's figures still being computed (on the probe's own thread on the
CPU, on the device elsewhere), read later and off the training thread. These types need no
kernel, so membership and the wire code import them alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class GroupStats:
    """Summed figures for one group of tensors (an adapter, or a module kind)."""

    name: str
    kind: str
    update_sq_sum: float
    tensors: int
    unchanged_tensors: int
    #: Watched elements (sampled ones in sampled mode) and those whose bytes did not change.
    elements: int = 0
    unchanged_elements: int = 0
    #: The group's dtype(s), e.g. "bfloat16" or "bfloat16,float32".
    dtype: str = ""


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
    #: Watched elements whose bytes did not change (of the sample, in sampled mode).
    unchanged_elements: int = 0


@dataclass(frozen=True)
class TensorGroup:
    """A named set of indices into the watched tensor list."""

    name: str
    kind: str
    indices: list[int]


class Fence:
    """Marks when a device-to-host copy has landed: a CUDA event, or nothing on the host."""

    def __init__(self, device: torch.device) -> None:
        self._event = (torch.cuda.Event() if device.type == "cuda"  # type: ignore[no-untyped-call]
                       else None)
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        """Block the calling thread (never the training thread) until the copy is done."""
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        """The copy has landed (asks the device without waiting for it)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]


class Background:
    """Marks when a CPU kernel running on the probe's own thread has finished."""

    def __init__(self, job: Future[tuple[UpdateStats, list[int]]]) -> None:
        self._job = job

    def wait(self) -> None:
        self._job.result()

    def done(self) -> bool:
        return self._job.done()


class PendingStats:
    """One step's figures on their way, read later and off the training thread.

    On an accelerator the training thread only queues the device work and a non-blocking copy
    into pinned host memory; ``result()`` (called by the sender thread) waits for that copy
    and summarises. Every step gets its own host buffer, so a later step never overwrites an
    unread one. On the CPU the probe's own thread measures and summarises; ``result()`` waits
    for it.
    """

    def __init__(self, read: Callable[[], UpdateStats],
                 fences: Sequence[Fence | Background]) -> None:
        self._read: Callable[[], UpdateStats] | None = read
        self._fences = fences
        self._stats: UpdateStats | None = None
        self._lock = threading.Lock()

    def peek(self) -> UpdateStats | None:
        """The figures if reading them now costs no wait (read already, or their device copy
        or background kernel has finished); else None."""
        if self._stats is None and all(fence.done() for fence in self._fences):
            return self.result()
        return self._stats

    def result(self) -> UpdateStats:
        """The step's figures; waits for the device copy the first time."""
        with self._lock:
            if self._stats is None:
                for fence in self._fences:
                    fence.wait()
                assert self._read is not None
                self._stats = self._read()
                self._read = None
            return self._stats

