"""Healthy runs that once drew a false verdict, judged by what the optimizer really does, each
beside a twin whose failure is real and still fires.

- an Accelerate loop that accumulates 16 micro-batches and logs each one: no
  ``no_optimizer_step`` before its first step is due (1 and 4 too); a loop that never steps
  still fires, against the accumulation the prepared optimizer reported;
- full-batch loops whose grad norm rises for many steps while they learn (a small CNN with
  batch norm and a zero-initialised head, a small MLP classifier leaving its saddle): no
  ``gradient_accumulating``; a loop without ``zero_grad`` still fires
  (``tests/integration/test_loop_faults.py``);
- a LoRA SFT run at lr 20: the absurd learning rate is named (``loss_divergence``), never
  ``gradient_accumulating`` (the Trainer clears gradients itself);
- LoRA SFT with Adafactor's own step size (``relative_step=True, lr=None``, the documented
  recipe): no ``lora_lr_too_low`` from an argument it ignores; AdamW at 1e-6 still fires.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import deadweight
from deadweight.demo import runs
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.loops import wait_ended
from tests.support.realprocs import wait_for

#: Verdicts none of these healthy runs may draw.
FALSE = {"no_optimizer_step", "gradient_accumulating", "lora_lr_too_low", "loss_divergence",
         "grad_norm_spike", "frozen_weights"}


def _silent(live: InProcessSidecar, run_id: str) -> None:
    fired = live.fired(run_id)
    assert not FALSE & set(fired), {k: fired[k].summary for k in FALSE & set(fired)}


def _logged(live: InProcessSidecar, run_id: str, i: int) -> None:
    """A real step takes longer than the sidecar's turn: let it see each log live."""
    wait_for(lambda: (run := live.run(run_id)) is not None and run.log_steps >= i, 15,
             what=f"log {i} of {run_id}")


# -- accumulation under Accelerate -------------------------------------------------------------


def _accelerate_loop(live: InProcessSidecar, run_id: str, accumulation: int, micro_batches: int,
                     step: bool = True) -> None:
    """The loop Accelerate documents: ``accumulate`` skips the real step until the window is
    full; the loop logs every micro-batch."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, optimizer = accelerator.prepare(net, optimizer)
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(8, 4, generator=generator)
    with deadweight.watch(net, optimizer, run_id=run_id, address=live.address) as monitor:
        for i in range(1, micro_batches + 1):
            x = torch.randn(16, 8, generator=generator)
            with accelerator.accumulate(net):
                loss = torch.nn.functional.mse_loss(net(x), x @ target)
                accelerator.backward(loss)
                if step:
                    optimizer.step()
                optimizer.zero_grad()
            monitor.log(i, loss=loss)
            _logged(live, run_id, i)
    wait_ended(live, run_id)


def test_accumulating_loop_is_judged_against_its_accumulation(live: InProcessSidecar) -> None:
    for accumulation in (16, 4, 1):
        run_id = f"accumulate-{accumulation}"
        _accelerate_loop(live, run_id, accumulation, micro_batches=40)
        run = live.seen(run_id)
        assert run.config["optimizer_accumulation_steps"] == accumulation  # told at start
        assert [p.step for p in run.combined_steps()] == list(range(1, 40 // accumulation + 1))
        _silent(live, run_id)
    # the same loop that never steps: it fires, at twice the accumulation it reported
    _accelerate_loop(live, "accumulate-16-never-steps", 16, micro_batches=34, step=False)
    run = live.seen("accumulate-16-never-steps")
    assert run.combined_steps() == []
    finding = live.fired("accumulate-16-never-steps")["no_optimizer_step"]
    assert finding.step == 32 and finding.evidence["accumulation_steps"] == "16"
    assert "accumulates 16 micro-batches" in finding.summary


# -- grad norms that rise in healthy runs ------------------------------------------------------


def _full_batch_loop(live: InProcessSidecar, run_id: str, net: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                     steps: int = 36) -> None:
    """A plain classifier loop on one fixed batch, as small experiments train."""
    with deadweight.watch(net, optimizer, run_id=run_id, address=live.address) as monitor:
        for i in range(1, steps + 1):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf)
            optimizer.step()
            monitor.log(i, loss=loss, grad_norm=norm)
            _logged(live, run_id, i)
    wait_ended(live, run_id)


def _cnn_run(live: InProcessSidecar, run_id: str) -> None:
    """A small CNN with batch norm, its head zero-initialised, SGD with momentum."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 4))
    with torch.no_grad():
        net[9].weight.zero_()
        net[9].bias.zero_()
    generator = torch.Generator().manual_seed(3)
    prototypes = torch.randn(4, 1, 12, 12, generator=generator)
    y = torch.randint(0, 4, (128,), generator=generator)
    x = prototypes[y] + 0.8 * torch.randn(128, 1, 12, 12, generator=generator)
    _full_batch_loop(live, run_id, net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                     x, y, steps=40)


