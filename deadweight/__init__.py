"""deadweight: catch fine-tuning runs that report a healthy loss while their weights stay frozen.

The packages live in top-level folders (``callbacks/``, ``sidecar/``, ``proto/``, ``demo/``);
this folder links them under one import name, ``deadweight.*``, and holds the ``deadweight``
command (``cli.py``), which adds ``demo`` to the sidecar's commands. ``deadweight.watch`` (any
PyTorch loop) is imported on first use, so ``import deadweight`` stays light.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .callbacks.watch import Monitor, watch

try:
    __version__ = version("deadweight")
except PackageNotFoundError:  # running from a checkout without an install
    __version__ = "0.0.0"

__all__ = ["Monitor", "__version__", "watch"]


def __getattr__(name: str) -> Any:
    if name in ("watch", "Monitor"):
        from .callbacks import watch as watch_module

        return getattr(watch_module, name)
    raise AttributeError(name)
