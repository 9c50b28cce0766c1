"""The training thread never reads a device value on the host in deadweight's hooks.

On an accelerator every such read (``.item()``, ``float(t)``, a blocking copy to the host)
waits for the device: a host sync per read, per step. The GPU's code path runs here on CPU
tensors (``DEADWEIGHT_UPDATE_PATH=device``: the device kernel queued on the training thread,
its figures copied without blocking and read by the sender thread), under a dispatch mode
that counts every host read on the training thread (``bench.host_reads``), labelled by the
hook it happened in. Real trainers on the tiny local model, a real sidecar: the Trainer
callback (LoRA, full fine-tune, fp16 with a GradScaler), ``deadweight.watch`` in a raw loop
that logs its loss tensor, and the Lightning callback. After the first step (which lays out
buffers) each hook reads nothing; the loops' own reads are counted too, which shows the
counter sees what it should.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bench.host_reads import HostReads
from deadweight.callbacks.update.probe import PATH_ENV
from deadweight.demo import runs
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow

TRAINER_HOOKS = ("on_step_begin", "on_substep_end", "on_pre_optimizer_step",
                 "on_optimizer_step", "on_step_end", "on_log")
STEPS = 4


@pytest.fixture(autouse=True)
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATH_ENV, "device")


class PerStep:
    """Host reads per (hook, step), and the loop's own."""

    def __init__(self) -> None:
        self.mode = HostReads()
        self.step = 0

    def around(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def labelled(*args: Any, **kwargs: Any) -> Any:
            self.mode.at(f"{name}@{self.step}")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mode.at("loop")
        return labelled

    def ours_after_first(self) -> Counter[str]:
        """Reads in deadweight's hooks at steps 2 and later."""
        return Counter({label: n for label, n in self.mode.where.items()
                        if "@" in label and int(label.rsplit("@", 1)[1]) >= 2})

    def ours(self) -> int:
        return sum(n for label, n in self.mode.where.items() if "@" in label)


def _trainer_run(live: InProcessSidecar, tiny: tuple[Path, Path], out: Path, name: str,
                 lora: bool, **overrides: Any) -> tuple[PerStep, list[str]]:
    from transformers import AutoModelForCausalLM, TrainerCallback

    model_dir, _ = tiny
    counts = PerStep()
    callback = live.callback(f"host-reads-{name}")
    for hook in TRAINER_HOOKS:
        labelled = counts.around(hook, getattr(callback, hook))

        def at_step(args: Any, state: Any, *rest: Any, _labelled: Any = labelled,
                    **kwargs: Any) -> Any:
            counts.step = state.global_step + 1  # the step under way (or just made)
            return _labelled(args, state, *rest, **kwargs)

        setattr(callback, hook, at_step)

    paths: list[str] = []

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            probe = callback._probe
            paths.append(probe.describe() if probe is not None else "no probe")

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = runs.sft_trainer(model, model_dir, out / name, [callback, Steps()], steps=STEPS,
                               save_steps=100, logging_steps=1,
                               peft_config=runs.lora_config() if lora else None, **overrides)
    if overrides.get("fp16"):
        # On a CPU the Trainer builds no GradScaler for fp16; one is set as a GPU run has it.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with counts.mode:
        trainer.train()
    return counts, paths


@pytest.mark.parametrize("name,lora,overrides", [
    ("lora", True, {}),
    ("full", False, {}),
    ("fp16", True, {"fp16": True}),
])
def test_trainer_callback_reads_nothing_on_the_host(
        name: str, lora: bool, overrides: dict[str, Any], live: InProcessSidecar,
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    counts, paths = _trainer_run(live, tiny, tmp_path, name, lora, **overrides)
    assert paths and all("device kernel on the CPU" in p for p in paths), paths
    assert live.seen(f"host-reads-{name}").step == STEPS  # every step measured and sent
    assert counts.ours_after_first() == Counter(), counts.mode.where
    assert counts.mode.where["loop"] > 0  # the Trainer's own reads (its logged loss) are seen
    print(f"host reads ({name}): deadweight's hooks {counts.ours()} in {STEPS} steps "
          f"(after the first: 0); the Trainer's own {counts.mode.where['loop']}: "
          f"{dict(counts.mode.reads)}")


def _label_monitor(counts: PerStep, monkeypatch: pytest.MonkeyPatch) -> None:
    """Count the watch Monitor's step hooks and ``log`` under their names."""
    from deadweight.callbacks.watch import Monitor

    for hook in ("_before_step", "_after_step", "log"):
        original = getattr(Monitor, hook)

        def labelled(self: Any, *args: Any, _hook: str = hook, _fn: Any = original,
                     **kwargs: Any) -> Any:
            return counts.around(_hook, _fn)(self, *args, **kwargs)

        monkeypatch.setattr(Monitor, hook, labelled)


def test_watch_reads_nothing_on_the_host_and_defers_the_logged_loss(
        live: InProcessSidecar, tiny: tuple[Path, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw LoRA loop that hands ``monitor.log`` its loss tensor and a gradient norm tensor:
    the values reach the sidecar, read by the sender thread, not the training thread."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import deadweight

    model_dir, _ = tiny
    counts = PerStep()
    _label_monitor(counts, monkeypatch)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), runs.lora_config())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    tokens = torch.randint(0, 200, (2, 16))
    losses: list[float] = []
    with deadweight.watch(model, optimizer, run_id="host-reads-watch",
                          address=live.address) as monitor, counts.mode:
        for step in range(1, STEPS + 1):
            counts.step = step
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss, grad_norm=norm)
            losses.append(loss.item())  # the loop's own read: counted as the loop's
    assert counts.ours_after_first() == Counter(), counts.mode.where
    assert counts.mode.where["loop"] >= STEPS  # the counter sees the loop's .item()
    seen = live.seen("host-reads-watch")
    assert seen.step == STEPS
    assert [v for _, v in seen.history("loss")] == pytest.approx(losses)
    print(f"host reads (watch): deadweight's hooks {counts.ours()} in {STEPS} steps; the "
          f"loop's own {counts.mode.where['loop']}")


def test_lightning_callback_reads_nothing_on_the_host(live: InProcessSidecar,
                                                      tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from deadweight.callbacks.lightning import DeadweightLightningCallback
    from tests.support import raw_loop_worker

    counts = PerStep()
    callback = DeadweightLightningCallback(address=live.address, run_id="host-reads-lightning")
    for hook in ("on_before_optimizer_step", "on_train_batch_end"):
        setattr(callback, hook, counts.around(hook, getattr(callback, hook)))

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = raw_loop_worker._net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            counts.step = batch_idx + 1
            x, y = batch
            loss: torch.Tensor = torch.nn.functional.mse_loss(self.net(x), y)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(4 * STEPS, 8), torch.randn(4 * STEPS, 4)),
                      batch_size=4)
    trainer = pl.Trainer(max_steps=STEPS, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu",
                         default_root_dir=str(tmp_path))
    with counts.mode:
        trainer.fit(Module(), train_dataloaders=data)
    assert counts.ours_after_first() == Counter(), counts.mode.where
    assert live.seen("host-reads-lightning").step == STEPS
    assert len(live.seen("host-reads-lightning").history("loss")) == STEPS
