"""The healthy matrix: real runs of every TRL trainer that runs on a CPU (SFT, DPO, GRPO, RLOO,
KTO, Reward, Distillation) that learn, and no detector says otherwise.

It covers what healthy tiny runs look like and must not alarm on: GRPO loss near 0, step 1 at
lr 0 under warmup, gradient accumulation, weight decay, a saved adapter re-trained (GRPO and
DPO add a "ref" copy), beta 0 and beta > 0, three architectures, a bf16 base whose adapter
PEFT keeps in fp32, a reward model whose new head is saved, and new tokens added the correct
way. The sidecar uses the short test windows of the failure tests, and a stall window
of seconds, so the control is at least as strict as the detection: a detector that fired
wrongly on any of these runs fails its test. Only ``no_kl_anchor`` (information) may fire, and
only for GRPO/RLOO with beta 0.

GRPO and RLOO run on models that learned to emit eos (``runs.terminating_model``): their completions
end on their own, so completion length and entropy really move and a length or entropy
detector that fired on noise would show here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from deadweight.sidecar.detectors.spec import HEALTHY_MATRIX
from deadweight.sidecar.model.run_state import RunState
from tests.support.inprocess_sidecar import TEST_SETTINGS, InProcessSidecar

pytestmark = pytest.mark.slow

#: stalled_seconds and stalled_step_seconds for the matrix: a few seconds, against steps of
#: about 0.2 s, so a stall verdict on a healthy run would show (the defaults are 300/1800 s).
STALL_SECONDS = 3.0

#: Four completions per step: two alone make a 3-log mean length too noisy to be a control.
GRPO_SHAPE: dict[str, Any] = dict(num_generations=4, per_device_train_batch_size=4)

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
#: Trainers that sample completions: they run on the models that learned to end them.
SAMPLING = ("grpo", "rloo")

Models = dict[tuple[str, bool], tuple[Path, Path]]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    """The module's sidecar: the failure tests' windows, and a stall window of seconds."""
    settings = replace(TEST_SETTINGS, stalled_seconds=STALL_SECONDS,
                       stalled_step_seconds=STALL_SECONDS)
    sidecar = InProcessSidecar.live(tmp_path_factory.mktemp("healthy"), settings)
    yield sidecar
    sidecar.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """(arch, terminating) -> (model_dir, adapter_dir); GRPO uses the terminating models."""
    folder = tmp_path_factory.mktemp("models")
    return {(arch, terminating): runs.prepare(folder, arch, terminating=terminating)
            for arch in ("qwen2", "llama", "gpt2") for terminating in (False, True)}


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


def _series(run: RunState, key: str) -> list[float]:
    return [v for _, v in run.history(key)]


def assert_completions_move(run: RunState) -> None:
    """The GRPO control is not vacuous: completions end on their own (not all clipped at the
    length limit) and completion length and entropy change from step to step."""
    clipped = _series(run, "completions/clipped_ratio")
    terminated = _series(run, "completions/mean_terminated_length")
    lengths = _series(run, "completions/mean_length")
    entropy = _series(run, "entropy")
    assert len(clipped) == len(lengths) == len(entropy) == 8
    assert min(clipped) < 1.0 and max(terminated) > 0.0, (clipped, terminated)
    assert max(lengths) - min(lengths) >= 1.0, lengths  # whole tokens, not rounding noise
    assert max(entropy) - min(entropy) > 0.01, entropy  # a random tiny model: < 0.003


def assert_silent(live: InProcessSidecar, run_id: str, allowed: set[str]) -> None:
    """No detector outside allowed fired at any point of the run, and none fires at its end."""
    fired = {k: (f.summary, f.evidence) for k, f in live.fired(run_id).items()
             if k not in allowed}
    assert fired == {}
    assert not [k for k, f in live.findings(run_id).items() if f.firing and k not in allowed]


def test_the_specs_name_this_matrix() -> None:
    """Every spec's ``checked_against`` names this matrix (``spec.MATRIX``): its recipes are
    the ones the specs list."""
    assert tuple(MATRIX) == HEALTHY_MATRIX


@pytest.mark.parametrize("name", list(MATRIX))
def test_healthy_run_ends_with_every_detector_at_zero(
    name: str, live: InProcessSidecar, models: Models, tmp_path: Path
) -> None:
    case = dict(MATRIX[name])
    kind, arch, setup = case.pop("kind"), case.pop("arch"), case.pop("setup")
    steps, save_steps = case.pop("steps", 8), case.pop("save_steps", 4)
    model_dir, adapter_dir = models[arch, kind in SAMPLING]
    model, peft_config = _model(setup, arch, model_dir, adapter_dir)
    shape = GRPO_SHAPE if kind == "grpo" else {}
    trainer = BUILDERS[kind](model, model_dir, tmp_path, [live.callback(name)],
                             steps=steps, save_steps=save_steps, peft_config=peft_config,
                             **shape, **case)
    trainer.train()
    assert trainer.state.global_step == steps

    run = live.wait_inspected(name, 2)
    beta0 = kind == "rloo" or (kind == "grpo" and case.get("beta") == 0.0)
    allowed = {"no_kl_anchor"} if beta0 else set()
    assert_silent(live, name, allowed)
    if kind == "grpo":
        assert_completions_move(run)
    assert run.checkpoints_unchanged == 0
    assert len({p.digest for p in run.checkpoints}) == 2
    assert all(p.inspection is not None and p.inspection.moved_modules > 0
               for p in run.checkpoints)


@pytest.mark.parametrize(("arch", "saved_by"), [("qwen2", "trainable_token_indices"),
                                                ("gpt2", "modules_to_save")])
def test_new_tokens_trained_on_purpose_are_not_embedding_resized(
    arch: str, saved_by: str, live: InProcessSidecar, models: Models, tmp_path: Path
) -> None:
    """Tokens added + ``resize_token_embeddings``, the new rows trained through PEFT: the
    correct resize. embedding_resized must stay silent (the failing case, a resize that
    trains nothing, is ``test_f5_resized_embedding_bloats_the_adapter``)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = models[arch, False]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<|tool|>", "<|result|>"], special_tokens=True)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    base_vocab = model.config.vocab_size
    model.resize_token_embeddings(len(tokenizer))
    embedding = "wte" if arch == "gpt2" else "embed_tokens"
    new_ids = tokenizer.convert_tokens_to_ids(["<|tool|>", "<|result|>"])
    trains_rows: dict[str, Any] = (
        {"trainable_token_indices": {embedding: new_ids}} if saved_by == "trainable_token_indices"
        else {"modules_to_save": [embedding]})
    config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                        target_modules=["c_attn"] if arch == "gpt2" else runs.LORA_TARGETS,
                        **trains_rows)
    run_id = f"resize-{arch}-{saved_by}"
    trainer = runs.sft_trainer(model, tokenizer_dir, tmp_path / "out", [live.callback(run_id)],
                               steps=2, save_steps=2, peft_config=config)
    trainer.train()

    run = live.wait_inspected(run_id, 1)
    assert run.start is not None
    facts = run.start.preflight
    assert (facts.embedding_rows, facts.base_vocab_size) == (len(tokenizer), base_vocab)
    assert facts.embedding_rows > facts.base_vocab_size  # the resize the detector looks at
    assert facts.embedding_module == embedding
    # PEFT saves a resized embedding with the adapter whichever way it trains: the adapter
    # does carry it, so adapter_bloat is right to say so; nothing else may fire.
    assert_silent(live, run_id, {"adapter_bloat"})
    bloat = live.fired(run_id)["adapter_bloat"]
    assert embedding in bloat.evidence["non_adapter_tensors"]
