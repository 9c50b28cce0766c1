"""Facts read at train begin that expose a broken setup before the first step.

The callback only gathers facts (config values, requested vs matched target modules, embedding
rows vs the base vocabulary); the sidecar decides what they mean.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .membership import active_adapters, adapter_layer_names

#: Numeric trainer settings worth reporting when the config has them.
NUMERIC_KEYS = (
    "learning_rate", "warmup_steps", "warmup_ratio", "weight_decay", "max_steps",
    "num_train_epochs", "gradient_accumulation_steps", "per_device_train_batch_size",
    "max_grad_norm", "beta", "num_generations", "max_completion_length", "temperature",
    "epsilon", "logging_steps", "save_steps", "seed", "max_length",
)
TEXT_KEYS = ("lr_scheduler_type", "optim", "loss_type", "save_strategy", "logging_strategy")
VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate", "deadweight")

log = logging.getLogger("deadweight")

#: Base model paths whose config could not be read, each warned about once per process.
_UNREADABLE: set[str] = set()


@dataclass
class PreflightFacts:
    """Model facts for the RunStart message."""

    is_peft: bool = False
    peft_type: str = ""
    requested_target_modules: list[str] = field(default_factory=list)
    target_modules_regex: str = ""
    unmatched_target_modules: list[str] = field(default_factory=list)
    embedding_rows: int = 0
    base_vocab_size: int = 0
    tokenizer_size: int = 0
    modules_to_save: list[str] = field(default_factory=list)
    active_adapter: str = ""
    lora_rank: int = 0
    adapter_layer_names: list[str] = field(default_factory=list)
    embedding_module: str = ""
    trainable_token_modules: list[str] = field(default_factory=list)


def trainer_name(args: Any) -> str:
    """``GRPOConfig`` -> ``GRPOTrainer``; plain ``TrainingArguments`` -> ``Trainer``."""
    name = type(args).__name__
    if name.endswith("Config"):
        return name[: -len("Config")] + "Trainer"
    return "Trainer"


def numeric_config(args: Any, max_steps: int) -> dict[str, float]:
    """The numeric settings present on args, plus the resolved warmup and total steps."""
    config: dict[str, float] = {}
    for key in NUMERIC_KEYS:
        value = getattr(args, key, None)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            config[key] = float(value)
    config["total_steps"] = float(max_steps)
    get_warmup = getattr(args, "get_warmup_steps", None)
    if callable(get_warmup) and max_steps > 0:
        config["resolved_warmup_steps"] = float(get_warmup(max_steps))
    return config


def text_config(args: Any) -> dict[str, str]:
    """The textual settings present on args."""
    return {k: str(getattr(args, k)) for k in TEXT_KEYS if getattr(args, k, None) is not None}


def versions() -> dict[str, str]:
    """Installed versions of the libraries whose behaviour the verdicts depend on."""
    found: dict[str, str] = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _suffix_matched(target: str, matched: Iterable[str]) -> bool:
    return any(m == target or m.endswith("." + target) for m in matched)


#: A group of plain alternatives in a target_modules regex: ``(q_proj|v_proj)``.
_ALTERNATIVES = re.compile(r"\(((?:\?:)?[\w.]+(?:\|[\w.]+)+)\)")


def regex_alternatives(pattern: str) -> list[str]:
    """The plain module names a target_modules regex lists as alternatives, if any."""
    names: list[str] = []
    for group in _ALTERNATIVES.findall(pattern):
        names += [n for n in group.removeprefix("?:").split("|") if n]
    return names


def _unmatched_regex(pattern: str, matched: Iterable[str]) -> list[str]:
    """Alternatives of the regex that no targeted module ends with (PEFT fullmatches names)."""
    matched = list(matched)
    return [n for n in regex_alternatives(pattern) if not _suffix_matched(n, matched)]


def config_file(path: str) -> Path | None:
    """The base model's config.json: a local folder, else the local hub cache (no download).

    None when it cannot be found or even looked at (a folder the job may not enter, a name too
    long for the file system): the facts read from it go missing, the run stays monitored.
    """
    try:
        return _find_config(path)
    except OSError as error:
        if path not in _UNREADABLE:
            _UNREADABLE.add(path)
            log.warning("deadweight: the base model's config.json under %r cannot be read (%s); "
                        "the facts read from it are left out", path, error)
        return None


def _find_config(path: str) -> Path | None:
    local = Path(path) / "config.json"
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(path, "config.json")
    except ValueError:  # not a repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def _base_vocab_size(path: str) -> int:
    """vocab_size from the base model's config.json (local folder or hub cache), 0 if unknown."""
    config = config_file(path) if path else None
    if config is None:
        return 0
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return 0
    text = data.get("text_config")
    value = data.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else 0)
    return int(value or 0)


