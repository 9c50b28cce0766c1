"""What will train against what will be saved, and the parts the user declared frozen.

Three facts the sidecar cannot see from counts alone:

- the parameters the optimizer steps that a PEFT save leaves out (``get_peft_model_state_dict``
  names what the adapter file will hold: the adapter tensors, ``modules_to_save``, trained
  biases; a tensor under an adapter's name counts as saved too): base weights that train in
  such a run are work thrown away at save;
- the trainable fraction against a band the user expects (``expected_trainable_pct``), for
  full fine-tunes and custom setups whose intent no config states;
- modules the user declared frozen (``frozen_modules``): whether the optimizer holds them at
  train begin, and whether any of their tensors moved since (a fixed sample of each).

Measured on unsharded layouts only: a shard's storage is not the tensor a save reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import layout as layouts
from .membership import adapter_names, adapter_of

log = logging.getLogger("deadweight")

#: ``DEADWEIGHT_EXPECTED_TRAINABLE_PCT``: "LOW-HIGH" (percent of the model's parameters).
BAND_ENV = "DEADWEIGHT_EXPECTED_TRAINABLE_PCT"
#: ``DEADWEIGHT_FROZEN_MODULES``: module names, comma-separated (``embed_tokens,layers.0``).
FROZEN_ENV = "DEADWEIGHT_FROZEN_MODULES"
#: Names of unsaved trainable tensors quoted in the verdict.
NAMES_QUOTED = 3
#: Elements of each declared-frozen tensor compared every step, and tensors watched at most.
SAMPLE_ELEMENTS = 64
MAX_FROZEN_TENSORS = 512


def parse_band(text: str) -> tuple[float, float]:
    """``"0.5-3"`` (or ``"0.5:3"``) as (0.5, 3.0); a clear error on anything else."""
    parts = text.replace(":", "-").split("-")
    if len(parts) != 2:
        raise ValueError(f"expected trainable % must read LOW-HIGH (e.g. 0.5-3), got {text!r}")
    low, high = float(parts[0]), float(parts[1])
    if not 0 <= low <= high <= 100:
        raise ValueError(f"expected trainable % needs 0 <= LOW <= HIGH <= 100, got {text!r}")
    return low, high


def resolve_band(band: tuple[float, float] | None) -> tuple[float, float] | None:
    """The band given, else the environment's; a bad environment value is one warning."""
    if band is not None:
        low, high = float(band[0]), float(band[1])
        return parse_band(f"{low}-{high}")
    text = os.environ.get(BAND_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_band(text)
    except ValueError as exc:
        log.warning("deadweight: %s ignored: %s", BAND_ENV, exc)
        return None


def resolve_frozen(modules: Sequence[str] | None) -> tuple[str, ...]:
    """The declared-frozen module names given, else the environment's."""
    if modules is not None:
        return tuple(str(m).strip() for m in modules if str(m).strip())
    return tuple(m.strip() for m in os.environ.get(FROZEN_ENV, "").split(",") if m.strip())


def _saved_storage(model: Any) -> set[int] | None:
    """Storage addresses of what a PEFT save writes (None: not a PEFT model, or unreadable)."""
    if not isinstance(getattr(model, "peft_config", None), dict):
        return None
    try:
        from peft import get_peft_model_state_dict
    except ImportError:
        return None
    saved: set[int] = set()
    for name in model.peft_config:
        for tensor in get_peft_model_state_dict(model, adapter_name=name).values():
            if isinstance(tensor, torch.Tensor):
                saved.add(tensor.data_ptr())
    return saved


def _declared(name: str, modules: tuple[str, ...]) -> bool:
    """Whether a parameter name lies in a declared module (a path prefix, or a name inside)."""
    dotted = f".{name}"
    return any(name.startswith(f"{m}.") or f".{m}." in dotted for m in modules)


def start_facts(model: Any, optimizer: Any, layout: layouts.Layout,
                band: tuple[float, float] | None,
                frozen_modules: tuple[str, ...]) -> tuple[dict[str, float], dict[str, str]]:
    """Numeric and text facts for the RunStart's config (empty under sharding)."""
    numbers: dict[str, float] = {}
    text: dict[str, str] = {}
    if band is not None:
        numbers["expected_trainable_pct_low"], numbers["expected_trainable_pct_high"] = band
    if layout.sharded or not isinstance(model, torch.nn.Module):
        return numbers, text
    in_optimizer = {id(p) for group in getattr(layouts.inner_optimizer(optimizer),
                                               "param_groups", None) or []
                    for p in group.get("params", [])}
    saved = _saved_storage(model)
    adapters = adapter_names(model)
    total = unsaved = unsaved_tensors = declared = declared_trained = 0
    names: list[str] = []
    outer = layouts.root_prefix(model)
    seen: set[int] = set()
    for wrapped, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        name = layouts.clean_name(wrapped, outer)
        # a frozen parameter an optimizer holds (built over model.parameters()) gets no
        # gradient and is never updated: it does not train
        trains = id(param) in in_optimizer and param.requires_grad
        # an adapter's own tensor is saved even when PEFT saves a value computed from it
        # (prompt learning saves the prompt encoder's output, not its weights)
        if saved is not None and trains and param.data_ptr() not in saved \
                and adapter_of(name, adapters) is None:
            unsaved += param.numel()
            unsaved_tensors += 1
            if len(names) < NAMES_QUOTED:
                names.append(name)
        if frozen_modules and _declared(name, frozen_modules):
            declared += 1
            declared_trained += trains or param.requires_grad
    numbers["model_params"] = float(total)
    if saved is not None:
        numbers["unsaved_trainable_params"] = float(unsaved)
        numbers["unsaved_trainable_tensors"] = float(unsaved_tensors)
        text["unsaved_trainable_examples"] = ",".join(names)
    if frozen_modules:
        numbers["declared_frozen_tensors"] = float(declared)
        numbers["declared_frozen_trainable_tensors"] = float(declared_trained)
        text["declared_frozen_modules"] = ",".join(frozen_modules)
    return numbers, text


@dataclass
class FrozenWatch:
    """A fixed sample of every declared-frozen tensor, compared with its train-begin value."""

    tensors: list[torch.Tensor]
    indices: list[torch.Tensor]
    initial: list[torch.Tensor]

    @classmethod
    def build(cls, model: Any, frozen_modules: tuple[str, ...],
              layout: layouts.Layout) -> FrozenWatch | None:
        if not frozen_modules or layout.sharded or not isinstance(model, torch.nn.Module):
            return None
        outer = layouts.root_prefix(model)
        tensors: list[torch.Tensor] = [
            p for n, p in model.named_parameters()
            if p.numel() > 0 and _declared(layouts.clean_name(n, outer), frozen_modules)]
        tensors = tensors[:MAX_FROZEN_TENSORS]
        indices = [torch.linspace(0, p.numel() - 1, min(SAMPLE_ELEMENTS, p.numel()),
                                  device=p.device).long() for p in tensors]
        with torch.no_grad():
            initial = [p.detach().reshape(-1)[i].clone()
                       for p, i in zip(tensors, indices, strict=True)]
        return cls(tensors, indices, initial)

    def moved(self) -> int:
        """Declared-frozen tensors whose sample differs from train begin (one host read)."""
        if not self.tensors:
            return 0
        with torch.no_grad():
            flags = [torch.ne(p.detach().reshape(-1)[i], first).any()
                     for p, i, first in zip(self.tensors, self.indices, self.initial,
                                                         strict=True)]
            return int(torch.stack(flags).sum().item())


def grad_sq_sum(params: list[torch.Tensor]) -> torch.Tensor | float:
    """Sum of squared gradients of params, left on the device (read by the sender thread)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)
    return torch.stack([n.double() if n.device.type == "cpu" else n.float()
                        for n in norms]).pow(2).sum()
