"""Output heads (score, classifier) that a saved adapter must carry to be usable.

A causal LM loaded as ``AutoModelForSequenceClassification`` gets a newly initialised head.
PEFT adds it to ``modules_to_save`` only for ``task_type="SEQ_CLS"``; otherwise the head stays
frozen and random, or trains and is not saved: either way the saved adapter reloads with a new
random head. Whether a head is new is read from the base checkpoint's safetensors header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from .preflight import config_file

#: Attribute names transformers and TRL give output heads.
HEAD_NAMES = ("score", "classifier", "v_head", "qa_outputs")


@dataclass(frozen=True)
class HeadFacts:
    heads: list[str] = field(default_factory=list)
    new_heads: list[str] = field(default_factory=list)
    saved_heads: list[str] = field(default_factory=list)
    trainable_heads: list[str] = field(default_factory=list)


def _base_weight_names(path: str) -> set[str] | None:
    """Tensor names of the base checkpoint (local folder or hub cache), None if unknown."""
    config = config_file(path) if path else None
    if config is None:
        return None
    folder = config.parent
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text()).get("weight_map", {}))
        single = folder / "model.safetensors"
        if not single.is_file():
            return None
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return set(handle.keys())
    except (OSError, ValueError):
        return None


def check(model: Any) -> HeadFacts | None:
    """Head facts for a PEFT model (None for a plain model: every head trains and saves)."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not peft_config:
        return None
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    heads = [n for n in HEAD_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)]
    if not heads:
        return None
    config = next(iter(peft_config.values()))
    to_save = set(getattr(config, "modules_to_save", None) or [])
    known = _base_weight_names(str(getattr(config, "base_model_name_or_path", "") or ""))
    new = [h for h in heads if known is not None and not any(
        k.split(".")[0] == h or f".{h}." in f".{k}" for k in known)]
    trainable = [h for h in heads if any(p.requires_grad for p in getattr(base, h).parameters())]
    return HeadFacts(heads=heads, new_heads=new, saved_heads=[h for h in heads if h in to_save],
                     trainable_heads=trainable)
