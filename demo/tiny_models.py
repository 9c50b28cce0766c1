"""Tiny causal LMs and a byte-level BPE tokenizer built locally, so nothing comes from a hub.

Both are saved to a folder and loaded back with ``from_pretrained``, as a user would load a
real checkpoint; a fresh model is ~100k parameters and trains a step in milliseconds on a CPU.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the", "a", "model", "learns", "weights", "adapter", "frozen", "step", "loss", "reward",
    "gradient", "token", "train", "run", "one", "two", "three", "four", "five", "six", "seven",
    "eight", "nine", "ten", "cat", "dog", "sun", "moon", "red", "blue", "green", "fast",
    "slow", "question", "answer", "yes", "no", "because", "and", "or", "not", "is", "was",
    "will", "can",
)

ARCHITECTURES = ("gpt2", "llama", "qwen2")


def sample_lines(n: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences for tokenizer training and tiny datasets."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def build_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """Train a ~320-token byte-level BPE with eos/pad and a ChatML template; save it to folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample_lines(400), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def model_config(arch: str, vocab_size: int, pad_id: int, eos_id: int) -> object:
    """A two-layer, hidden-64 config of the named architecture."""
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=2, n_positions=128,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        )
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")


def build_model(folder: Path, arch: str = "qwen2", seed: int = 0) -> Path:
    """Create a tiny model and its tokenizer in folder; return the folder for from_pretrained."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = model_config(arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    AutoConfig.from_pretrained(folder)  # fail here, not in a trainer, if the save is unreadable
    return folder
