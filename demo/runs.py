"""Real TRL training runs on tiny local models: the silent failures and their healthy controls.

Shared by ``deadweight demo`` and the tests, so both exercise the same trainers the same way.
Every run is small enough for a CPU: a step takes tens of milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every run here is on the CPU (use_cpu): say so, or DeepSpeed warns when TRL imports it.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from .tiny_models import build_model, sample_lines

LORA_TARGETS = ["q_proj", "v_proj"]


def lora_config(targets: Sequence[str] = LORA_TARGETS, r: int = 4) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM")


def prepare(folder: Path, arch: str = "qwen2", terminating: bool = False) -> tuple[Path, Path]:
    """A tiny model and an initial LoRA adapter saved next to it: (model_dir, adapter_dir).

    ``terminating=True`` gives the model a few SFT steps on short lines ending in eos first
    (see ``terminating_model``), so GRPO completions end on their own.
    """
    suffix = f"{arch}-terminating" if terminating else arch
    model_dir = (terminating_model(folder, arch) if terminating
                 else build_model(folder / f"model-{arch}", arch))
    adapter_dir = folder / f"adapter-{suffix}"
    if not (adapter_dir / "adapter_model.safetensors").exists():
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        targets = ["c_attn"] if arch == "gpt2" else LORA_TARGETS
        torch.manual_seed(1)
        peft_model = get_peft_model(base, lora_config(targets))
        with torch.no_grad():  # a trained-looking adapter: lora_B not all zero
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
        peft_model.save_pretrained(adapter_dir)
    return model_dir, adapter_dir


#: Words per line of the eos-teaching data: short enough that a continuation ends well inside
#: the GRPO completion budget (8 tokens), long enough that lengths vary.
TERMINATING_WORDS = (1, 4)


def terminating_model(folder: Path, arch: str = "qwen2") -> Path:
    """A tiny model that emits eos: full SFT on short lines (eos appended), saved once.

    A random tiny model almost never samples eos, so every GRPO completion is clipped at the
    length limit and completion length and entropy stay flat; a healthy GRPO control on such a
    model cannot show a length or entropy detector firing wrongly. Cached in folder.
    """
    model_dir = folder / f"model-{arch}-terminating"
    if (model_dir / "config.json").exists():
        return model_dir
    base_dir = folder / f"model-{arch}"
    if not (base_dir / "config.json").exists():
        build_model(base_dir, arch)
    low, high = TERMINATING_WORDS
    lines = [" ".join(line.split()[: low + i % (high - low + 1)])
             for i, line in enumerate(sample_lines(128, seed=7))]
    trainer = sft_trainer(AutoModelForCausalLM.from_pretrained(base_dir), base_dir,
                          folder / f"sft-{arch}-terminating", [], steps=30, lr=5e-3,
                          save_steps=1000, per_device_train_batch_size=8, save_strategy="no",
                          texts=lines)  # SFTTrainer appends eos to every line
    trainer.train()
    trainer.model.save_pretrained(model_dir)
    trainer.processing_class.save_pretrained(model_dir)
    return model_dir


def load_adapter(model_dir: Path, adapter_dir: Path, trainable: bool) -> Any:
    """The adapter on its base, as a user loads it; ``trainable=False`` is the F1 mistake."""
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that varies with the completion, so GRPO has advantages to learn from.

    Length alone ties often on 8-token completions; the characters break the tie.
    """
    return [len(str(c)) / 10.0 + sum(map(ord, str(c))) % 101 / 1000.0 for c in completions]


def common_args(steps: int, warmup: int, lr: float, save_steps: int) -> dict[str, Any]:
    return dict(
        max_steps=steps,
        warmup_steps=warmup,
        learning_rate=lr,
        logging_steps=1,
        save_steps=save_steps,
        save_strategy="steps",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )


def _trainer(trainer_cls: Any, config_cls: Any, model: Any, model_dir: Path,
             output_dir: Path, callbacks: list[Any], dataset: Dataset, *, steps: int, lr: float,
             save_steps: int, config: dict[str, Any], overrides: dict[str, Any],
             warmup: int = 0, tokenizer: Any = None, **trainer_kwargs: Any) -> Any:
    """One TRL trainer on the tiny model: its config (builder defaults, then the shared
    arguments, then the caller's overrides) and the tokenizer saved beside the model."""
    args = config_cls(output_dir=str(output_dir),
                      **{**config, **common_args(steps, warmup, lr, save_steps), **overrides})
    return trainer_cls(model=model, args=args, train_dataset=dataset,
                       processing_class=tokenizer or AutoTokenizer.from_pretrained(model_dir),
                       callbacks=callbacks, **trainer_kwargs)


