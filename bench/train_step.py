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
from typing import Any

import torch

from deadweight.callbacks.update.probe import UpdateProbe
from deadweight.callbacks.update.stats import PendingStats

from .common import fmt_time, table, verdict
from .update_pass import EagerForeach, NaiveLoop, _count_syncs

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


def run(repeats: int, quick: bool, device: str = "cpu") -> list[list[str]]:
    """Time training steps and, inside each, every update-pass variant; then the peers."""
    layers = 28
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = build_model(layers).to(dev)
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the Trainer's default
    tokens = torch.randint(0, 151_936, (1, SEQ), device=dev)
    # The inline probe runs first after optimizer.step(): a variant run after another one finds
    # part of the weights still in cache, so this order favours the references, not the probe.
    variants: dict[str, NaiveLoop | EagerForeach | UpdateProbe] = {
        INLINE: UpdateProbe(params, background=False),
        "naive loop": NaiveLoop(params),
        "eager foreach": EagerForeach(params),
    }
    # The default probe: on the CPU its kernel runs on its own thread during the next forward
    # and backward (on an accelerator it queues device work), so it is launched after every
    # other variant and settled before them, and the steps timed here include its company.
    default = UpdateProbe(params)
    default_path = default.path + (" kernel on its own thread" if default.in_background else "")
    times: dict[str, list[float]] = {k: [] for k in [*variants, DEFAULT, "step",
                                                     "optimizer.step()", "sender read"]}
    syncs = {name: 0 for name in [*variants, DEFAULT]}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def call(name: str, fn: Callable[[], object]) -> object:
        """fn on the training thread; on CUDA the syncs it forces are counted."""
        if not cuda:
            return fn()
        result, n = _count_syncs(fn)
        syncs[name] += n
        return result

    def timed(name: str, fn: Callable[[], object], keep: bool, new: bool) -> tuple[object, float]:
        t0 = time.perf_counter()
        result = call(name, fn)
        sync()
        elapsed = time.perf_counter() - t0
        if keep:
            if new:
                times[name].append(elapsed)
            else:
                times[name][-1] += elapsed
        return result, elapsed

    steps = 3 if quick else max(5, repeats)
    pending: PendingStats | None = None
    default_pending: PendingStats | None = None
    for i in range(steps + 1):
        sync()
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        sync()
        probe_time = timed(DEFAULT, default.before_step, bool(i), True)[1]
        for name, variant in variants.items():
            probe_time += timed(name, variant.before_step, bool(i), True)[1]
        t0 = time.perf_counter()
        optimizer.step()
        sync()
        opt_time = time.perf_counter() - t0
        for name, variant in variants.items():
            if isinstance(variant, UpdateProbe):
                previous = pending
                result, elapsed = timed(name, variant.after_step_deferred, bool(i), False)
                pending = result  # type: ignore[assignment]
                probe_time += elapsed
                if previous is not None:  # the callback's sender thread does this, a step later
                    probe_time += timed("sender read", previous.result, bool(i), True)[1]
            else:
                probe_time += timed(name, variant.after_step, bool(i), False)[1]
        previous = default_pending
        result, elapsed = timed(DEFAULT, default.after_step_deferred, bool(i), False)
        default_pending = result  # type: ignore[assignment]
        probe_time += elapsed
        if previous is not None:  # finished during this step's forward and backward
            t0 = time.perf_counter()
            previous.result()
            probe_time += time.perf_counter() - t0
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step warms up allocations and is dropped
            times["step"].append(time.perf_counter() - start - probe_time)
            times["optimizer.step()"].append(opt_time)
    if default_pending is not None:
        default_pending.result()
    step = statistics.median(times["step"])
    opt = statistics.median(times["optimizer.step()"])
    beside = (_slowdown_beside(model, params, 5 if quick else 15)
              if default.in_background else None)
    default.close()
    rows = [["training step (no probe; default probe's kernel beside it)", fmt_time(step),
             "", "", "", "", ""],
            ["optimizer.step() AdamW (fused)", fmt_time(opt), f"{opt / step:.2%}", "", "", "",
             ""]]
    for name in [DEFAULT, *variants]:
        cost = statistics.median(times[name])
        best = min(times[name])
        label = f"{name} [{default_path if name == DEFAULT else variants[name].path}]" \
            if name in (DEFAULT, INLINE) else name  # type: ignore[union-attr]
        if cuda:
            label += f" ({syncs[name] / steps:.1f} syncs/step)"
        if name == DEFAULT and beside is not None:
            cost += max(beside[0], 0.0)  # what the kernel beside it takes from training
            best += max(beside[0], 0.0)
        budget = (f"<= {STEP_BUDGET:.2%} and <= {OPTIMIZER_BUDGET}x opt: "
                  + verdict(cost / step <= STEP_BUDGET and cost / opt <= OPTIMIZER_BUDGET
                            and (not cuda or syncs[name] == 0))
                  if name == DEFAULT else "reference")
        rows.append([label, fmt_time(cost), f"{cost / step:.3%}", f"{cost / opt:.2f}x",
                     f"{best / step:.3%}",
                     f"{best / min(times['optimizer.step()']):.2f}x", budget])
        if name == DEFAULT and beside is not None:
            hand = statistics.median(times[name])
            rows.append(["  of which on the training thread (hand-off, settle)", fmt_time(hand),
                         f"{hand / step:.3%}", f"{hand / opt:.2f}x", "", "", ""])
            rows.append([f"  of which the slowdown of training work beside the kernel "
                         f"(1 torch thread; {fmt_time(beside[1])} of layer-0 MLP forwards, "
                         f"{beside[3]} pairs)", fmt_time(beside[0]), f"{beside[0] / step:.3%}",
                         f"{beside[0] / opt:.2f}x", "", "", "the kernel: "
                         f"{fmt_time(statistics.median(times[INLINE]))} inline"])
            rows.append([f"  the same with torch on every core ({beside[4]} threads; not "
                         "counted above)", fmt_time(beside[2]), f"{beside[2] / step:.3%}",
                         f"{beside[2] / opt:.2f}x", "", "", "no spare core: about the "
                         "kernel's own time"])
    if times["sender read"]:
        read = statistics.median(times["sender read"])
        rows.append(["  probe figures read + summarised (sender thread, one step later)",
                     fmt_time(read), f"{read / step:.3%}", "", "", "",
                     "off the training thread"])
    slowdown = max(beside[0], 0.0) if beside is not None else 0.0
    rows += run_peers(model, tokens, optimizer, 1 if quick else 3, dev, slowdown)
    del model, optimizer, variants
    if not cuda:  # the Trainer section runs on the CPU (use_cpu)
        rows += run_trainer(steps, slowdown)
    n_params = sum(p.numel() for p in params)
    table(f"callback cost vs a training step (Qwen3-0.6B shape, {layers} layers, LoRA r16, "
          f"{n_params / 1e6:.1f}M adapter params in {len(params)} tensors, batch 1x{SEQ}, "
          f"{steps} steps, {device}, medians)",
          ["what", "time", "of step", "of opt.step", "best of step", "best of opt.step",
           "budget"], rows)
    return rows


