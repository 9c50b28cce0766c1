"""Faults of a raw loop and of a finite run gone wrong, each a real run with its twin.

Raw loops under ``deadweight.watch`` (``tests/support/loops.py``): no ``optimizer.step()``, no
``zero_grad``, a corrupt batch, a declared-frozen module that trains; a real SFT run whose
learning rate is far too high. Each healthy twin is the same run without the fault.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from deadweight.demo import runs
from tests.support import loops
from tests.support.inprocess_sidecar import InProcessSidecar

NEW = {"no_optimizer_step", "loss_divergence", "grad_norm_spike", "gradient_accumulating",
       "declared_frozen_moved"}


def _silent(live: InProcessSidecar, run_id: str) -> None:
    fired = live.fired(run_id)
    assert not NEW & set(fired), {k: fired[k].summary for k in NEW & set(fired)}


def test_no_optimizer_step_fires_and_the_checkpoint_names_the_loop_step(
        live: InProcessSidecar, tmp_path: Path) -> None:
    loops.run_loop(live, "no-step", step_optimizer=False, steps=12,
                   checkpoint_to=tmp_path / "checkpoint-12")
    loops.wait_ended(live, "no-step")
    run = live.seen("no-step")
    assert run.combined_steps() == []  # the failure is real: no optimizer step ever ran
    finding = live.fired("no-step")["no_optimizer_step"]
    assert finding.step == live.registry.settings.no_step_logs  # the 8th logged step
    assert finding.evidence["last_optimizer_step"] == "0"
    assert "optimizer.step()" in finding.summary
    assert [p.step for p in run.checkpoints] == [12]  # not "checkpoint at step 0"
    loops.run_loop(live, "no-step-twin", steps=12)
    loops.wait_ended(live, "no-step-twin")
    _silent(live, "no-step-twin")


def test_missing_zero_grad_fires_as_accumulating_gradients(live: InProcessSidecar) -> None:
    loops.run_loop(live, "no-zero-grad", zero_grad=False)
    loops.wait_ended(live, "no-zero-grad")
    steps = live.seen("no-zero-grad").combined_steps()
    norms = [p.grad_sq_sum or 0.0 for p in steps]
    assert norms == sorted(norms) and norms[-1] > 9 * norms[0]  # the gradient accumulates
    finding = live.fired("no-zero-grad")["gradient_accumulating"]
    assert finding.incidents == 1  # from its step to the end of the run, without a break
    assert finding.step == live.registry.settings.accumulating_logs + 1
    assert "zero_grad" in finding.summary
    loops.run_loop(live, "zero-grad-twin")
    loops.wait_ended(live, "zero-grad-twin")
    _silent(live, "zero-grad-twin")


def test_corrupt_batch_fires_a_grad_norm_spike_at_its_step(live: InProcessSidecar) -> None:
    loops.run_loop(live, "spike", corrupt_at=9)
    loops.wait_ended(live, "spike")
    finding = live.fired("spike")["grad_norm_spike"]
    assert finding.step == 9 and float(finding.evidence["z_score"]) > 4
    assert not live.findings("spike")["grad_norm_spike"].firing  # it passed with the batch
    loops.run_loop(live, "spike-twin")
    loops.wait_ended(live, "spike-twin")
    _silent(live, "spike-twin")


def test_declared_frozen_module_that_trains_fires(live: InProcessSidecar) -> None:
    loops.run_loop(live, "declared-moves", frozen_modules=["0"])  # declared, never frozen
    loops.wait_ended(live, "declared-moves")
    finding = live.fired("declared-moves")["declared_frozen_moved"]
    assert finding.evidence["trainable_at_begin"] == "2"  # weight and bias of layer 0
    assert finding.step == 0  # at train begin, before the first step moved them
    assert finding.evidence["moved_tensors"] == "2" and finding.evidence["first_moved_step"] == "1"
    loops.run_loop(live, "declared-holds", frozen_modules=["0"], freeze_first=True)
    loops.wait_ended(live, "declared-holds")
    _silent(live, "declared-holds")
    assert live.seen("declared-holds").config["declared_frozen_tensors"] == 2


@pytest.mark.slow
def test_too_high_learning_rate_fires_loss_divergence(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    for run_id, lr in (("diverges", 3.0), ("converges", 2e-4)):
        runs.sft_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir,
                         tmp_path / run_id, [live.callback(run_id)], steps=8, lr=lr,
                         save_steps=100).train()
    losses = [v for _, v in live.seen("diverges").history("loss")]
    assert max(losses) > 20 * losses[0]  # the failure is real, and every loss is finite
    finding = live.fired("diverges")["loss_divergence"]
    assert finding.step <= 4 and float(finding.evidence["ratio"]) > 10
    assert "nonfinite_loss" not in live.fired("diverges")
    _silent(live, "converges")