def _mlp_run(live: InProcessSidecar, run_id: str) -> None:
    """A small MLP classifier, initialised small (it starts near a saddle), Adam."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 5))
    with torch.no_grad():
        net[4].weight.zero_()
        for p in net.parameters():
            p.mul_(0.1)
    generator = torch.Generator().manual_seed(2)
    centres = torch.randn(5, 20, generator=generator) * 2
    y = torch.randint(0, 5, (256,), generator=generator)
    x = centres[y] + torch.randn(256, 20, generator=generator)
    _full_batch_loop(live, run_id, net, torch.optim.Adam(net.parameters(), lr=1e-3), x, y)


def _longest_rise(values: list[float]) -> tuple[int, int]:
    """(length, end index) of the longest run of strict rises."""
    best, end, length = 0, 0, 0
    for i in range(1, len(values)):
        length = length + 1 if values[i] > values[i - 1] else 0
        if length > best:
            best, end = length, i
    return best, end


@pytest.mark.parametrize("script", ["cnn", "mlp"])
def test_rising_grad_norm_of_a_learning_run_is_no_accumulation(
        live: InProcessSidecar, script: str) -> None:
    run_id = f"rising-{script}"
    {"cnn": _cnn_run, "mlp": _mlp_run}[script](live, run_id)
    run = live.seen(run_id)
    norms = [v for _, v in run.history("grad_norm")]
    losses = [v for _, v in run.history("loss")]
    # the shape that drew the false verdict: the grad norm rose for at least 6 steps to 3x
    # the run's smallest, while the loss fell
    rise, end = _longest_rise(norms)
    assert rise >= 6 and norms[end] >= 3 * min(norms)
    assert losses[end] < losses[end - rise]
    _silent(live, run_id)


# -- Trainer runs: the learning rate the optimizer really steps with -------------------------


def _sft(live: InProcessSidecar, model_dir: Path, folder: Path, run_id: str, lr: float,
         steps: int = 8, adafactor: dict[str, Any] | None = None) -> None:
    """A LoRA SFT run; with ``adafactor``, the optimizer transformers documents for it
    (``relative_step=True, lr=None`` with its ``AdafactorSchedule``) handed to the trainer."""
    from peft import get_peft_model

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    extra: dict[str, Any] = {"peft_config": runs.lora_config()}
    if adafactor is not None:
        from transformers.optimization import Adafactor, AdafactorSchedule

        model = get_peft_model(model, extra.pop("peft_config"))
        optimizer = Adafactor([p for p in model.parameters() if p.requires_grad], lr=None,
                              relative_step=True, **adafactor)
        extra["optimizers"] = (optimizer, AdafactorSchedule(optimizer))
    trainer = runs.sft_trainer(model, model_dir, folder / run_id, [live.callback(run_id)],
                               steps=steps, lr=lr, save_steps=100, **extra)
    trainer.train()
    wait_ended(live, run_id)


@pytest.mark.slow
def test_absurd_learning_rate_is_named_and_no_zero_grad_is_blamed(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    _sft(live, model_dir, tmp_path, "lora-lr-20", lr=20.0)
    run = live.seen("lora-lr-20")
    steps = run.combined_steps()
    # the failure is real: every weight moves by more than 1 a step and the loss never improves
    assert steps[0].update_norm / math.sqrt(steps[0].optimizer_params) > 1
    losses = [v for _, v in run.history("loss")]
    assert min(losses[1:]) >= losses[0]
    fired = live.fired("lora-lr-20")
    assert "gradient_accumulating" not in fired  # the Trainer clears gradients itself
    divergence = fired["loss_divergence"]
    assert "learning rate is far too high" in divergence.summary
    assert float(divergence.evidence["update_rms"]) > 1
    # its healthy twin
    _sft(live, model_dir, tmp_path, "lora-lr-2e-4", lr=2e-4)
    _silent(live, "lora-lr-2e-4")


@pytest.mark.slow
def test_adafactor_own_step_size_is_not_judged_by_the_ignored_argument(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    variants = {"adafactor-relative": {"scale_parameter": False, "warmup_init": False},
                "adafactor-scaled-warmup": {"scale_parameter": True, "warmup_init": True}}
    for run_id, options in variants.items():
        # SFTConfig's own default learning rate (2e-5) is below the LoRA floor: ignored here
        _sft(live, model_dir, tmp_path, run_id, lr=2e-5, adafactor=options)
        run = live.seen(run_id)
        assert run.config["optimizer_relative_step"] == 1 and "optimizer_lr" not in run.config
        assert all(p.update_norm > 0 for p in run.combined_steps()[1:])  # it learns
        _silent(live, run_id)
    # AdamW really stepping at 1e-6 under LoRA still fires
    _sft(live, model_dir, tmp_path, "adamw-1e-6", lr=1e-6, steps=3)
    low = live.fired("adamw-1e-6")["lora_lr_too_low"]
    assert low.evidence["learning_rate"] == "1e-06"


# -- fixes that follow the evidence ------------------------------------------------------------


@pytest.mark.slow
def test_adapter_frozen_after_a_trainable_load_is_not_told_to_load_trainable(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from peft import prepare_model_for_kbit_training

    from deadweight.sidecar.detectors import fix_sentence

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)  # is_trainable=True
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert not any(p.requires_grad for p in model.parameters())  # the failure is real
    runs.sft_trainer(model, model_dir, tmp_path / "kbit", [live.callback("kbit-after-load")],
                     steps=3, save_steps=100).train()
    wait_ended(live, "kbit-after-load")
    empty = live.fired("kbit-after-load")["empty_optimizer"]
    assert empty.evidence["adapter_made_trainable"] == "true"
    fix = fix_sentence("empty_optimizer", empty.evidence)
    assert "prepare_model_for_kbit_training" in fix and "is_trainable=True)` (or" not in fix
    # the classic cause still gets the classic fix
    loaded = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    runs.sft_trainer(loaded, model_dir, tmp_path / "plain", [live.callback("loaded-frozen")],
                     steps=3, save_steps=100).train()
    wait_ended(live, "loaded-frozen")
    classic = live.fired("loaded-frozen")["empty_optimizer"]
    assert classic.evidence["adapter_made_trainable"] == "false"
    assert "is_trainable=True" in fix_sentence("empty_optimizer", classic.evidence)


@pytest.mark.slow
def test_head_saved_in_full_without_a_resize_is_not_told_about_resizing(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from peft import LoraConfig

    from deadweight.sidecar.detectors import fix_sentence

    model_dir, _ = tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    runs.sft_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir,
                     tmp_path / "head", [live.callback("head-in-full")], steps=2, save_steps=2,
                     peft_config=config).train()
    run = live.wait_inspected("head-in-full", 1)
    assert run.start is not None
    assert run.start.preflight.embedding_rows == run.start.preflight.base_vocab_size
    bloat = live.fired("head-in-full")["adapter_bloat"]  # the head is saved in full: real
    assert bloat.evidence["embeddings_resized"] == "false"
    fix = fix_sentence("adapter_bloat", bloat.evidence)
    assert "resize" not in fix.split(":")[1] and "modules_to_save" in fix
