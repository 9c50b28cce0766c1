"""Which parameters should train, which ones the optimizer really holds, and how they group.

Membership is decided by object identity (``id(param)``), never by names or ``requires_grad``
alone: a PEFT adapter loaded without ``is_trainable=True`` has an empty optimizer, and GRPO's
reference pass later flips ``requires_grad`` back on, so a flag check after the fact is fooled.

Under sharding (see ``layout``) each rank counts and watches what it holds: the local shard of
a DTensor, the local piece of an FSDP1 parameter; empty shards are skipped. DeepSpeed's
optimizer holds partitions, so its own map from parameters to partitions stands in for the
identity check, and where no map can be read, membership is "unknown", never "empty".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import layout as layouts
from ..update.stats import TensorGroup


@dataclass(frozen=True)
class AdapterShare:
    """One named adapter's tensors and how many of them the optimizer holds."""

    name: str
    tensors: int
    params: int
    in_optimizer_tensors: int
    active: bool


@dataclass
class Membership:
    """The watched tensors and the optimizer's view of them, at train begin."""

    optimizer_tensors: int
    optimizer_params: int
    trainable_tensors: int
    trainable_params: int
    trainable_not_in_optimizer_tensors: int
    adapter_tensors: int
    adapter_params: int
    adapters: list[AdapterShare]
    watched_names: list[str]
    #: What this rank holds of each watched parameter (a local shard under sharding).
    watched: list[torch.Tensor]
    groups: list[TensorGroup]
    #: How many leading elements of each watched tensor are the parameter's (None: all; a
    #: ZeRO-3 partition ends in padding that holds no weight, ``layout.local_numel``).
    watched_lengths: list[int | None] = field(default_factory=list)
    #: Parameters outside the optimizer: a grad on any of them is work thrown away.
    outside_optimizer: list[torch.nn.Parameter] = field(default_factory=list)
    #: How membership was decided: ``layout.IDENTITY``, ``FLAT``, ``ENGINE`` or ``UNKNOWN``.
    layout: str = layouts.IDENTITY
    #: Elements of the tensors the optimizer really steps, per dtype (under DeepSpeed its fp32
    #: partitions, not the model's bf16 parameters): bf16/fp16 weights without an fp32 master
    #: copy lose every update smaller than half a unit in the last place.
    optimizer_params_by_dtype: dict[str, int] = field(default_factory=dict)


def optimizer_param_ids(optimizer: Any) -> set[int]:
    """Identities of every tensor in every param group of the optimizer."""
    if optimizer is None:
        return set()
    groups = getattr(optimizer, "param_groups", None) or []
    return {id(p) for group in groups for p in group.get("params", [])}


