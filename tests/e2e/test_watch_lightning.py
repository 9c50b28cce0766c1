"""The Lightning callback on the same probe: a frozen run caught, a healthy one silent.

The model and the two setups are the raw loops' (``raw_loop_worker``): the backbone is
frozen, the head trains; the frozen run's ``configure_optimizers`` returns an optimizer over
the backbone (the wrong module). A real Lightning ``Trainer`` on CPU, a real sidecar.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from deadweight.demo.sidecar_process import SidecarProcess
from tests.e2e.test_watch import STEPS, _findings
from tests.support import raw_loop_worker


def _module(mode: str) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = raw_loop_worker._net()
            self.net.backbone.requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss: torch.Tensor = torch.nn.functional.mse_loss(self.net(x), y)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            params = (self.net.backbone.parameters() if mode == "frozen"
                      else [p for p in self.net.parameters() if p.requires_grad])
            return torch.optim.AdamW(params, lr=raw_loop_worker.LR)

    return Module()


def _fit(module: Any, steps: int, root: Path, callbacks: list[Any]) -> Any:
    """A CPU Lightning Trainer, quiet, fitted on steps batches of 4; returns it."""
    import lightning.pytorch as pl

    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 4))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root),
                         callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["healthy", "frozen"])
def test_lightning_run(mode: str, sidecar: SidecarProcess, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from deadweight.callbacks.lightning import DeadweightLightningCallback

    run_id = f"lightning-{mode}"
    firing: dict[str, float] = {}
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"

    class SeenBySidecar(pl.Callback):  # type: ignore[misc]
        """Wait until the sidecar shows each step (as a live scrape would have seen it)."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            raw_loop_worker._seen(url, run_id, 0, trainer.global_step, firing)

    callback = DeadweightLightningCallback(address=sidecar.address, run_id=run_id)
    trainer = _fit(_module(mode), STEPS, tmp_path, [callback, SeenBySidecar()])
    assert trainer.global_step == STEPS
    assert callback.monitor is not None and callback.monitor.step == STEPS
    findings = _findings(sidecar, run_id, 1)
    if mode == "healthy":
        assert findings == {}, {k: f.summary for k, f in findings.items()}
        assert "frozen_weights" in firing and set(firing.values()) == {0.0}, firing
    else:
        assert findings["frozen_weights"].evidence["update_norm"] == "0"
        assert firing.get("frozen_weights") == 1.0


@pytest.mark.slow
def test_lightning_stop_names_the_root_cause(stopping_sidecar: SidecarProcess,
                                             tmp_path: Path) -> None:
    """Under a stop policy the frozen Lightning run ends early and the callback says why:
    the gradients its optimizer never applies, the cause of the frozen weights."""

    from deadweight.callbacks.lightning import DeadweightLightningCallback

    steps = 40
    callback = DeadweightLightningCallback(address=stopping_sidecar.address,
                                           run_id="lightning-stop")
    trainer = _fit(_module("frozen"), steps, tmp_path, [callback])
    assert trainer.global_step < steps
    mark = callback.stopped_by_deadweight
    assert mark is not None and mark.startswith("grad_not_in_optimizer: "), mark
    assert mark.endswith("(stop triggered by frozen_weights)")


@pytest.mark.slow
def test_an_interrupted_fit_ends_its_run_as_failed(sidecar: SidecarProcess,
                                                   tmp_path: Path) -> None:
    """Ctrl-C in a fit: Lightning catches it and returns, with no on_train_end; the run ends
    as failed at its last step, with no verdict, instead of staying open."""
    import lightning.pytorch as pl

    from deadweight.callbacks.lightning import DeadweightLightningCallback
    from tests.support.realprocs import wait_for

    class Interrupt(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                raise KeyboardInterrupt

    run_id = "lightning-interrupted"
    callback = DeadweightLightningCallback(address=sidecar.address, run_id=run_id)
    # Lightning shuts down and exits (SystemExit 1; a notebook's kernel lives on)
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        _fit(_module("healthy"), STEPS, tmp_path, [callback, Interrupt()])
    status = wait_for(lambda: (s := sidecar.run_status(run_id)) is not None and s.ended and s,
                      30, what="the interrupted run's end")
    assert (status.end_reason, status.step) == ("failed", 3)
    assert _findings(sidecar, run_id, 1, steps=3) == {}
