"""One recipe written the way users write plain PyTorch loops, with the faults users put in it.

The recipe: a small classifier whose stem and first stage are frozen (fine-tuning a head and
the last stage on a fixed backbone), AdamW with a linear warmup then cosine decay, a shuffled
DataLoader, ``zero_grad`` every step, under ``deadweight.watch``. Healthy variations change
the seed, the data order, the data itself (another draw of the same task), or run beside a
CPU hog; each fault changes one thing a person gets
wrong without any error:

- ``frozen_stage_trains``: the freeze lives in an overridden ``train()`` that the pipeline
  never calls, so the "frozen" stage is in the optimizer and moves, its batch norm training;
- ``no_zero_grad``: gradients are never cleared;
- ``warmup_stuck``: ``scheduler.step()`` is never called, so lr stays at its warmup value;
- ``nll_on_logits``: the loss type changed (``nll_loss`` on raw logits, no log-softmax);
- ``same_batch``: ``next(iter(loader))`` every step on an unshuffled loader;
- ``head_lr_tiny``: the head's parameter group got a hundredth of the learning rate (a
  per-group multiplier applied by mistake).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import deadweight

FEATURES, HIDDEN, CLASSES = 16, 32, 4
ROWS, BATCH = 1024, 32
STEPS, WARMUP = 60, 6
LR = 3e-3
FAULTS = ("frozen_stage_trains", "no_zero_grad", "warmup_stuck", "nll_on_logits", "same_batch",
          "head_lr_tiny")


class Classifier(nn.Module):
    """stem -> stage0 (+norm) -> stage1 (+norm) -> head; each a leaf module, so each is its
    own module kind in deadweight's per-module figures."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, HIDDEN)
        self.stage0 = nn.Linear(HIDDEN, HIDDEN)
        self.stage0_norm = nn.BatchNorm1d(HIDDEN)
        self.stage1 = nn.Linear(HIDDEN, HIDDEN)
        self.stage1_norm = nn.BatchNorm1d(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def backbone(self) -> list[nn.Module]:
        return [self.stem, self.stage0, self.stage0_norm]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.stage0_norm(self.stage0(x)))
        x = F.relu(self.stage1_norm(self.stage1(x)))
        return self.head(x)


class FreezeInTrain(Classifier):
    """The fault: the freeze is applied in ``train()``, which this pipeline never calls."""

    def train(self, mode: bool = True) -> FreezeInTrain:
        super().train(mode)
        for module in self.backbone():
            module.requires_grad_(False)
            module.eval()
        return self


#: The data's seed: the same data for every run unless one asks for another draw.
DATASET_SEED = 1234


