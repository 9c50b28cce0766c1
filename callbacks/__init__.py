"""The training side: ``from deadweight.callbacks import DeadweightCallback``.

The callback pulls in transformers; it is imported on first use so that the sidecar, which
shares the wire code, never needs the training libraries. Its modules, top to bottom:

- ``lightning``, ``callback`` (the Trainer's), ``watch`` (any loop): thin drivers over
- ``directives``: the sidecar's STOP and ABORT, said and applied one way for every driver;
- ``run_probe``: one run's measurements on one rank, never blocking, never raising;
- ``stream_client``, ``wire``, ``trainer_logs``, ``summary_writer``, ``stop_agreement``:
  the stream, its records, the trainer's loggers, the summary beside the adapter, STOP on
  every rank at the same step;
- ``facts/``: read once at train begin (membership, preflight, heads, stop token, rows,
  resume); ``update/``: the per-step update measurement and its kernels;
  ``layout``, ``digest``: the wrapper really running, adapter byte digests.
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
