"""Callback cost against a real training step of a Qwen3-0.6B-shaped model with LoRA r16.

The model is built from its config with random weights (no download), LoRA r=16 on all linear
layers (about 10M adapter parameters in 392 tensors), AdamW, one thread, batch 1. Every variant
of the update pass runs around the same optimizer step, so all figures share one run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from deadweight.callbacks.update_probe import UpdateProbe

from .common import fmt_time, table, verdict
from .update_pass import EagerForeach, NaiveLoop

STEP_BUDGET = 0.0025  # of a training step
OPTIMIZER_BUDGET = 0.5  # of optimizer.step()
#: Tokens per step: batch 1, a short sequence (real runs use far more, which only lowers the
#: callback's share).
SEQ = 128


def build_model(layers: int) -> torch.nn.Module:
    """Qwen3-0.6B dimensions (hidden 1024, intermediate 3072, 16/8 heads) with LoRA r16."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    peft_model: torch.nn.Module = get_peft_model(model, lora)
    return peft_model


def run(repeats: int, quick: bool) -> list[list[str]]:
    """Time training steps and, inside each, every update-pass variant."""
    layers = 28
    model = build_model(layers)
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the Trainer's default
    tokens = torch.randint(0, 151_936, (1, SEQ))
    # The probe runs first after optimizer.step(): a variant run after another one finds part
    # of the weights still in cache, so this order favours the references, not the probe.
    variants: dict[str, NaiveLoop | EagerForeach | UpdateProbe] = {
        "probe (default path)": UpdateProbe(params),
        "naive loop": NaiveLoop(params),
        "eager foreach": EagerForeach(params),
    }
    default_path = variants["probe (default path)"].path  # type: ignore[union-attr]
    times: dict[str, list[float]] = {k: [] for k in [*variants, "step", "optimizer.step()"]}

    def timed(key: str, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - start)

    steps = 3 if quick else max(5, repeats)
    for i in range(steps + 1):
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        probe_time = 0.0
        for name, variant in variants.items():
            t0 = time.perf_counter()
            variant.before_step()
            probe_time += time.perf_counter() - t0
            if i:
                times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        optimizer.step()
        opt_time = time.perf_counter() - t0
        for name, variant in variants.items():
            t0 = time.perf_counter()
            variant.after_step()
            elapsed = time.perf_counter() - t0
            probe_time += elapsed
            if i:
                times[name][-1] += elapsed
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step warms up allocations and is dropped
            times["step"].append(time.perf_counter() - start - probe_time)
            times["optimizer.step()"].append(opt_time)
    step = statistics.median(times["step"])
    opt = statistics.median(times["optimizer.step()"])
    rows = [["training step (no probe)", fmt_time(step), "", "", "", "", ""],
            ["optimizer.step() AdamW (fused)", fmt_time(opt), f"{opt / step:.2%}", "", "", "",
             ""]]
    for name in variants:
        cost = statistics.median(times[name])
        label = f"{name} [{default_path}]" if name.startswith("probe") else name
        budget = (f"<= {STEP_BUDGET:.2%} and <= {OPTIMIZER_BUDGET}x opt: "
                  + verdict(cost / step <= STEP_BUDGET and cost / opt <= OPTIMIZER_BUDGET)
                  if name.startswith("probe") else "reference")
        rows.append([label, fmt_time(cost), f"{cost / step:.3%}", f"{cost / opt:.2f}x",
                     f"{min(times[name]) / step:.3%}",
                     f"{min(times[name]) / min(times['optimizer.step()']):.2f}x", budget])
    del model, optimizer, variants
    rows += run_trainer(steps)
    n_params = sum(p.numel() for p in params)
    table(f"callback cost vs a training step (Qwen3-0.6B shape, {layers} layers, LoRA r16, "
          f"{n_params / 1e6:.1f}M adapter params in {len(params)} tensors, batch 1x{SEQ}, "
          f"{steps} steps, medians)",
          ["what", "time", "of step", "of opt.step", "best of step", "best of opt.step",
           "budget"], rows)
    return rows


