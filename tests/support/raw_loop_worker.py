"""One rank of a raw PyTorch training loop monitored with ``deadweight.watch``.

Usage: ``[torchrun --nproc-per-node 2] tests/support/raw_loop_worker.py LOOPS MODES OUT_DIR`` with
``DEADWEIGHT_ADDRESS`` set. LOOPS is one loop (or several DeepSpeed ones, comma-separated, run
in turn). A loop is ``single``, ``ddp``, ``fsdp2``, ``fsdp1-orig``,
``fsdp1-flat``, ``accelerate``, ``deepspeed`` (ZeRO-2), ``deepspeed3``, or ``deepspeed-bf16``,
``deepspeed3-bf16``, ``deepspeed0-bf16`` (ZeRO-2, ZeRO-3, no ZeRO, with bf16 model weights and
fp32 master copies, at a small lr), ``deepspeed-bf16-nomaster`` (the same ZeRO-2 run with
DeepSpeed's bf16 master weights and optimizer states: no fp32 copy anywhere); MODES is
``healthy``, ``frozen`` or ``healthy,frozen`` (both runs in one process, one after the other:
a launch of torch and its ranks costs more than the loops):

- replicated loops (single, ddp, accelerate): the backbone is frozen and the head trains;
  the frozen run hands the optimizer the backbone (the wrong module), so the head gets
  gradients that no optimizer applies and nothing moves.
- fsdp1-orig does the same (``use_orig_params=True`` keeps the parameter objects, so it
  tolerates a frozen backbone and an optimizer built before wrapping alike).
- fsdp2 and fsdp1-flat: the frozen run builds the optimizer before sharding, so it holds the
  parameters the wrapper replaced; the model trains on new ones nobody updates.

No run id is given: every rank reports under rank 0's. Each rank writes ``<MODE>/rank<N>.json`` with
what it knows (run id, steps, membership, and for fsdp2 the unsharded reference norm of each
step's update, gathered with ``full_tensor()``; for the bf16 loops the share of the
master partitions' elements each step left unchanged).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 6
#: The Monitor's methods whose host reads a run that counts them counts.
HOOKS = ("_before_step", "_after_step", "log")
LR = 1e-2
#: Small enough that most bf16 elements of the model copy keep their value in one step (the
#: update is below half a bf16 ULP) while the fp32 master partitions move every element.
BF16_LR = 1e-4


def _net() -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
            self.head = nn.Linear(32, 4)
            # dim 0 smaller than the world size: under fully_shard rank 1 holds an empty shard
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.backbone(x)) * self.scale
            return out

    torch.manual_seed(0)
    return Net()


def plain_step(model: Any, optimizer: Any, monitor: Any, step: int) -> None:
    """One step of the tiny net on random data, reported to ``monitor`` (``deadweight.watch``)
    with its loss and grad_norm: the loop the console tests run in and out of process."""
    import torch

    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    optimizer.step()
    optimizer.zero_grad()
    model.zero_grad()
    monitor.log(step, loss=loss, grad_norm=norm)


def _grad_norm(model: Any, sharded: bool) -> float:
    """The global gradient norm (squares of local shards summed over ranks when sharded)."""
    import torch
    import torch.distributed as dist

    from deadweight.callbacks.layout import local_view

    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            sq += local_view(p.grad).double().pow(2).sum()
    if sharded:
        dist.all_reduce(sq)
    return math.sqrt(float(sq))


def _seen(metrics_url: str, run_id: str, rank: int, step: int,
          firing: dict[str, float]) -> None:
    """Wait until the sidecar shows this rank at step (a condition, not a sleep); keep the
    detectors' largest live values, as Prometheus would have scraped them."""
    import re
    import time
    import urllib.request

    labels = (f'rank="{rank}"', f'run_id="{run_id}"')
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith("deadweight_detector_firing{") and f'run_id="{run_id}"' in line:
                detector = re.search(r'detector="([^"]*)"', line)
                if detector:
                    value = float(line.rsplit(" ", 1)[1])
                    firing[detector[1]] = max(value, firing.get(detector[1], 0.0))
        shown = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("deadweight_step{") and all(x in line for x in labels)]
        if shown and shown[0] >= step:
            return
        time.sleep(0.02)  # poll interval of the condition wait
    raise TimeoutError(f"sidecar never showed rank {rank} at step {step}")


