"""What trains against what is saved and expected: real SFT runs on the tiny model.

The failing run re-enables gradients on the whole base after ``get_peft_model`` (a user bug):
the base moves, the checkpoint holds only the adapter, and ``base_weights_trained`` fires at
train begin. Its twin (the same LoRA run) and a run with ``modules_to_save`` stay silent;
the trainable band fires only outside the band the user set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

import deadweight
from deadweight.demo import runs
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.loops import wait_ended

pytestmark = pytest.mark.slow


def _lora(model_dir: Path, **config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM", **config))


def _train(live: InProcessSidecar, run_id: str, model: Any, model_dir: Path, out: Path,
           **callback: Any) -> Any:
    trainer = runs.sft_trainer(model, model_dir, out, [live.callback(run_id, **callback)],
                               steps=4, save_steps=4)
    trainer.train()
    return trainer


def test_base_trained_in_a_lora_run_fires_and_the_save_drops_it(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    model = _lora(model_dir)
    for p in model.parameters():
        p.requires_grad_(True)  # the bug: the whole base trains again
    before = model.base_model.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    _train(live, "base-trained", model, model_dir, tmp_path)
    after = model.base_model.model.model.layers[0].mlp.up_proj.weight.detach()
    assert not torch.equal(before, after)  # the base really trained
    with safe_open(str(tmp_path / "checkpoint-4" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in k for k in names)  # and the save keeps only the adapter
    finding = live.fired("base-trained")["base_weights_trained"]
    assert finding.step == 0 and finding.severity == "critical"
    total = int(finding.evidence["model_params"])
    assert int(finding.evidence["optimizer_params"]) == total  # 100% trains
    assert int(finding.evidence["unsaved_trainable_params"]) == total - int(
        finding.evidence["adapter_params"])
    assert "embed_tokens" in finding.evidence["unsaved_examples"]
    assert "re-freeze the base" in finding.summary


def test_lora_twin_and_modules_to_save_stay_silent(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    _train(live, "lora-twin", _lora(model_dir), model_dir, tmp_path / "a",
           expected_trainable_pct=(0.5, 10.0))
    _train(live, "lora-head", _lora(model_dir, modules_to_save=["lm_head"], bias="all"),
           model_dir, tmp_path / "b")
    for run_id in ("lora-twin", "lora-head"):
        fired = live.fired(run_id)
        assert not {"base_weights_trained", "trainable_out_of_band"} & set(fired), fired
        config = live.seen(run_id).config
        assert config["unsaved_trainable_params"] == 0 and config["model_params"] > 0


def test_trainable_band_fires_outside_the_users_band(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny
    # a full fine-tune told to expect a LoRA-sized share (the environment's band)
    monkeypatch.setenv("DEADWEIGHT_EXPECTED_TRAINABLE_PCT", "0.5-5")
    _train(live, "band-full", AutoModelForCausalLM.from_pretrained(model_dir), model_dir,
           tmp_path / "a")
    finding = live.fired("band-full")["trainable_out_of_band"]
    assert finding.evidence["trainable_pct"] == "100" and finding.step == 0
    assert "base_weights_trained" not in live.fired("band-full")  # not a PEFT run
    # the same full fine-tune told the truth stays silent
    _train(live, "band-ok", AutoModelForCausalLM.from_pretrained(model_dir), model_dir,
           tmp_path / "b", expected_trainable_pct=(95.0, 100.0))
    assert "trainable_out_of_band" not in live.fired("band-ok")


def test_an_optimizer_over_every_parameter_of_a_lora_model_trains_only_the_adapter(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """``AdamW(model.parameters())`` on a PEFT model, as many scripts build it: the frozen base
    sits in the optimizer but gets no gradient, so it never moves. Healthy: no verdict at all.
    Its twin, the base's gradients re-enabled, still fires critical (the test above)."""
    model_dir, _ = tiny
    model = _lora(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
    base = model.base_model.model.model.layers[0].mlp.up_proj.weight
    before = base.detach().clone()
    trainer = runs.sft_trainer(model, model_dir, tmp_path, [live.callback("all-params")],
                               steps=4, save_steps=4, optimizers=(optimizer, None))
    trainer.train()
    wait_ended(live, "all-params")
    assert torch.equal(before, base.detach())  # the base did not train
    run = live.seen("all-params")
    assert run.start is not None and run.start.membership.optimizer_params == int(
        run.config["model_params"])  # the whole model is in the optimizer
    assert run.config["unsaved_trainable_params"] == 0
    fired = {k: f.summary for k, f in live.fired("all-params").items()
             if f.severity in ("warning", "critical")}
    assert fired == {}, fired


def test_base_trained_in_a_raw_loop_is_a_warning(live: InProcessSidecar, tiny: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    """In a raw loop the script may save the full model itself (nothing lost): the same
    unfrozen base is a warning there, critical only where a Trainer saves through the adapter."""
    model_dir, _ = tiny
    model = _lora(model_dir)
    for p in model.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator()
                        .manual_seed(0))
    with deadweight.watch(model, optimizer, run_id="base-raw", address=live.address) as monitor:
        for step in range(1, 4):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss)
    wait_ended(live, "base-raw")
    finding = live.fired("base-raw")["base_weights_trained"]
    assert finding.severity == "warning" and finding.step == 0
    assert "re-freeze the base" in finding.summary