INLINE = "probe, kernel inline"
DEFAULT = "probe, default"


def _slowdown_beside(model: torch.nn.Module, params: list[torch.Tensor],
                     pairs: int) -> tuple[float, float, float, int, int]:
    """What the default probe's background kernel takes from training work running beside it.

    Training-shaped work (forwards of the first decoder layer's MLP, about three times the
    kernel's length, so the kernel runs wholly beside it) is timed with the kernel launched
    just before it and without, alternating. Returns (slowdown with one torch thread, the
    work's time, slowdown with torch on every core, pairs, cores).
    """
    probe = UpdateProbe(params)
    mlp = next(m for name, m in model.named_modules() if name.endswith("layers.0.mlp"))
    x = torch.randn(1, SEQ, 1024, device=params[0].device)

    def work() -> None:
        with torch.no_grad():
            for _ in range(2):
                mlp(x)

    def slowdown() -> tuple[float, float]:
        timings: dict[bool, list[float]] = {True: [], False: []}
        work()
        for i in range(pairs):
            for beside in ((True, False) if i % 2 == 0 else (False, True)):
                probe.before_step()
                with torch.no_grad():
                    torch._foreach_add_(params, 1e-6)  # an update for the kernel to measure
                pending = probe.after_step_deferred() if beside else None
                t0 = time.perf_counter()
                work()
                timings[beside].append(time.perf_counter() - t0)
                if pending is not None:
                    pending.result()
        base = statistics.median(timings[False])
        return statistics.median(timings[True]) - base, base

    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        one, work_time = slowdown()
        torch.set_num_threads(cores)
        every, _ = slowdown()
    finally:
        torch.set_num_threads(threads)
        probe.close()
    return one, work_time, every, pairs, cores


