"""How the parameters are laid out across ranks: the wrapper that really runs, and what to measure.

The same model trains replicated (DDP), sharded per parameter (FSDP2: DTensor parameters),
sharded as flat parameters (FSDP1), or partitioned inside the optimizer (DeepSpeed ZeRO). The
probe must know which, from the objects themselves and not from a config that may have fallen
back silently (the Trainer asked for FSDP2 on CPU runs DDP):

- replicated: every rank measures the whole tensor; the sidecar takes one rank.
- sharded: every rank measures its local shard (``to_local()``); empty shards are skipped; the
  sidecar sums squares over ranks.
- DeepSpeed ZeRO: the optimizer holds flat fp32 partitions, not the model's parameters, so
  membership goes through the engine's own mapping (``bit16_groups``) or, where that is absent,
  is reported "unknown" instead of as an empty optimizer.

Recognition goes by class path, so nothing here imports DeepSpeed, Accelerate or Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("deadweight")

#: Wrapper names reported in ``RunStart.wrapper``.
WRAPPERS = ("none", "ddp", "fsdp1", "fsdp2", "deepspeed")

#: How optimizer membership was decided (``OptimizerMembership.layout``).
IDENTITY = "identity"  # the optimizer holds the model's parameters: compared by id
FLAT = "flat"  # FSDP1 without use_orig_params: the optimizer holds FlatParameters
ENGINE = "engine"  # DeepSpeed: the engine's map from parameters to partitions
UNKNOWN = "unknown"  # a partitioning optimizer whose map the probe cannot read


@dataclass(frozen=True)
class Layout:
    """The wrapper in effect and how membership and updates are measured under it."""

    wrapper: str
    sharded: bool
    membership: str
    #: The model parameters a partitioning optimizer covers (ENGINE), by identity.
    engine_params: frozenset[int] = frozenset()


def _class_paths(obj: Any) -> Iterator[str]:
    for cls in type(obj).__mro__:
        yield f"{cls.__module__}.{cls.__qualname__}"


def is_deepspeed(obj: Any) -> bool:
    """An object of a DeepSpeed class (engine, ZeRO optimizer), recognised without importing it."""
    return any(path.startswith("deepspeed.") for path in _class_paths(obj))


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer that really steps, under wrappers (Accelerate, Lightning) that forward to it.

    Step hooks go on this one: a wrapper's ``step`` may skip the real step (gradient
    accumulation, an fp16 overflow) and then no update happened to measure.
    """
    seen: set[int] = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or is_deepspeed(optimizer):
            break
        if not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _is_flat(tensor: Any) -> bool:
    try:
        from torch.distributed.fsdp import FlatParameter
    except ImportError:
        return False
    return isinstance(tensor, FlatParameter)


def _fsdp1_modules(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _world_size() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def _engine_params(optimizer: Any) -> frozenset[int] | None:
    """The model parameters a ZeRO optimizer partitions, from its own groups (ZeRO-1/2:
    ``bit16_groups``; ZeRO-3: ``fp16_groups``); None when it exposes neither."""
    for attr in ("bit16_groups", "fp16_groups"):
        groups = getattr(optimizer, attr, None)
        if isinstance(groups, list | tuple) and groups:
            return frozenset(id(p) for group in groups for p in group)
    return None


#: Where DeepSpeed's optimizers keep the tensors they really step (the master copies of the
#: model's bf16/fp16 parameters, fp32 unless configured otherwise): ZeRO-3, ZeRO-1/2, the
#: bf16 optimizer, the fused and the unfused fp16 optimizers. ZeRO-3 empties its inner
#: optimizer's param groups between steps, so those groups cannot be read instead.
_MASTER_ATTRS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups",
                 "fp32_groups_flat_partition", "fp32_groups_flat", "fp32_groups")


def _tensors(groups: Any) -> list[torch.Tensor]:
    """The tensors of a list of tensors or of a list of lists of tensors."""
    found: list[torch.Tensor] = []
    for item in groups:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, list | tuple):
            found += [t for t in item if isinstance(t, torch.Tensor)]
    return found


def stepped_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors the optimizer really updates: a DeepSpeed optimizer's master copies (its
    fp32 partitions, none of the model's parameters), else the tensors in its param groups."""
    inner = inner_optimizer(optimizer)
    if inner is not None and is_deepspeed(inner):
        for attr in _MASTER_ATTRS:
            groups = getattr(inner, attr, None)
            if isinstance(groups, list | tuple) and (masters := _tensors(groups)):
                return masters
    groups = getattr(inner, "param_groups", None) or []
    return [t for group in groups for t in group.get("params", [])
            if isinstance(t, torch.Tensor)]