def dataset(seed: int = DATASET_SEED) -> torch.utils.data.TensorDataset:
    """The same data for every run (another seed: another draw of the same task, a healthy
    run on other data): inputs and labels from a fixed teacher, with label noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    labels = (x @ teacher + 1.5 * torch.randn(ROWS, CLASSES, generator=generator)).argmax(1)
    return torch.utils.data.TensorDataset(x, labels)


def schedule(step: int) -> float:
    """Linear warmup from a tenth of the peak, then cosine decay to a tenth."""
    if step < WARMUP:
        return 0.1 + 0.9 * step / WARMUP
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def run(run_id: str, address: str, *, seed: int = 0, data_seed: int = 0,
        fault: str | None = None, baseline: Path | None = None,
        dataset_seed: int = DATASET_SEED, **options: Any) -> None:
    """One run of the recipe (with one fault, or none); options go to ``deadweight.watch``
    (``settings=ClientSettings(batch_size=2)``: the sidecar judges the run at every step)."""
    torch.manual_seed(seed)
    model: Classifier = FreezeInTrain() if fault == "frozen_stage_trains" else Classifier()
    if fault != "frozen_stage_trains":  # the recipe's freeze, done where it takes effect
        for module in model.backbone():
            module.requires_grad_(False)
            module.eval()
    trained = [p for p in model.parameters() if p.requires_grad]
    if fault == "head_lr_tiny":
        head = set(map(id, model.head.parameters()))
        optimizer = torch.optim.AdamW([
            {"params": [p for p in trained if id(p) not in head]},
            {"params": list(model.head.parameters()), "lr": LR / 100}], lr=LR)
    else:
        optimizer = torch.optim.AdamW(trained, lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    loader = torch.utils.data.DataLoader(
        dataset(dataset_seed), batch_size=BATCH, shuffle=fault != "same_batch", drop_last=True,
        generator=torch.Generator().manual_seed(data_seed))
    batches = _forever(loader)
    with deadweight.watch(model, optimizer, run_id=run_id, address=address,
                          baseline=baseline, **options) as monitor:
        for step in range(1, STEPS + 1):
            x, y = next(iter(loader)) if fault == "same_batch" else next(batches)
            logits = model(x)
            loss = F.nll_loss(logits, y) if fault == "nll_on_logits" else F.cross_entropy(
                logits, y)
            loss.backward()
            optimizer.step()
            if fault != "no_zero_grad":
                optimizer.zero_grad()
            if fault != "warmup_stuck":
                scheduler.step()
            monitor.log(step, loss=loss)


def _forever(loader: torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]
             ) -> Iterator[tuple[torch.Tensor, ...]]:
    while True:
        yield from loader


@contextmanager
def cpu_hog() -> Iterator[None]:
    """A busy machine: a process spinning on a core beside the run."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def large_weights_run(run_id: str, address: str, *, lr: float, seed: int = 0,
                      baseline: Path | None = None, steps: int = 12) -> None:
    """A recipe whose healthy steps are tiny against its weights: a float64 regression whose
    weights sit near 100 (a large offset the model learns around), trained by Adam at lr 1e-5,
    so each step moves them by ~1e-7 of their norm, under the fixed negligible-update floor
    (1e-6), while every step changes their bytes.
    """
    torch.manual_seed(seed)
    model = nn.Linear(FEATURES, 1).double()
    with torch.no_grad():
        model.weight.add_(100.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x_all = dataset().tensors[0].double()
    with deadweight.watch(model, optimizer, run_id=run_id, address=address,
                          baseline=baseline) as monitor:
        for step in range(1, steps + 1):
            x = x_all[step * BATCH:(step + 1) * BATCH]
            loss = (model(x).squeeze(1) - x.sum(1) * 101.0).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss)


#: Every this many steps the spiky recipe meets a batch of inputs HARD_SCALE times larger.
HARD_EVERY, HARD_SCALE = 10, 4.0
SPIKY_STEPS = 40


def spiky_run(run_id: str, address: str, *, seed: int = 0, baseline: Path | None = None,
              outlier_step: int | None = None, outlier_scale: float = 12.0,
              **options: Any) -> None:
    """A recipe whose healthy gradient norm jumps: a linear regression trained by Adam on
    rows of which every HARD_EVERY-th batch comes from a shard HARD_SCALE times larger (an
    unnormalised source mixed in on purpose), so at that step the squared loss's gradient is
    ~16-21x its recent level, far above ``grad_norm_spike``'s fixed bar, in every healthy run.
    ``outlier_step``: one batch there is ``outlier_scale`` times larger again (a corrupt
    batch: the jump no healthy run of the recipe made)."""
    torch.manual_seed(seed)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rows = dataset().tensors[0]
    teacher = torch.randn(FEATURES, generator=torch.Generator().manual_seed(7))
    order = torch.Generator().manual_seed(seed)
    with deadweight.watch(model, optimizer, run_id=run_id, address=address,
                          baseline=baseline, **options) as monitor:
        for step in range(1, SPIKY_STEPS + 1):
            x = rows[torch.randint(0, ROWS, (BATCH,), generator=order)]
            if step % HARD_EVERY == 0:
                x = x * HARD_SCALE
            if step == outlier_step:
                x = x * outlier_scale
            loss = (model(x).squeeze(1) - x @ teacher).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss)
