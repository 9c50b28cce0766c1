"""Count the operations that read a device value on the host, on the calling thread.

Each of these waits for the device on an accelerator (a host sync): a scalar read (``.item()``,
``float(t)``, ``bool(t)``: ``aten._local_scalar_dense``), the ops whose result size or answer
depends on the data (``nonzero``, ``equal``, ``is_nonzero``), and a blocking copy from one
device to another (to the host: ``.cpu()``, ``.tolist()`` of a device tensor). A
``TorchDispatchMode`` sees every op dispatched on the thread that entered it (the mode stack is
per thread), so the sender thread's reads, which are designed to wait, are not counted. The
same counter runs on a CPU (where the device path is forced, ``DEADWEIGHT_UPDATE_PATH=device``,
and scalar reads are what it can see) and on a GPU (where cross-device copies show too).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: Ops that hand a device value to the host, whatever their arguments.
READS = frozenset({aten._local_scalar_dense.default, aten.item.default, aten.equal.default,
                   aten.is_nonzero.default, aten.nonzero.default})
#: Copies that read a device value on the host when they cross devices without non_blocking.
COPIES = frozenset({aten.copy_.default, aten._to_copy.default})


def _device_of(value: Any) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


class HostReads(TorchDispatchMode):
    """While entered: ``reads`` counts each host read by op name, ``where`` the label set by
    ``at`` when it happened (which hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        self.label = ""

    def at(self, label: str) -> None:
        """Name the code about to run (its reads are counted under this label)."""
        self.label = label

    def _record(self, name: str) -> None:
        self.reads[name] += 1
        self.where[self.label] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in READS:
            self._record(str(func))
        elif func in COPIES and not kwargs.get("non_blocking", False):
            if func is aten.copy_.default:
                source, target = _device_of(args[1]), _device_of(args[0])
                blocking = len(args) < 3 or not args[2]
            else:
                source, target = _device_of(args[0]), kwargs.get("device")
                blocking = True
            if blocking and source is not None and target is not None and (
                    torch.device(target).type != source.type):
                self._record(f"{func} {source.type}->{torch.device(target).type}")
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.reads.values())