def run_peers(model: torch.nn.Module, tokens: torch.Tensor, optimizer: torch.optim.Optimizer,
              steps: int, device: torch.device, beside: float = 0.0) -> list[list[str]]:
    """What a user would otherwise attach to the same step for weight/update visibility.

    Each monitor runs in blocks of ``steps`` training steps, the blocks interleaved with
    blocks of no monitor at all (twice each); its cost is its median step minus the median
    step without a monitor. Peers that are not installed (the ``bench`` extra) are listed as
    such. wandb runs offline; trainpulse's Trainer callback gets the logged loss, grad norm
    and learning rate each step (it never sees a weight). deadweight's probe is timed on the
    training thread, and ``beside`` (what its background kernel takes from training work
    running beside it, measured by ``_slowdown_beside``) is added.
    """
    import os
    import tempfile
    from types import SimpleNamespace

    cuda = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    logs: dict[str, float] = {}

    def train_step(after_backward: Callable[[], None] | None = None,
                   around_opt: tuple[Callable[[], None], Callable[[], None]] | None = None,
                   ) -> tuple[float, float]:
        """(seconds of the whole step, seconds inside the monitor's explicit calls)."""
        inside = 0.0
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if around_opt:
            t0 = time.perf_counter()
            around_opt[0]()
            inside += time.perf_counter() - t0
        optimizer.step()
        if around_opt:
            t0 = time.perf_counter()
            around_opt[1]()
            inside += time.perf_counter() - t0
        optimizer.zero_grad(set_to_none=True)
        logs.update(loss=float(loss.detach()), grad_norm=float(grad_norm), learning_rate=1e-4)
        if after_backward:
            t0 = time.perf_counter()
            after_backward()
            inside += time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, inside

    monitors: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
    notes: dict[str, str] = {}

    probe = UpdateProbe(params)
    pending: list[PendingStats] = []

    def dw_setup() -> Any:
        def before() -> None:
            probe.before_step()

        def after() -> None:
            result = probe.after_step_deferred()
            if pending:
                pending.pop().result()  # the sender thread's read, charged here too
            if result is not None:
                pending.append(result)

        return (None, (before, after))

    monitors[DW_PEER] = (dw_setup, lambda _: probe.close())

    tmp = tempfile.mkdtemp(prefix="bench-peers-")
    try:
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run = wandb.init(project="deadweight-bench", dir=tmp, mode="offline")

        def watch(freq: int | None) -> Callable[[], Any]:
            def setup() -> Any:
                kwargs = {} if freq is None else {"log_freq": freq}
                wandb.watch(model, log="all", **kwargs)

                def log() -> None:  # what the Trainer's wandb integration does at each log
                    wandb.log(dict(logs))

                return (log, None)
            return setup

        def unwatch(_: Any) -> None:
            wandb.unwatch(model)

        monitors["wandb.watch(log='all') default log_freq (1000), offline"] = (
            watch(None), unwatch)
        monitors["wandb.watch(log='all', log_freq=1), offline"] = (watch(1), unwatch)
    except ImportError:
        run = None
        notes["wandb"] = "not installed (pip install .[bench])"
    try:
        from trainpulse.callbacks import make_hf_callback

        def pulse_setup() -> Any:
            callback = make_hf_callback()
            state = SimpleNamespace(global_step=0)

            def feed() -> None:
                state.global_step += 1
                callback.on_step_begin(None, state, None)
                callback.on_log(None, state, None, logs=dict(logs))
                callback.on_step_end(None, state, None)

            return (feed, None)

        monitors["trainpulse Trainer callback (logs only, sees no weight)"] = (
            pulse_setup, lambda _: None)
    except ImportError:
        notes["trainpulse"] = "not installed (pip install .[bench])"

    baseline: list[float] = []
    steps_with: dict[str, list[float]] = {name: [] for name in monitors}
    inside: dict[str, list[float]] = {name: [] for name in monitors}
    train_step()  # warm-up
    for _ in range(2):
        for name, (setup, teardown) in monitors.items():
            for _ in range(steps):
                baseline.append(train_step()[0])
            handle = setup()
            after, around = handle if isinstance(handle, tuple) else (None, None)
            for _ in range(steps):
                total, spent = train_step(after, around)
                steps_with[name].append(total)
                inside[name].append(spent)
            teardown(handle)
    if run is not None:
        run.finish()
    base = min(baseline)
    noise = statistics.median(baseline) - base
    rows = [[f"peers: step without a monitor (min; median - min = {fmt_time(noise)}, "
             "the noise floor of a difference)", fmt_time(base), "", "", "", "", ""]]
    # deadweight and trainpulse work only in explicit calls: timed directly. wandb.watch works
    # in module hooks inside forward/backward: its cost is the difference of the minima.
    direct = {n for n in monitors if not n.startswith("wandb")}
    cost = {n: (statistics.median(inside[n]) if n in direct else min(v) - base)
            for n, v in steps_with.items()}
    cost[DW_PEER] += beside
    dw = cost[DW_PEER]
    seeing = [c for n, c in cost.items() if n.startswith("wandb")]
    for name, value in cost.items():
        how = "timed directly" if name in direct else "difference of minima"
        ratio = f"{value / dw:.1f}x dw" if dw > 0 else "n/a"
        budget = ("cheapest of those that see weights: " + verdict(all(dw < c for c in seeing))
                  if name.startswith("deadweight") else "reference")
        rows.append([f"peers: {name} ({how})", fmt_time(value), f"{value / base:.3%}", ratio,
                     "", "", budget])
    for name, note in notes.items():
        rows.append([f"peers: {name}", note, "", "", "", "", ""])
    return rows


