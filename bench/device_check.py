"""One prepared device check: ``bash bench/device.sh`` on a machine with a CUDA GPU.

A Qwen3-0.6B-shaped model built from its config (random weights, bf16, nothing downloaded)
trains with LoRA r16 and as a full fine-tune, monitored by ``deadweight.watch`` (the core the
Trainer callback drives too) that reports to a real sidecar; the loop hands its loss and
gradient-norm tensors to ``monitor.log``. It prints:

- the host reads (syncs) per step that deadweight's hooks force on the training thread:
  counted by op (``bench.host_reads``) and by CUDA's sync debug mode;
- the hooks' share of a real training step: their seconds on the training thread, and the
  step time with the monitor against without it (interleaved blocks, the device synchronised
  at each step's end);
- the update pass against the device's bandwidth bound (``update_pass.run_device``).

Without a CUDA GPU it prints one line saying so and exits with ``NO_GPU_EXIT``. ``--smoke``
runs the same code on the CPU with a tiny shape and the accelerator's update path forced
(``DEADWEIGHT_UPDATE_PATH=device``): what the tests run. Budget: under 8 minutes on the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_GPU = ("device check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was "
          "measured: run bench/device.sh on a machine with one")
NO_GPU_EXIT = 3
#: Monitor methods whose work is deadweight's on the training thread, per step.
HOOKS = ("_before_step", "_after_step", "log")


@dataclass(frozen=True)
class Shape:
    """A Qwen3 config's dimensions, and the batch each step trains on."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    batch: int
    seq: int


QWEN3_06B = Shape("Qwen3-0.6B", 28, 1024, 3072, 16, 8, 128, 151_936, 2, 512)
TINY = Shape("tiny (smoke)", 2, 64, 128, 4, 2, 16, 512, 1, 16)


def build(shape: Shape, lora: bool, device: str) -> Any:
    """The model from its config, random weights, bf16; LoRA r16 on every linear layer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, tie_word_embeddings=True,
        max_position_embeddings=max(4096, shape.seq))
    torch.manual_seed(0)
    model: Any = Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 lora_dropout=0.0))
    return model


def measure(shape: Shape, lora: bool, device: str, address: str, steps: int) -> list[str]:
    """One row: host reads per step in the hooks, the hooks' share, the step with and without
    the monitor."""
    import torch

    import deadweight
    from deadweight.callbacks.watch import Monitor

    from .host_reads import HookMeter, HostReads

    cuda = device == "cuda"
    model = build(shape, lora, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=device)

    def step(monitor: Any, number: int) -> float:
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.log(number, loss=loss, grad_norm=norm)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step(None, 0)  # warm-up: allocations, kernels
    without: list[float] = []
    with_monitor: list[float] = []
    reads = HostReads()
    hooks_seconds = 0.0
    device_syncs = 0
    ours = 0
    kind = "lora" if lora else "full"
    # Two timing blocks each way, interleaved; then one block counting host reads op by op
    # (the counter slows every op, so it is not entered while timing).
    for block in range(3):
        counting = block == 2
        if not counting:
            without += [step(None, 0) for _ in range(steps)]
        with HookMeter(Monitor, HOOKS, reads, cuda=cuda) as meter, deadweight.watch(
                model, optimizer, run_id=f"device-check-{kind}-{block}",
                address=address) as monitor:
            step(monitor, 1)  # the first step lays out the snapshot: not counted
            meter.seconds.clear()
            meter.device_syncs = 0
            if counting:
                with reads:
                    for n in range(2, steps + 2):
                        step(monitor, n)
                ours = sum(n for label, n in reads.where.items() if label in HOOKS)
            else:
                with_monitor += [step(monitor, n) for n in range(2, steps + 2)]
                hooks_seconds += sum(meter.seconds.values())
                device_syncs += meter.device_syncs
    timed_steps = len(with_monitor)
    base, monitored = statistics.median(without), statistics.median(with_monitor)
    per_step = hooks_seconds / timed_steps
    trainable = sum(p.numel() for p in params)
    return [f"{'LoRA r16' if lora else 'full fine-tune'} ({trainable / 1e6:.1f}M trainable)",
            f"{ours / steps:.1f}", f"{device_syncs / timed_steps:.1f}" if cuda else "n/a (CPU)",
            f"{per_step * 1e3:.3f} ms", f"{per_step / base:.3%}",
            f"{base * 1e3:.1f} ms", f"{monitored * 1e3:.1f} ms", f"{monitored / base:.3f}x",
            f"{timed_steps} + {steps}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/device.sh", description=__doc__)
    parser.add_argument("--smoke", action="store_true",
                        help="the same code on the CPU, tiny shape, device path forced")
    parser.add_argument("--steps", type=int, default=None, help="steps per block")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(NO_GPU)
        return NO_GPU_EXIT
    from deadweight.callbacks.update.probe import PATH_ENV
    from deadweight.demo.sidecar_process import SidecarProcess

    from .common import setup_torch, table
    from .update_pass import run_device

    shape = TINY if args.smoke else QWEN3_06B
    device = "cpu" if args.smoke else "cuda"
    steps = args.steps or (2 if args.smoke else 8)
    if args.smoke:
        os.environ[PATH_ENV] = "device"  # the accelerator's update path, on CPU tensors
        setup_torch()
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    print(f"# deadweight device check on {where}, torch {torch.__version__}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dw-device-") as tmp, \
            SidecarProcess(Path(tmp) / "sidecar") as sidecar:
        for lora in (True, False):
            rows.append(measure(shape, lora, device, sidecar.address, steps))
            if device == "cuda":
                torch.cuda.empty_cache()  # the first model is gone: its cached blocks too
    table(f"deadweight.watch on a {shape.name}-shaped model, bf16, batch {shape.batch}x"
          f"{shape.seq}, {device}: per step after the first (2 blocks of {steps} steps each "
          "way, interleaved; host reads counted op by op in a third block)",
          ["run", "host reads in hooks/step", "device syncs in hooks/step", "hooks' time/step",
           "of a step", "step without", "step with", "with/without",
           "steps timed + counted"], rows)
    if device == "cuda":
        run_device("cuda", 11, quick=True)
    print(f"\ndevice check done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
