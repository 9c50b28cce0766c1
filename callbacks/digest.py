"""Byte digests of adapter tensors, comparable with the sidecar's digests of saved files.

The digest of a tensor is xxh3-128 over its raw bytes in the saved dtype, so an adapter in
memory and the ``adapter_model.safetensors`` written from it hash the same. Equal digests mean
identical bytes; norms or float sums would miss small updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import xxhash

#: PEFT's ``save_embedding_layers``: whether a save writes the embedding layers too ("auto":
#: when they are targeted or were resized). A digest must follow the save it describes.
EmbeddingLayers = bool | Literal["auto"]


@dataclass(frozen=True)
class AdapterDigest:
    """Per-tensor digests (name -> hex) and one digest over all of them in name order."""

    combined: str = ""
    tensors: dict[str, str] = field(default_factory=dict)
    bytes: int = 0


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of the tensor's bytes (moved to the CPU, made contiguous)."""
    data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
    return str(xxhash.xxh3_128_hexdigest(data.data))


def combine(tensors: dict[str, str]) -> str:
    """One digest over name:digest pairs, independent of dict order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(f"{name}:{tensors[name]}\n".encode())
    return h.hexdigest()


def adapter_state(model: Any, embedding_layers: EmbeddingLayers = "auto"
                  ) -> dict[str, torch.Tensor]:
    """The tensors PEFT would save for the active adapter, under their saved names, by a
    ``save_pretrained(dir, save_embedding_layers=embedding_layers)``."""
    if not isinstance(getattr(model, "peft_config", None), dict):
        return {}
    from peft import get_peft_model_state_dict

    active = getattr(model, "active_adapter", "default")
    name = active if isinstance(active, str) else "default"
    state: dict[str, torch.Tensor] = get_peft_model_state_dict(
        model, adapter_name=name, save_embedding_layers=embedding_layers)
    return state


def digest_adapter(model: Any, embedding_layers: EmbeddingLayers = "auto") -> AdapterDigest:
    """Digest of the adapter that a save of model would write now (empty for plain models),
    with the save's ``save_embedding_layers`` (a head or embedding saved or left out)."""
    state = adapter_state(model, embedding_layers)
    tensors = {name: tensor_digest(t) for name, t in state.items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    return AdapterDigest(combine(tensors), tensors, size)