def stepped_by_dtype(optimizer: Any) -> dict[str, int]:
    """Elements per dtype of the tensors the optimizer updates, as this rank holds them.

    Counted on what the optimizer really steps, not on the model parameters it covers: a
    DeepSpeed ZeRO or bf16/fp16 optimizer steps fp32 flat partitions (master copies) and
    copies them back into the model's bf16 parameters, so small updates add up there even
    though the model's copy keeps most elements in any one step. A dtype held with no element
    on this rank (an empty partition) is still listed, with 0.
    """
    by_dtype: dict[str, int] = {}
    seen: set[int] = set()
    for tensor in layouts.stepped_tensors(optimizer):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        key = str(tensor.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + layouts.local_numel(tensor)
    return by_dtype


def adapter_names(model: Any) -> list[str]:
    """Names of the PEFT adapters on model (empty for a plain model)."""
    config = getattr(model, "peft_config", None)
    return list(config) if isinstance(config, dict) else []


def active_adapters(model: Any) -> list[str]:
    """The adapters PEFT currently routes through (none for a model without adapters)."""
    if not adapter_names(model):
        return []  # a plain model's active_adapters() raises instead of answering
    try:
        active = getattr(model, "active_adapters", None)
        if callable(active):  # older PEFT (and transformers' own integration) use a method
            active = active()
    except (ValueError, ImportError):
        return []
    if isinstance(active, str):
        return [active]
    if isinstance(active, Iterable):
        return [str(a) for a in active]
    single = getattr(model, "active_adapter", None)
    return [single] if isinstance(single, str) else []


def adapter_of(name: str, adapters: list[str]) -> str | None:
    """The adapter a parameter name belongs to (``...lora_A.<adapter>.weight``), if any."""
    parts = name.split(".")
    for adapter in adapters:
        if adapter in parts[:-1]:
            return adapter
    return None


#: Where prompt-learning methods (prompt, prefix, p-tuning) keep their trainable tensors.
PROMPT_ENCODER = "prompt_encoder"


def adapter_layer_names(model: Any) -> frozenset[str]:
    """The attribute names under which the model's PEFT layers hold adapter tensors.

    Each PEFT tuner layer class lists its own (``adapter_layer_names``: ``lora_A``, ``ia3_l``,
    ``hada_w2_b``, ...; DoRA adds ``lora_magnitude_vector`` per layer), so any method PEFT
    has is named by PEFT itself; prompt-learning methods keep theirs in the prompt encoder.
    """
    if not adapter_names(model):
        return frozenset()
    names: set[str] = set()
    for module in model.modules():
        layer_names = getattr(module, "adapter_layer_names", None)
        if isinstance(layer_names, tuple) and hasattr(module, "active_adapters"):
            names.update(str(n) for n in layer_names)
    if isinstance(getattr(model, PROMPT_ENCODER, None), torch.nn.Module):
        names.add(PROMPT_ENCODER)
    return frozenset(names)


#: Where DoRA keeps its per-row magnitude: one value per output row, of the size of a row
#: norm, so a step moves it by far less of its own value than it moves lora_A/B.
DORA_MAGNITUDE = "lora_magnitude_vector"


def module_kind(name: str, adapter: str | None,
                layer_names: frozenset[str] = frozenset()) -> str:
    """A low-cardinality label for a parameter: the module it sits in (``q_proj``, ``lm_head``).

    An adapter tensor (``...q_proj.ia3_l.default``) is labelled with the module it adapts;
    a prompt encoder's tensors with ``prompt_encoder``. A DoRA magnitude is a kind of its own
    (``q_proj.lora_magnitude_vector``): counted with its module's lora_A/B, a magnitude left
    in bf16 (trl#7268) whose every element stays put is a tenth of the group's elements.
    """
    parts = [p for p in name.split(".")[:-1] if p != adapter]
    for i, part in enumerate(parts):
        if part in layer_names or part.startswith("lora_") or part == "modules_to_save":
            module = parts[i - 1] if i > 0 else part
            return f"{module}.{DORA_MAGNITUDE}" if part == DORA_MAGNITUDE else module
    return parts[-1] if parts else name


def measure(model: torch.nn.Module, optimizer: Any,
            layout: layouts.Layout | None = None) -> Membership:
    """Compare the model's parameters with the optimizer's, by identity (or the engine's map)."""
    layout = layout or layouts.recognise(model, optimizer)
    unknown = layout.membership == layouts.UNKNOWN
    if layout.membership == layouts.ENGINE:
        in_optimizer = set(layout.engine_params)
    else:
        in_optimizer = optimizer_param_ids(layouts.inner_optimizer(optimizer))
    adapters = adapter_names(model)
    active = set(active_adapters(model))
    watched: list[torch.Tensor] = []
    watched_lengths: list[int | None] = []
    watched_names: list[str] = []
    outside: list[torch.nn.Parameter] = []
    per_adapter: dict[str, list[torch.nn.Parameter]] = {a: [] for a in adapters}
    adapter_index: dict[str, list[int]] = {a: [] for a in adapters}
    kind_index: dict[str, list[int]] = {}
    trainable_tensors = trainable_params = trainable_outside = 0
    layer_names = adapter_layer_names(model)
    seen: set[int] = set()
    outer = layouts.root_prefix(model)
    for wrapped_name, param in model.named_parameters():
        if id(param) in seen:  # tied weights appear once
            continue
        seen.add(id(param))
        name = layouts.clean_name(wrapped_name, outer)
        adapter = adapter_of(name, adapters)
        local = layouts.local_view(param)
        held = layouts.local_numel(param)
        if adapter is not None:
            per_adapter[adapter].append(param)
        if param.requires_grad:
            trainable_tensors += 1
            trainable_params += held
            trainable_outside += id(param) not in in_optimizer and not unknown
        if id(param) not in in_optimizer and not unknown:
            outside.append(param)
        if held == 0:  # an empty shard (or a pad alone): nothing of it lives on this rank
            continue
        if id(param) in in_optimizer or param.requires_grad or adapter is not None:
            index = len(watched)
            watched.append(local)
            watched_lengths.append(held if held < local.numel() else None)
            watched_names.append(name)
            if adapter is not None:
                adapter_index[adapter].append(index)
            if adapter is None or adapter in active or id(param) in in_optimizer \
                    or param.requires_grad:  # not a reference copy (GRPO's "ref" adapter)
                kind_index.setdefault(module_kind(name, adapter, layer_names), []).append(index)
    groups = [TensorGroup(a, "adapter", idx) for a, idx in adapter_index.items() if idx]
    groups += [TensorGroup(k, "module", idx) for k, idx in sorted(kind_index.items())]
    shares = [
        AdapterShare(
            name=a,
            tensors=len(ps),
            params=sum(layouts.local_numel(p) for p in ps),
            in_optimizer_tensors=sum(id(p) in in_optimizer for p in ps),
            active=a in active,
        )
        for a, ps in per_adapter.items()
    ]
    held_params = [p for _, p in model.named_parameters() if id(p) in in_optimizer]
    held_by_id = {id(p): layouts.local_numel(p) for p in held_params}
    return Membership(
        optimizer_tensors=0 if unknown else len(in_optimizer),
        optimizer_params=sum(held_by_id.values()),
        trainable_tensors=trainable_tensors,
        trainable_params=trainable_params,
        trainable_not_in_optimizer_tensors=trainable_outside,
        adapter_tensors=sum(s.tensors for s in shares),
        adapter_params=sum(s.params for s in shares),
        adapters=shares,
        watched_names=watched_names,
        watched=watched,
        groups=groups,
        watched_lengths=watched_lengths,
        outside_optimizer=outside,
        layout=layout.membership,
        optimizer_params_by_dtype=stepped_by_dtype(optimizer),
    )


def grads_outside_optimizer(outside: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(tensors, elements this rank holds) among params outside the optimizer with a gradient."""
    with_grad = [p for p in outside if p.grad is not None]
    return len(with_grad), sum(layouts.local_numel(p) for p in with_grad)