def _full(model: Any) -> list[Any]:
    """Every parameter unsharded (a collective), in float64."""
    return [p.full_tensor().detach().double().clone() for p in model.parameters()]


def _masters(optimizer: Any) -> list[Any]:
    """DeepSpeed's master copies (fp32 unless configured otherwise), read from its own
    attributes (ZeRO-1/2, ZeRO-3, the unfused stage-0 optimizer); ZeRO-3 empties its inner
    optimizer's param groups between steps, so those cannot be read instead."""
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                 "fp32_groups"):
        groups = getattr(optimizer, attr, None)
        if groups:
            return [t for g in groups for t in (g if isinstance(g, list) else [g])]
    raise AttributeError(f"no master copies found on {type(optimizer).__name__}")


def main(loops: str, modes: str, out: Path) -> int:
    """Run each loop of the comma-separated LOOPS once per mode of MODES, one after the other
    in this process (one process group, one import of torch), each its own run under
    ``deadweight.watch``; a run's reports go to ``OUT/<mode>/rank<N>.json``, or
    ``OUT/<loop>/<mode>/`` when LOOPS names several (DeepSpeed loops only: they share the
    engine's process group)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    names = loops.split(",")
    loop = names[0]
    if len(names) > 1 and not all(name.startswith("deepspeed") for name in names):
        raise SystemExit(f"several loops share a launch only when all are DeepSpeed's: {loops}")
    distributed = "WORLD_SIZE" in os.environ and loop not in ("single", "accelerate")
    if distributed and not loop.startswith("deepspeed"):
        dist.init_process_group("gloo")
    for name in names:
        for mode in modes.split(","):
            folder = out / name / mode if len(names) > 1 else out / mode
            folder.mkdir(parents=True, exist_ok=True)
            run(name, mode, folder)
    if distributed and dist.is_initialized():
        dist.destroy_process_group()
    return 0


def run(loop: str, mode: str, out: Path) -> None:
    """One monitored run of the loop in one mode; writes this rank's report to out."""
    import torch

    import deadweight

    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100 + rank)
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(STEPS)]
    model = _net()
    reference: list[float] = []
    engine: Any = None
    accelerator: Any = None
    if loop == "fsdp1-orig":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model.backbone.requires_grad_(False)
        model = FullyShardedDataParallel(model, use_orig_params=True,
                                         device_id=torch.device("cpu"))
        inner = model.module
        optimizer = torch.optim.AdamW(
            inner.backbone.parameters() if mode == "frozen"
            else [p for p in model.parameters() if p.requires_grad], lr=LR)
    elif loop in ("single", "ddp", "accelerate", "deepspeed", "deepspeed3", "deepspeed-bf16",
                  "deepspeed3-bf16", "deepspeed0-bf16", "deepspeed-bf16-nomaster"):
        model.backbone.requires_grad_(False)
        params = (model.backbone.parameters() if mode == "frozen"
                  else [p for p in model.parameters() if p.requires_grad])
        if loop.startswith("deepspeed"):
            import deepspeed

            bf16 = "-bf16" in loop
            config: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": 4,
                "zero_optimization": {"stage": 3 if loop.startswith("deepspeed3")
                                      else 0 if loop.startswith("deepspeed0") else 2},
                "optimizer": {"type": "AdamW",
                              "params": {"lr": BF16_LR if bf16 else LR, "torch_adam": True}}}
            if bf16:  # the engine casts the model to bf16; the optimizer steps fp32 copies
                config["bf16"] = {"enabled": True}
            if loop.endswith("-nomaster"):  # the optimizer steps bf16 partitions instead
                config["bf16"] |= {"bf16_master_weights_and_grads": True,
                                   "bf16_optimizer_states": True}
            # On the CPU, init_distributed JIT-compiles DeepSpeed's shared-memory all-reduce
            # (deepspeed_shm_comm: one to two minutes of g++ on a fresh machine, on the test's
            # path). Only inference_all_reduce calls it; training's all_reduce is gloo's either
            # way. So the loop marks it unavailable, as DeepSpeed does where the OS lacks it.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
            deepspeed.init_distributed(dist_backend="gloo")
            # Only healthy: both frozen setups tried here fail loudly under ZeRO-2 (an
            # optimizer without trainable parameters at initialize, a head swapped after it).
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=list(params), config=config)
            model = engine
        else:
            optimizer = torch.optim.AdamW(params, lr=LR)
        if loop == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        if loop == "accelerate":
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=True)
            model, optimizer = accelerator.prepare(model, optimizer)
    else:
        stale = torch.optim.AdamW(model.parameters(), lr=LR) if mode == "frozen" else None
        if loop == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.backbone)
            fully_shard(model)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(model, use_orig_params=False,
                                             device_id=torch.device("cpu"))
        optimizer = stale or torch.optim.AdamW(model.parameters(), lr=LR)
    sharded = loop.startswith("fsdp")
    dtype = next(model.parameters()).dtype
    masters = _masters(optimizer) if engine is not None else []
    master_unchanged: list[float] = []
    metrics_url = os.environ["DEADWEIGHT_TEST_METRICS"]
    firing: dict[str, float] = {}
    # Where the launch forces the GPU's update path (DEADWEIGHT_UPDATE_PATH=device: FSDP2), the
    # healthy run counts the host reads in deadweight's hooks from its second step on (the
    # meter wraps the Monitor's methods before watch binds them).
    from bench.host_reads import HookMeter, HostReads
    from deadweight.callbacks.update.probe import device_path_forced
    from deadweight.callbacks.watch import Monitor

    reads = HostReads()
    counting = mode == "healthy" and device_path_forced()
    meter = HookMeter(Monitor, HOOKS, reads)
    with meter if counting else contextlib.nullcontext(), \
            deadweight.watch(model, optimizer) as monitor:
        for step, (x, y) in enumerate(batches, start=1):
            if counting and step >= 2:
                reads.__enter__()  # exited before the test's wait on /metrics below
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
            if engine is not None:
                engine.backward(loss)
            elif accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
            grad_norm = _grad_norm(model, sharded) if engine is None else 0.0
            before = _full(model) if loop == "fsdp2" else []
            if engine is not None:
                old = [t.detach().clone() for t in masters]
                engine.step()
                master_unchanged.append(
                    sum(int((t == o).sum()) for t, o in zip(masters, old, strict=True))
                    / max(sum(t.numel() for t in masters), 1))
                grad_norm = float(engine.get_global_grad_norm() or 0.0)
            else:
                optimizer.step()
                optimizer.zero_grad()
            if before:
                after = _full(model)
                reference.append(math.sqrt(sum(float((a - b).pow(2).sum())
                                               for a, b in zip(after, before, strict=True))))
            monitor.log(step, loss=loss, grad_norm=grad_norm)
            if counting and step >= 2:
                reads.__exit__(None, None, None)
            _seen(metrics_url, monitor.run_id, rank, step, firing)
        membership = monitor._run.membership
        layout = monitor._run.layout
        report = {
            "rank": rank,
            "host_reads_in_hooks": sum(n for label, n in reads.where.items() if label in HOOKS),
            "hooks_measured": sorted(meter.seconds),
            "update_path": monitor._run.update.describe() if monitor._run.update else "",
            "run_id": monitor.run_id,
            "steps": monitor.step,
            "reference_update_norms": reference,
            "wrapper": layout.wrapper if layout else "",
            "layout": membership.layout if membership else "",
            "sharded": layout.sharded if layout else False,
            "watched_names": membership.watched_names if membership else [],
            "optimizer_params": membership.optimizer_params if membership else -1,
            "trainable_params": membership.trainable_params if membership else -1,
            "optimizer_params_by_dtype":
                membership.optimizer_params_by_dtype if membership else {},
            "model_dtype": str(dtype).removeprefix("torch."),
            "master_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in masters}),
            "master_unchanged": master_unchanged,
            "dropped": monitor.client.dropped if monitor.client else -1,
            "live_firing": firing,
        }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
