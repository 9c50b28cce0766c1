"""The healthy matrix: real SFT, DPO and GRPO runs that learn, and no detector says otherwise.

It covers what healthy tiny runs look like and must not alarm on: GRPO loss near 0, step 1 at
lr 0 under warmup, gradient accumulation, weight decay, a saved adapter re-trained (GRPO and
DPO add a "ref" copy), beta 0 and beta > 0, three architectures. The sidecar uses the short
test windows of the failure tests, so the control is at least as strict as the detection.
Only ``no_kl_anchor`` (information) may fire, and only for GRPO with beta 0.
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
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("models")
    return {arch: runs.prepare(folder, arch) for arch in ("qwen2", "llama", "gpt2")}


def _model(setup: str, arch: str, model_dir: Path, adapter_dir: Path) -> tuple[Any, Any]:
    if setup == "adapter":
        return runs.load_adapter(model_dir, adapter_dir, trainable=True), None
    from transformers import AutoModelForCausalLM

    targets = ["c_attn"] if arch == "gpt2" else runs.LORA_TARGETS
    return AutoModelForCausalLM.from_pretrained(model_dir), runs.lora_config(targets)


@pytest.mark.parametrize("name", list(MATRIX))
def test_healthy_run_ends_with_every_detector_at_zero(
    name: str, live: LiveSidecar, models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    case = dict(MATRIX[name])
    kind, arch, setup = case.pop("kind"), case.pop("arch"), case.pop("setup")
    model_dir, adapter_dir = models[arch]
    model, peft_config = _model(setup, arch, model_dir, adapter_dir)
    build = {"sft": runs.sft_trainer, "dpo": runs.dpo_trainer, "grpo": runs.grpo_trainer}[kind]
    trainer = build(model, model_dir, tmp_path, [live.callback(name)],  # type: ignore[operator]
                    steps=8, save_steps=4, peft_config=peft_config, **case)
    trainer.train()
    assert trainer.state.global_step == 8

    run = live.wait_inspected(name, 2)
    allowed = {"no_kl_anchor"} if kind == "grpo" and case.get("beta") == 0.0 else set()
    fired = {k: (f.summary, f.evidence) for k, f in live.fired(name).items()
             if k not in allowed}
    assert fired == {}
    findings = live.findings(name)
    assert not [k for k, f in findings.items() if f.firing]  # every detector at 0 at the end
    assert run.checkpoints_unchanged == 0
    assert len({p.digest for p in run.checkpoints}) == 2
    assert all(p.inspection is not None and p.inspection.lora_b_nonzero_tensors > 0
               for p in run.checkpoints)
    assert len(ALL) == 22