def grpo_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    beta: float = 0.01,
    steps: int = 6,
    warmup: int = 0,
    lr: float = 2e-4,
    save_steps: int = 3,
    reward_funcs: Any = length_reward,
    peft_config: LoraConfig | None = None,
    **overrides: Any,
) -> GRPOTrainer:
    """A GRPOTrainer with 2 generations of at most 8 tokens: about 0.1 s a step on a CPU."""
    shape = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8)
    dataset = Dataset.from_dict({"prompt": sample_lines(32, seed=3)})
    trainer: GRPOTrainer = _trainer(
        GRPOTrainer, GRPOConfig, model, model_dir, output_dir, callbacks, dataset, steps=steps,
        warmup=warmup, lr=lr, save_steps=save_steps, config={**shape, "beta": beta},
        overrides=overrides, reward_funcs=reward_funcs, peft_config=peft_config)
    return trainer


def sft_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    steps: int = 6,
    warmup: int = 0,
    lr: float = 2e-4,
    save_steps: int = 3,
    peft_config: LoraConfig | None = None,
    tokenizer: Any = None,
    data_collator: Any = None,
    texts: list[str] | None = None,
    rows: dict[str, list[str]] | None = None,
    optimizers: tuple[Any, Any] = (None, None),
    **overrides: Any,
) -> SFTTrainer:
    """An SFTTrainer on generated sentences (or texts, or rows such as prompt/completion or
    messages), 32 tokens at most; ``optimizers``: the run's own (optimizer, scheduler)."""
    dataset = Dataset.from_dict(rows or {"text": texts or sample_lines(64, seed=4)})
    trainer: SFTTrainer = _trainer(
        SFTTrainer, SFTConfig, model, model_dir, output_dir, callbacks, dataset, steps=steps,
        warmup=warmup, lr=lr, save_steps=save_steps, tokenizer=tokenizer,
        config={"max_length": 32, "per_device_train_batch_size": 2}, overrides=overrides,
        peft_config=peft_config, data_collator=data_collator, optimizers=optimizers)
    return trainer


def preference_rows(n: int, seed: int = 5) -> dict[str, list[str]]:
    """Prompt/chosen/rejected triples: the chosen answer repeats the prompt's first word."""
    prompts = sample_lines(n, seed=seed)
    answers = sample_lines(2 * n, seed=seed + 1)
    return {
        "prompt": prompts,
        "chosen": [f" {p.split()[0]} {a}" for p, a in zip(prompts, answers[:n], strict=True)],
        "rejected": [f" {a}" for a in answers[n:]],
    }


def dpo_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    beta: float = 0.1,
    steps: int = 6,
    warmup: int = 0,
    lr: float = 2e-4,
    save_steps: int = 3,
    peft_config: LoraConfig | None = None,
    rows: dict[str, list[str]] | None = None,
    **overrides: Any,
) -> DPOTrainer:
    """A DPOTrainer on generated preference pairs, 64 tokens at most."""
    # at max_length 32 some generated prompts fill it and DPO drops their rows
    config = {"beta": beta, "per_device_train_batch_size": 2, "max_length": 64}
    trainer: DPOTrainer = _trainer(
        DPOTrainer, DPOConfig, model, model_dir, output_dir, callbacks,
        Dataset.from_dict(rows or preference_rows(32)), steps=steps, warmup=warmup, lr=lr,
        save_steps=save_steps, config=config, overrides=overrides, peft_config=peft_config)
    return trainer


def collapsing_pairs(n: int = 16) -> dict[str, list[str]]:
    """Pairs whose rejected answer extends the chosen one: pushing the pair apart lowers the
    likelihood of both (the DPO likelihood collapse), while the margin grows."""
    return {
        "prompt": ["the model learns"] * n,
        "chosen": [" yes no yes"] * n,
        "rejected": [" yes no yes no yes"] * n,
    }


