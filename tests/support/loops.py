"""Small real raw training loops under ``deadweight.watch``, against the in-process sidecar.

Shared by the detector tests of raw loops: a two-layer regression model whose gradients are
small (as in a late, healthy run), optimizers of every family, and the loop itself with the
faults a user can put in it (no ``optimizer.step()``, no ``zero_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import deadweight
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import wait_for


class Lion(torch.optim.Optimizer):
    """The Lion update (sign of an interpolated momentum, decoupled decay): none is installed
    here, so the test carries the published update rule itself."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                avg = state.setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(avg * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def transformers_adafactor(params: Iterable[Any]) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, scale_parameter=True, relative_step=False,
                     warmup_init=False)


def transformers_adafactor_relative(params: Iterable[Any]) -> torch.optim.Optimizer:
    """The recipe transformers documents: Adafactor sets its own step size (no lr at all)."""
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=None, scale_parameter=True, relative_step=True,
                     warmup_init=False)


#: name -> how the loop builds its optimizer over the parameters it is handed.
OPTIMIZERS: dict[str, Callable[[Iterable[Any]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adafactor-torch": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "adafactor-transformers": transformers_adafactor,
    "adafactor-relative": transformers_adafactor_relative,
    "lion": lambda ps: Lion(ps, lr=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}


def model(seed: int = 0) -> torch.nn.Module:
    """A small head (3% of its default init) keeps the gradients small."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        net[2].weight.mul_(0.03)
        net[2].bias.zero_()
    return net


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed regression task whose targets are small: small gradients, as late in a run."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 4, generator=generator) * 0.02
    out = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator)
        out.append((x, x @ weight))
    return out


def run_loop(live: InProcessSidecar, run_id: str, optimizer: str = "adamw", *,
             steps: int = 12, frozen: bool = False, step_optimizer: bool = True,
             zero_grad: bool = True, corrupt_at: int | None = None,
             freeze_first: bool = False, checkpoint_to: Path | None = None,
             **watch_options: Any) -> Any:
    """One real loop to its end. ``frozen``: the optimizer is built over a copy of the model
    (a classic: the model was rebuilt after the optimizer), so no step moves the weights;
    ``step_optimizer=False``: ``optimizer.step()`` is never called; ``zero_grad=False``: the
    gradients are never cleared; ``corrupt_at``: that step's batch has corrupt targets;
    ``freeze_first``: the first layer is frozen before the optimizer is built;
    ``checkpoint_to``: the loop saves its model there at the end and reports it."""
    net = model()
    if freeze_first:
        net[0].requires_grad_(False)
    held = model(seed=3).parameters() if frozen else [p for p in net.parameters()
                                                        if p.requires_grad]
    opt = OPTIMIZERS[optimizer](held)
    with deadweight.watch(net, opt, run_id=run_id, address=live.address,
                          **watch_options) as monitor:
        for i, (x, y) in enumerate(batches(steps), start=1):
            if i == corrupt_at:
                y = y * 300  # a corrupt batch: its targets off by orders of magnitude
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            grad_norm = torch.sqrt(sum((p.grad.detach() ** 2).sum()
                                       for p in net.parameters() if p.grad is not None))
            if step_optimizer:
                opt.step()
            if zero_grad:
                opt.zero_grad()
                net.zero_grad()
            monitor.log(i, loss=loss, grad_norm=grad_norm)
            # a real step takes longer than the sidecar's turn: let it see each one live
            wait_for(lambda i=i: (run := live.run(run_id)) is not None and run.log_steps >= i,
                     15, what=f"log {i} of {run_id}")
        if checkpoint_to is not None:
            from safetensors.torch import save_file

            checkpoint_to.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in net.state_dict().items()},
                      str(checkpoint_to / "model.safetensors"))
            monitor.checkpoint(checkpoint_to)
    return monitor


def wait_ended(live: InProcessSidecar, run_id: str) -> None:
    wait_for(lambda: (run := live.run(run_id)) is not None and run.ended, 15,
             what=f"the end of {run_id}")
