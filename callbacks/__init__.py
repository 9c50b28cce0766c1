"""The training side: ``from deadweight.callbacks import DeadweightCallback``.

The callback pulls in transformers; it is imported on first use so that the sidecar, which
shares the wire code, never needs the training libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .callback import DeadweightAbort, DeadweightCallback

__all__ = ["DeadweightAbort", "DeadweightCallback"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import callback

        return getattr(callback, name)
    raise AttributeError(name)
