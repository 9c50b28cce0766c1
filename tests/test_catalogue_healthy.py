"""The healthy matrix: real runs of every TRL trainer that runs on a CPU (SFT, DPO, GRPO, RLOO,
KTO, Reward, Distillation) that learn, and no detector says otherwise.

It covers what healthy tiny runs look like and must not alarm on: GRPO loss near 0, step 1 at
lr 0 under warmup, gradient accumulation, weight decay, a saved adapter re-trained (GRPO and
DPO add a "ref" copy), beta 0 and beta > 0, three architectures, a bf16 base whose adapter
PEFT keeps in fp32, a reward model whose new head is saved. GRPO/RLOO policies end some of
their completions (a stop-token bias on the tiny model), as a healthy policy does. The sidecar
uses the short test windows of the failure tests, so the control is at least as strict as the
detection. Only ``no_kl_anchor`` (information) may fire, and only for GRPO/RLOO with beta 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from deadweight.sidecar.detectors import ALL
from tests.test_catalogue_harness import LiveSidecar

pytestmark = pytest.mark.slow

MATRIX: dict[str, dict[str, Any]] = {
    "sft-qwen2-lora-warmup-accum-decay": dict(
        kind="sft", arch="qwen2", setup="fresh", warmup=2, gradient_accumulation_steps=2,
        weight_decay=0.1),
    "sft-llama-adapter": dict(kind="sft", arch="llama", setup="adapter"),
    "dpo-qwen2-lora-warmup": dict(kind="dpo", arch="qwen2", setup="fresh", warmup=1),
    "dpo-gpt2-adapter-decay": dict(kind="dpo", arch="gpt2", setup="adapter", weight_decay=0.1),
    "grpo-qwen2-beta0-lora": dict(kind="grpo", arch="qwen2", setup="fresh", beta=0.0),
    "grpo-llama-beta-adapter-accum": dict(
        kind="grpo", arch="llama", setup="adapter", beta=0.04, gradient_accumulation_steps=2),
    "grpo-gpt2-beta-lora-warmup-decay": dict(
        kind="grpo", arch="gpt2", setup="fresh", beta=0.04, warmup=2, weight_decay=0.1),
    "sft-qwen2-bf16-base-fp32-adapter": dict(kind="sft", arch="qwen2", setup="bf16", steps=4,
                                             save_steps=2),
    "rloo-qwen2-lora": dict(kind="rloo", arch="qwen2", setup="fresh", steps=4, save_steps=2),
    "kto-llama-lora": dict(kind="kto", arch="llama", setup="fresh", steps=4, save_steps=2),
    "reward-qwen2-seq-cls": dict(kind="reward", arch="qwen2", setup="seq_cls", steps=4,
                                 save_steps=2),
    "distillation-qwen2-lora": dict(kind="distillation", arch="qwen2", setup="fresh", steps=4,
                                    save_steps=2),
}
BUILDERS = {"sft": runs.sft_trainer, "dpo": runs.dpo_trainer, "grpo": runs.grpo_trainer,
            "rloo": runs.rloo_trainer, "kto": runs.kto_trainer, "reward": runs.reward_trainer,
            "distillation": runs.distillation_trainer}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("models")
    return {arch: runs.prepare(folder, arch) for arch in ("qwen2", "llama", "gpt2")}


def _model(setup: str, arch: str, model_dir: Path, adapter_dir: Path) -> tuple[Any, Any]:
    if setup == "adapter":
        return runs.load_adapter(model_dir, adapter_dir, trainable=True), None
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["c_attn"] if arch == "gpt2" else runs.LORA_TARGETS
    if setup == "seq_cls":
        return runs.reward_model(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                         task_type="SEQ_CLS")
    if setup == "bf16":  # get_peft_model keeps the adapter in fp32 on a bf16 base
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        return get_peft_model(base, runs.lora_config(targets)), None
    return AutoModelForCausalLM.from_pretrained(model_dir), runs.lora_config(targets)


@pytest.mark.parametrize("name", list(MATRIX))
def test_healthy_run_ends_with_every_detector_at_zero(
    name: str, live: LiveSidecar, models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    case = dict(MATRIX[name])
    kind, arch, setup = case.pop("kind"), case.pop("arch"), case.pop("setup")
    steps, save_steps = case.pop("steps", 8), case.pop("save_steps", 4)
    model_dir, adapter_dir = models[arch]
    model, peft_config = _model(setup, arch, model_dir, adapter_dir)
    if kind in ("grpo", "rloo"):
        case.update(runs.terminating(model_dir))
    trainer = BUILDERS[kind](model, model_dir, tmp_path, [live.callback(name)],
                             steps=steps, save_steps=save_steps, peft_config=peft_config, **case)
    trainer.train()
    assert trainer.state.global_step == steps

    run = live.wait_inspected(name, 2)
    beta0 = kind == "rloo" or (kind == "grpo" and case.get("beta") == 0.0)
    allowed = {"no_kl_anchor"} if beta0 else set()
    fired = {k: (f.summary, f.evidence) for k, f in live.fired(name).items()
             if k not in allowed}
    assert fired == {}
    findings = live.findings(name)
    assert not [k for k, f in findings.items() if f.firing]  # every detector at 0 at the end
    assert run.checkpoints_unchanged == 0
    assert len({p.digest for p in run.checkpoints}) == 2
    assert all(p.inspection is not None and p.inspection.moved_modules > 0
               for p in run.checkpoints)
    assert len(ALL) == 32