#: AdaLoRA's schedule, reported in the numeric config (``adalora_tinit``, ...).
ADALORA_KEYS = ("tinit", "tfinal", "deltaT", "total_step", "init_r", "target_r")


def adapter_numbers(model: Any) -> dict[str, float]:
    """Numeric settings of the active adapter that verdicts need: whether it was made
    trainable (``inference_mode``) and AdaLoRA's schedule."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not peft_config:
        return {}
    active = active_adapters(model)
    config = peft_config.get(active[0] if active else "") or next(iter(peft_config.values()))
    numbers: dict[str, float] = {}
    mode = getattr(config, "inference_mode", None)
    if isinstance(mode, bool):  # off: built by get_peft_model or loaded with is_trainable=True
        numbers["adapter_inference_mode"] = float(mode)
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "ADALORA":
        return numbers
    for key in ADALORA_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[f"adalora_{key}"] = float(value)
    return numbers


def adalora_allocated(model: Any) -> bool | None:
    """Whether AdaLoRA's rank allocator has set a rank_pattern (None for other methods)."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict):
        return None
    for config in peft_config.values():
        if str(getattr(config, "peft_type", "")).split(".")[-1] == "ADALORA":
            return getattr(config, "rank_pattern", None) is not None
    return None


def _module_name(model: Any, layer: Any) -> str:
    """The short name (``embed_tokens``, ``wte``) under which model holds layer, or ""."""
    named = getattr(model, "named_modules", None)
    if layer is None or not callable(named):
        return ""
    for name, module in named():
        if module is layer:
            return str(name).rsplit(".", 1)[-1]
    return ""


def _trainable_token_modules(config: Any, embedding_module: str) -> list[str]:
    """Modules whose chosen token rows train (PEFT ``trainable_token_indices``): a plain list
    of indices applies to the input embedding, a dict names its modules."""
    indices = getattr(config, "trainable_token_indices", None)
    if isinstance(indices, dict):
        return sorted(str(k) for k, v in indices.items() if v)
    if indices:
        return [embedding_module or "embedding"]
    return []


def gather(model: Any, processing_class: Any = None) -> PreflightFacts:
    """Read PEFT and embedding facts from model (any model; PEFT fields stay empty otherwise)."""
    facts = PreflightFacts()
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        layer = embeddings()
        weight = getattr(layer, "weight", None)
        if weight is not None:
            facts.embedding_rows = int(weight.shape[0])
        facts.embedding_module = _module_name(model, layer)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer is not None and hasattr(tokenizer, "__len__"):
        facts.tokenizer_size = len(tokenizer)
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not peft_config:
        return facts
    facts.is_peft = True
    facts.adapter_layer_names = sorted(adapter_layer_names(model))
    active = active_adapters(model)
    facts.active_adapter = active[0] if active else next(iter(peft_config))
    config = peft_config.get(facts.active_adapter) or next(iter(peft_config.values()))
    facts.peft_type = str(getattr(config, "peft_type", "")).split(".")[-1]
    facts.lora_rank = int(getattr(config, "r", 0) or 0)
    facts.modules_to_save = sorted(getattr(config, "modules_to_save", None) or [])
    facts.trainable_token_modules = _trainable_token_modules(config, facts.embedding_module)
    facts.base_vocab_size = _base_vocab_size(str(getattr(config, "base_model_name_or_path", "")))
    targets = getattr(config, "target_modules", None)
    matched = getattr(getattr(model, "base_model", None), "targeted_module_names", []) or []
    if isinstance(targets, str):
        facts.target_modules_regex = targets
        facts.unmatched_target_modules = _unmatched_regex(targets, matched)
    elif targets:
        facts.requested_target_modules = sorted(str(t) for t in targets)
        facts.unmatched_target_modules = [
            t for t in facts.requested_target_modules if not _suffix_matched(t, matched)
        ]
    return facts