class AdaloraAllocator(TrainerCallback):  # type: ignore[misc]
    """What an AdaLoRA run needs and no trainer does: ``update_and_allocate`` after each
    optimizer step, while the gradients are still there."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kwargs: Any) -> None:
        model.base_model.update_and_allocate(state.global_step + 1)


def terminating(model_dir: Path, bias: float = 4.0) -> dict[str, Any]:
    """GRPO generation settings under which a tiny random policy ends some completions.

    A random tiny model almost never samples its stop token within a few tokens, so every
    completion is cut (``completions/clipped_ratio`` 1); a healthy policy ends its answers.
    Biasing the stop token's logit gives the tiny model that property.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return {"generation_kwargs": {"sequence_bias": [[[tokenizer.eos_token_id], bias]]}}


def reward_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    steps: int = 6,
    lr: float = 2e-4,
    save_steps: int = 3,
    peft_config: Any = None,
    **overrides: Any,
) -> Any:
    """A RewardTrainer (sequence-classification head) on the generated preference pairs."""
    from trl import RewardConfig, RewardTrainer

    return _trainer(
        RewardTrainer, RewardConfig, model, model_dir, output_dir, callbacks,
        Dataset.from_dict(preference_rows(32)), steps=steps, lr=lr, save_steps=save_steps,
        config={"per_device_train_batch_size": 2, "max_length": 128}, overrides=overrides,
        peft_config=peft_config)


def reward_model(model_dir: Path) -> Any:
    """The tiny causal LM loaded with a new, randomly initialised one-logit score head."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)


def rloo_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    beta: float = 0.0,
    steps: int = 4,
    lr: float = 2e-4,
    save_steps: int = 2,
    peft_config: Any = None,
    **overrides: Any,
) -> Any:
    """An RLOOTrainer shaped like ``grpo_trainer``: 2 generations of at most 8 tokens."""
    from trl import RLOOConfig, RLOOTrainer

    shape = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8)
    return _trainer(
        RLOOTrainer, RLOOConfig, model, model_dir, output_dir, callbacks,
        Dataset.from_dict({"prompt": sample_lines(32, seed=3)}), steps=steps, lr=lr,
        save_steps=save_steps, config={**shape, "beta": beta}, overrides=overrides,
        reward_funcs=length_reward, peft_config=peft_config)


def kto_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    steps: int = 4,
    lr: float = 2e-4,
    save_steps: int = 2,
    peft_config: Any = None,
    **overrides: Any,
) -> Any:
    """A KTOTrainer on the preference pairs unpaired: desirable and undesirable completions."""
    from trl import KTOConfig, KTOTrainer

    pairs = preference_rows(16)
    rows = {"prompt": pairs["prompt"] * 2, "completion": pairs["chosen"] + pairs["rejected"],
            "label": [True] * 16 + [False] * 16}
    return _trainer(
        KTOTrainer, KTOConfig, model, model_dir, output_dir, callbacks, Dataset.from_dict(rows),
        steps=steps, lr=lr, save_steps=save_steps,
        config={"per_device_train_batch_size": 4, "max_length": 64}, overrides=overrides,
        peft_config=peft_config)


def teacher_model(model_dir: Path, seed: int = 1) -> Any:
    """A teacher that knows something the student does not: the tiny model, perturbed.

    The student's own weights teach nothing: a fresh LoRA leaves student == teacher, the
    distillation loss sits at its minimum and every gradient is exactly 0.
    """
    teacher = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return teacher


def distillation_trainer(
    model: Any,
    model_dir: Path,
    output_dir: Path,
    callbacks: list[Any],
    teacher: Any = None,
    steps: int = 4,
    lr: float = 2e-4,
    save_steps: int = 2,
    peft_config: Any = None,
    **overrides: Any,
) -> Any:
    """A DistillationTrainer: the tiny student learns from a teacher on generated prompts."""
    from trl import DistillationConfig, DistillationTrainer

    return _trainer(
        DistillationTrainer, DistillationConfig, model, model_dir, output_dir, callbacks,
        Dataset.from_dict({"prompt": sample_lines(32, seed=3)}), steps=steps, lr=lr,
        save_steps=save_steps,
        config={"per_device_train_batch_size": 2, "max_completion_length": 8},
        overrides=overrides, teacher_model=teacher or teacher_model(model_dir),
        peft_config=peft_config)
