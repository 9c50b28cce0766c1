"""``DeadweightLightningCallback``: the same probe in a Lightning ``Trainer``, in one line.

::

    trainer = lightning.Trainer(callbacks=[DeadweightLightningCallback()])

At train start it hands the module and its (first) optimizer to ``deadweight.watch``, so
membership and every optimizer step are measured by the same hooks as in a raw loop. It adds
what only Lightning knows: the loss of each batch, the gradient norm just before the step (a
frozen run with flowing gradients is the headline failure), and the checkpoints Lightning
saves. A STOP directive sets ``trainer.should_stop`` (and ``callback.stopped_by_deadweight``
holds its root cause and reason); ABORT raises from the optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback

from .deferred import DeferredScalar
from .run_probe import FAILED
from .stream_client import ClientSettings
from .watch import Monitor


def _grad_norm(module: torch.nn.Module) -> float | DeferredScalar:
    """L2 norm of every gradient present, in one multi-tensor pass, read later by the sender
    thread (the training thread never waits for the device)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return DeferredScalar(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))


def _loss(outputs: Any) -> DeferredScalar | None:
    """The step's loss, read later by the sender thread."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return DeferredScalar(loss)
    return None


class DeadweightLightningCallback(Callback):  # type: ignore[misc]
    """Stream membership, per-step updates, loss and grad norm of a Lightning run."""

    def __init__(self, address: str | None = None, run_id: str | None = None,
                 token: str | None = None, *, settings: ClientSettings | None = None,
                 start_timeout_seconds: float = 1.0) -> None:
        self.address = address
        self.run_id = run_id
        self.token = token
        self.settings = settings
        self.start_timeout_seconds = start_timeout_seconds
        self.monitor: Monitor | None = None
        self._grad_norm: float | DeferredScalar = 0.0

    @property
    def stopped_by_deadweight(self) -> str | None:
        """Why deadweight stopped this run (its root cause first), None unless it did."""
        return self.monitor.stopped_by_deadweight if self.monitor is not None else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        self.monitor = Monitor(
            pl_module, optimizers[0] if optimizers else None, self.run_id, self.address,
            token=self.token, output_dir=getattr(trainer, "default_root_dir", None),
            trainer="LightningTrainer", settings=self.settings,
            start_timeout_seconds=self.start_timeout_seconds,
            stop_how="trainer.should_stop is set",
        )

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is not None and not self.monitor._disabled:
            self._grad_norm = _grad_norm(pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        values: dict[str, float | DeferredScalar] = {"grad_norm": self._grad_norm}
        loss = _loss(outputs)
        if loss is not None:
            values["loss"] = loss
        monitor.log(monitor.step, **values)
        if monitor.should_stop:
            trainer.should_stop = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        path = getattr(getattr(trainer, "checkpoint_callback", None), "last_model_path", "")
        if self.monitor is not None and path and os.path.exists(path):
            self.monitor.checkpoint(path)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close("stopped" if trainer.should_stop else "completed")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Fit raised (Ctrl-C too, which Lightning catches and returns from): no
        ``on_train_end`` follows, so the run ends here as failed, not left open for the
        sidecar to find stalled."""
        if self.monitor is not None:
            self.monitor.close(FAILED)