def recognise(model: Any, optimizer: Any, outermost: bool = False) -> Layout:
    """The layout of model and optimizer as they are now (call it after wrapping).

    ``outermost``: model is the object that really runs (``watch`` is handed it), so a
    multi-rank run without a DDP wrapper on it is reported as "none", the wrapper really
    found. A Trainer hands its callbacks the module inside its DDP wrapper: there, several
    ranks without a sharding wrapper mean DDP.
    """
    inner = inner_optimizer(optimizer)
    if is_deepspeed(model) or (inner is not None and is_deepspeed(inner)):
        engine_optimizer = getattr(model, "optimizer", None) if is_deepspeed(model) else inner
        stage = 0
        if is_deepspeed(model) and callable(getattr(model, "zero_optimization_stage", None)):
            stage = int(model.zero_optimization_stage())
        mapped = _engine_params(inner) or _engine_params(engine_optimizer)
        if mapped is None:
            return Layout("deepspeed", sharded=stage >= 3, membership=UNKNOWN)
        return Layout("deepspeed", sharded=stage >= 3, membership=ENGINE, engine_params=mapped)
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    if any(is_dtensor(p) for p in params):
        return Layout("fsdp2", sharded=True, membership=IDENTITY)
    fsdp1 = _fsdp1_modules(model) if isinstance(model, torch.nn.Module) else []
    if fsdp1:
        from torch.distributed.fsdp import ShardingStrategy

        sharded = any(m.sharding_strategy != ShardingStrategy.NO_SHARD for m in fsdp1)
        flat = any(_is_flat(p) for p in params)
        return Layout("fsdp1", sharded=sharded and _world_size() > 1,
                      membership=FLAT if flat else IDENTITY)
    if _is_ddp(model) or (_world_size() > 1 and not outermost):
        return Layout("ddp", sharded=False, membership=IDENTITY)
    return Layout("none", sharded=False, membership=IDENTITY)


def local_view(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: the local shard of a DTensor, the partition of a
    ZeRO-3 parameter (whose own tensor is an empty placeholder between uses), else itself."""
    if is_dtensor(param):
        local: torch.Tensor = param.to_local()  # type: ignore[attr-defined]
        return local
    partition = getattr(param, "ds_tensor", None)
    if isinstance(partition, torch.Tensor):
        return partition
    return param


def local_numel(param: torch.Tensor) -> int:
    """Elements of the parameter this rank holds: its local view's, less ZeRO-3's padding.

    DeepSpeed pads each ZeRO-3 parameter to a multiple of the partition count and leaves the
    pad uninitialised (``torch.empty``), so the tail of a partition holds no weight at all:
    read as one, it is garbage (a healthy ZeRO-3 run was once paged ``negligible_updates``
    for a weight norm of 2e10, all of it one such pad).
    """
    local = local_view(param)
    full = getattr(param, "ds_numel", None)
    if local is not getattr(param, "ds_tensor", None) or not isinstance(full, int):
        return local.numel()
    rank = _partition_rank(param)
    size = int(local.numel())
    return size if rank is None else max(0, min(size, int(full) - rank * size))


def _partition_rank(param: torch.Tensor) -> int | None:
    """This rank's place among the ranks a ZeRO-3 parameter is partitioned over."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        rank = int(dist.get_rank(group=getattr(param, "ds_process_group", None)))
    except (RuntimeError, ValueError):
        return None
    return rank if rank >= 0 else None


def requested_wrapper(args: Any) -> str:
    """The wrapper a Trainer config asked for ("" when it asked for none in particular)."""
    if getattr(args, "deepspeed", None):
        return "deepspeed"
    if getattr(args, "fsdp", None):
        config = getattr(args, "fsdp_config", None) or {}
        # transformers 5 defaults to FSDP2 when the config names no version
        version = config.get("version", 2) if isinstance(config, dict) else 2
        return "fsdp1" if int(version or 2) == 1 else "fsdp2"
    return ""


def unwrap_model(model: Any) -> Any:
    """The user's model under DDP, FSDP1 or a DeepSpeed engine (FSDP2 modifies it in place)."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        if not (_is_ddp(model) or is_deepspeed(model) or _fsdp1_modules(model)[:1] == [model]):
            break
        model = inner
    return model


#: Module names wrappers insert into parameter names (FSDP1, activation checkpointing,
#: torch.compile); they say nothing about which layer a parameter is.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str, outer: str = "") -> str:
    """A parameter name as the user's model spells it, wrapper modules left out (``outer``:
    the prefix of a root wrapper, ``module.`` under DDP or a DeepSpeed engine)."""
    if outer and name.startswith(outer):
        name = name[len(outer):]
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def root_prefix(model: Any) -> str:
    """``module.`` when model is a DDP or DeepSpeed wrapper around the user's module."""
    wrapped = _is_ddp(model) or is_deepspeed(model)
    return "module." if wrapped and isinstance(getattr(model, "module", None), torch.nn.Module) \
        else ""