class _Timed:
    """Wraps the callback's per-step hooks and times them; also times the optimizer step."""

    def __init__(self, callback: object) -> None:
        from transformers import TrainerCallback

        self.inner = callback
        self.hooks: list[float] = []
        self.optimizer: list[float] = []
        self.steps: list[float] = []
        self._t_pre_end = 0.0
        self._t_step = time.perf_counter()
        outer = self

        class Hooks(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, *a: object, **k: object) -> None:
                outer._t_step = time.perf_counter()

            def on_pre_optimizer_step(self, *a: object, **k: object) -> None:
                t0 = time.perf_counter()
                outer.inner.on_pre_optimizer_step(*a, **k)  # type: ignore[attr-defined]
                outer._t_pre_end = time.perf_counter()
                outer.hooks.append(outer._t_pre_end - t0)

            def on_optimizer_step(self, *a: object, **k: object) -> None:
                t0 = time.perf_counter()
                outer.optimizer.append(t0 - outer._t_pre_end)
                outer.inner.on_optimizer_step(*a, **k)  # type: ignore[attr-defined]
                outer.hooks[-1] += time.perf_counter() - t0

            def on_step_end(self, *a: object, **k: object) -> None:
                outer.steps.append(time.perf_counter() - outer._t_step)

        self.callback = Hooks()


def run_trainer(steps: int) -> list[list[str]]:
    """The real DeadweightCallback in a real Trainer, streaming to a real sidecar."""
    import tempfile
    from pathlib import Path

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo.sidecar_process import SidecarProcess

    model = build_model(28)
    tokens = torch.randint(0, 151_936, (SEQ,))
    data = [{"input_ids": tokens, "labels": tokens}] * (steps + 1)
    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp) / "sc") as sidecar:
        callback = DeadweightCallback(address=sidecar.address, run_id="bench-train")
        timed = _Timed(callback)
        # the real callback must still see train begin/end and logs: register it for those,
        # with its per-step hooks routed through the timer
        probe_times: list[float] = []

        class Rest(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, *a: object, **k: object) -> None:
                callback.on_train_begin(*a, **k)
                probe = callback._probe
                if probe is None:
                    return
                before, after = probe.before_step, probe.after_step

                def timed_before() -> None:
                    t0 = time.perf_counter()
                    before()
                    probe_times.append(time.perf_counter() - t0)

                def timed_after() -> object:
                    t0 = time.perf_counter()
                    result = after()
                    probe_times[-1] += time.perf_counter() - t0
                    return result

                probe.before_step = timed_before  # type: ignore[method-assign]
                probe.after_step = timed_after  # type: ignore[method-assign,assignment]

            def on_train_end(self, *a: object, **k: object) -> None:
                callback.on_train_end(*a, **k)

        args = TrainingArguments(
            output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=1, max_steps=steps,
            learning_rate=2e-4, logging_steps=10_000, save_strategy="no", report_to=[],
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[Rest(), timed.callback])
        trainer.train()
        path = callback._probe.path if callback._probe is not None else "?"
    hooks, opt, step = timed.hooks[1:], timed.optimizer[1:], timed.steps[1:]
    h, o, s = statistics.median(hooks), statistics.median(opt), statistics.median(step)
    ok = h / s <= STEP_BUDGET and h / o <= OPTIMIZER_BUDGET
    return [
        ["Trainer step (with callback)", fmt_time(s), "", "", "", "", ""],
        ["optimizer.step() AdamW (in Trainer)", fmt_time(o), f"{o / s:.2%}", "", "", "", ""],
        [f"DeadweightCallback per-step hooks [{path}]", fmt_time(h), f"{h / s:.3%}",
         f"{h / o:.2f}x", f"{min(hooks) / s:.3%}", f"{min(hooks) / min(opt):.2f}x",
         f"<= {STEP_BUDGET:.2%} and <= {OPTIMIZER_BUDGET}x opt: {verdict(ok)}"],
        ["  of which UpdateProbe", fmt_time(statistics.median(probe_times[1:])),
         f"{statistics.median(probe_times[1:]) / s:.3%}", "", "", "", ""],
    ]
