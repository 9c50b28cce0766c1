"""The one-pass CPU kernel of the update measurement, built at install time.

Eager torch needs several passes over the weights (copy, subtract, norms, compare); on CPU that
costs a multiple of the memory-bandwidth bound. The kernel (``_update_kernel.c``, compiled by the
build backend into ``deadweight/callbacks/update/_update_kernel*.so``) reads the new weights and the
snapshot once, accumulates the squared update and squared weights in float64, counts the
elements whose bytes did not change, flags non-finite values, and writes the new weights into
the snapshot in the same loop, so the snapshot is already refreshed for the next step.

Nothing is compiled where the job runs. The library is loaded with ctypes; when the install
carries no kernel (built without a compiler, a foreign platform) or ``DEADWEIGHT_NATIVE=0``,
``load()`` returns None and the caller uses the torch path. ``describe()`` says which.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from collections.abc import Callable

import torch

from .kernel import FIGURES, flat_snapshot
from .stats import Fence

#: dtype codes understood by the kernel.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}
#: The layout version ``dw_abi()`` must return (bumped with FIGURES or the argument list).
ABI = 2
#: The extension module that holds the kernel.
MODULE = "deadweight.callbacks.update._update_kernel"

_lock = threading.Lock()
_state: dict[str, object] = {}


def library_path() -> str | None:
    """Where the installed kernel lies, or None when the install carries none."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


def _open(path: str) -> ctypes.CDLL | None:
    """Load the library and declare the kernel's signature; None if it does not load or speaks
    another layout version."""
    try:
        lib = ctypes.CDLL(path)
        lib.dw_abi.restype = ctypes.c_int64
        lib.dw_abi.argtypes = []
        if lib.dw_abi() != ABI:
            return None
        lib.dw_update.restype = None
        lib.dw_update.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 7]
    except (OSError, AttributeError):
        return None
    return lib


def _why_not() -> str | None:
    """Why the native kernel cannot run here, or None when it may."""
    if os.environ.get("DEADWEIGHT_NATIVE", "1") == "0":
        return "DEADWEIGHT_NATIVE=0"
    if sys.byteorder != "little":
        return "big-endian host"
    if library_path() is None:
        return "this install carries no native kernel (built without a C compiler)"
    return None


def load() -> ctypes.CDLL | None:
    """The installed kernel, loaded once; None when it is absent, switched off or unloadable."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        reason = _why_not()
        lib = None
        if reason is None:
            path = library_path()
            lib = _open(path) if path else None
            if lib is None:
                reason = f"the native kernel at {path} does not load"
        _state["lib"] = lib
        _state["reason"] = reason
        return lib


def reset() -> None:
    """Forget the loaded kernel, so the next ``load()`` looks again (tests flip the switch)."""
    with _lock:
        _state.clear()


def describe() -> str:
    """One line saying which kernel measures the update on CPU, and why."""
    lib = load()
    if lib is not None:
        return f"native (installed C kernel {library_path()})"
    return f"torch ({_state.get('reason')})"


def runs_of(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(runs, run length, gap) when tensor is evenly spaced contiguous runs, else None.

    A contiguous tensor is one run; a sampled view ``as_strided((runs, len), (gap, 1))`` is
    ``runs`` runs. Anything else is left to the torch kernel.
    """
    if tensor.is_contiguous():
        return 1, tensor.numel(), tensor.numel()
    if tensor.dim() == 2 and tensor.stride(1) == 1:
        return tensor.shape[0], tensor.shape[1], tensor.stride(0)
    return None


class NativePass:
    """Addresses and sizes of the watched tensors, laid out once for the kernel."""

    def __init__(self, lib: ctypes.CDLL, sources: list[torch.Tensor],
                 snapshots: list[torch.Tensor]) -> None:
        self._lib = lib
        self._keep = (sources, snapshots)  # the addresses below stay valid while these live
        count = len(sources)
        table = torch.empty(6, count, dtype=torch.int64)
        for i, (src, snap) in enumerate(zip(sources, snapshots, strict=True)):
            layout = runs_of(src)
            if layout is None or not snap.is_contiguous():
                raise ValueError("the native kernel needs contiguous runs")
            table[0, i] = src.data_ptr()
            table[1, i] = snap.data_ptr()
            table[2, i], table[3, i], table[4, i] = layout
            table[5, i] = DTYPE_CODES[src.dtype]
        self._table = table
        self._count = count
        self.out = torch.zeros(count, FIGURES, dtype=torch.float64)

    @staticmethod
    def supports(sources: list[torch.Tensor]) -> bool:
        """CPU tensors of a known dtype laid out as contiguous runs."""
        return all(
            s.device.type == "cpu" and s.dtype in DTYPE_CODES and runs_of(s) is not None
            for s in sources
        )

    def run(self) -> torch.Tensor:
        """Fill and return the (tensors x FIGURES) figures, refreshing the snapshot on the way."""
        t = self._table
        self._lib.dw_update(
            self._count, t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr(),
            t[4].data_ptr(), t[5].data_ptr(), self.out.data_ptr(),
        )
        return self.out


class NativeKernel:
    """The installed C kernel (CPU): one pass, snapshot refreshed in the same loop."""

    def __init__(self, lib: ctypes.CDLL, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        self._buffers, self.snapshot = flat_snapshot(sources)
        self.snapshot_bytes = sum(b.numel() for b in self._buffers)
        self._pass = NativePass(lib, sources, self.snapshot)

    def refresh(self) -> None:
        torch._foreach_copy_(self.snapshot, self._sources)

    def run(self) -> tuple[Callable[[], torch.Tensor], list[Fence]]:
        figures = self._pass.run().clone()  # the kernel's buffer is reused by the next step
        return (lambda: figures), []


def native_kernel(sources: list[torch.Tensor]) -> NativeKernel | None:
    """The installed C kernel when every tensor suits it and the install carries it."""
    if not sources or not NativePass.supports(sources):
        return None
    lib = load()
    return None if lib is None else NativeKernel(lib, sources)
