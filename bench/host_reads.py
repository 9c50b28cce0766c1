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


class HookMeter:
    """While entered, named methods of a class are wrapped: the host reads inside each are
    counted under its name (``reads``, a HostReads the caller enters around the loop), its
    seconds on the calling thread summed, and on CUDA the syncs the device reports counted
    (``torch.cuda.set_sync_debug_mode``: process-wide, so a sender thread's designed wait
    during a hook would count too). The real methods run unchanged; exit restores them."""

    def __init__(self, cls: type, names: tuple[str, ...], reads: HostReads,
                 cuda: bool = False) -> None:
        self.cls, self.names, self.reads, self.cuda = cls, names, reads, cuda
        self.seconds: Counter[str] = Counter()
        self.device_syncs = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HookMeter:
        for name in self.names:
            original = self._saved[name] = self.cls.__dict__[name]
            setattr(self.cls, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(self.cls, name, original)
        self._saved = {}

    def _wrap(self, name: str, fn: Any) -> Any:
        import time
        import warnings

        meter = self

        def measured(*args: Any, **kwargs: Any) -> Any:
            meter.reads.at(name)
            start = time.perf_counter()
            try:
                if not meter.cuda:
                    return fn(*args, **kwargs)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                        meter.device_syncs += sum("synchroniz" in str(w.message).lower()
                                                  for w in caught)
            finally:
                meter.seconds[name] += time.perf_counter() - start
                meter.reads.at("loop")

        return measured