DW_PEER = "deadweight UpdateProbe (+ its read, + the slowdown beside its kernel)"


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


def run_trainer(steps: int, beside: float = 0.0) -> list[list[str]]:
    """The real DeadweightCallback in a real Trainer, streaming to a real sidecar.

    Its hooks are timed on the training thread; ``beside`` (what the probe's background
    kernel takes from training work running beside it, see ``_slowdown_beside``) is added.
    """
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
        kernel: list[str] = []  # read at train begin: the probe is released at train end

        class Rest(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, *a: object, **k: object) -> None:
                callback.on_train_begin(*a, **k)
                probe = callback._probe
                if probe is None:
                    return
                kernel.append(probe.path)
                before, after = probe.before_step, probe.after_step_deferred

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
                probe.after_step_deferred = timed_after  # type: ignore[method-assign,assignment]

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
        path = kernel[0] if kernel else "?"
    hooks, opt, step = timed.hooks[1:], timed.optimizer[1:], timed.steps[1:]
    h, o, s = statistics.median(hooks), statistics.median(opt), statistics.median(step)
    on_thread = h
    h += beside
    ok = h / s <= STEP_BUDGET and h / o <= OPTIMIZER_BUDGET
    return [
        ["Trainer step (with callback)", fmt_time(s), "", "", "", "", ""],
        ["optimizer.step() AdamW (in Trainer)", fmt_time(o), f"{o / s:.2%}", "", "", "", ""],
        [f"DeadweightCallback per-step hooks + the slowdown beside its kernel [{path}]",
         fmt_time(h), f"{h / s:.3%}", f"{h / o:.2f}x", f"{(min(hooks) + beside) / s:.3%}",
         f"{(min(hooks) + beside) / min(opt):.2f}x",
         f"<= {STEP_BUDGET:.2%} and <= {OPTIMIZER_BUDGET}x opt: {verdict(ok)}"],
        ["  of which the hooks on the training thread", fmt_time(on_thread),
         f"{on_thread / s:.3%}", f"{on_thread / o:.2f}x", "", "", ""],
        ["  of which UpdateProbe", fmt_time(statistics.median(probe_times[1:])),
         f"{statistics.median(probe_times[1:]) / s:.3%}", "", "", "", ""],
    ]
