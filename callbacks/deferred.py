"""A device scalar handed to the sender thread unread: the training thread never waits for it.

Reading a tensor's value on the host (``.item()``, ``float(t)``) waits for every kernel queued
before it: on an accelerator, one host sync per read, on the training thread. A loss passed to
``monitor.log``, the fp16 loss scale, a gradient norm: the training thread only queues a copy
into host memory (pinned, non-blocking) and a fence; the sender thread waits on the fence when
it builds the wire event, and reads the host copy. The copy is taken in stream order, so a
tensor the loop changes in place afterwards (a running loss, the scaler's scale) is read as it
was at the call.
"""

from __future__ import annotations

from typing import Any

import torch

from .update.stats import Fence


class DeferredScalar:
    """One scalar on its way to the host; ``float()`` reads it (off the training thread)."""

    __slots__ = ("_fence", "_host")

    def __init__(self, tensor: torch.Tensor) -> None:
        value = tensor.detach().reshape(())
        device = value.device
        if device.type in ("cpu", "cuda"):
            host = torch.empty((), dtype=value.dtype, pin_memory=device.type == "cuda")
            host.copy_(value, non_blocking=True)
        else:  # no pinned memory and no fence here: a copy on the device, read by the sender
            host = value.clone()
        self._host = host
        self._fence = Fence(device)

    def __float__(self) -> float:
        self._fence.wait()
        return float(self._host)

    def __bool__(self) -> bool:
        return float(self) != 0.0

    def done(self) -> bool:
        """The value is on the host (reading it costs no wait)."""
        return self._fence.done()


def defer(value: Any) -> Any:
    """A one-element tensor as a DeferredScalar; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return DeferredScalar(value)
    return value


def resolve(value: Any) -> Any:
    """A DeferredScalar's float (waits for its copy: call it off the training thread);
    anything else as it is."""
    return float(value) if isinstance(value, DeferredScalar) else value
