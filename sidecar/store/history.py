"""The per-step figures the sidecar keeps for ``deadweight report``.

Detectors look at short windows held in memory; a report needs the whole run. This module
says which figures of a step or a log go to the state database, so that the choice is made
once and stays bounded (a run logging hundreds of keys stores only these).

A step is normally kept as its ``StepReport`` (encoded: a microsecond, where building and
encoding its figures took tens at every step received) and turned into figures when the
history is read, which is rare: ``encode_step`` at ingest, ``decode_step`` for the report.
The steps of one received batch go to the database as one value (``pack_steps``): a row
costs about 4 us to insert whatever its size, a step's few hundred bytes a fraction of that.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Sequence

from ...proto import pb
from ..model.step_point import StepPoint, module_label

#: Log keys worth a plot: the loss-only view, the RL signals and DPO's rewards.
LOG_KEYS = frozenset({
    "loss", "grad_norm", "learning_rate", "kl", "reward", "reward_std",
    "frac_reward_zero_std", "entropy", "completions/mean_length",
    "completions/clipped_ratio", "completions/mean_terminated_length",
    "rewards/chosen", "rewards/rejected", "rewards/margins",
    "num_tokens",  # tokens seen so far: a baseline's tokens per step
})
#: Module kinds kept per step (groups of kind "module"); the rest are summed as "other".
MAX_MODULE_KINDS = 24
#: Largest step report kept as it came (a LoRA run's, with a group per module kind and
#: adapter, is a few hundred bytes).
MAX_STORED_STEP_BYTES = 4096
#: A packed step's header: step, time, form (b"R": a StepReport, b"J": figures as JSON), and
#: the length of what follows.
_PACKED = struct.Struct("<qdcI")

#: One kept step: (step, time, the report's bytes or its figures as JSON).
StoredStep = tuple[int, float, bytes | str]


def step_series(point: StepPoint, report: pb.StepReport) -> dict[str, float]:
    """The figures of one combined optimizer step, with per-module-kind movement."""
    series: dict[str, float] = {
        "update_norm": point.update_norm,
        "learning_rate": point.learning_rate,
        "unchanged_tensors": float(point.unchanged_tensors),
        "watched_tensors": float(point.watched_tensors),
    }
    ratio = point.update_ratio
    if ratio is not None:
        series["update_ratio"] = ratio
    # what a baseline compares a run with: the optimizer's size, its gradient, its step's size
    # relative to the weights (read from the report, so they cost nothing at ingest)
    series["params"] = float(point.optimizer_params or point.watched_params)
    if point.grad_sq_sum is not None:
        series["grad_l2"] = _root(point.grad_sq_sum)
    if point.param_sq_sum > 0:
        series["relative_update"] = point.update_norm / _root(point.param_sq_sum)
    modules = [g for g in report.groups if g.kind == "module"]
    modules.sort(key=lambda g: -g.update_sq_sum)
    for index, group in enumerate(modules):
        name = module_label(group.name) if index < MAX_MODULE_KINDS else "other"
        prefix = f"module/{name}/"
        series[prefix + "update_norm"] = series.get(prefix + "update_norm", 0.0) + _root(
            group.update_sq_sum)
        series[prefix + "unchanged"] = series.get(prefix + "unchanged", 0.0) + float(
            group.unchanged_tensors)
        series[prefix + "tensors"] = series.get(prefix + "tensors", 0.0) + float(group.tensors)
        if group.elements:  # per-element counts: what a precision loss leaves behind
            series[prefix + "elements"] = series.get(prefix + "elements", 0.0) + float(
                group.elements)
            series[prefix + "unchanged_elements"] = series.get(
                prefix + "unchanged_elements", 0.0) + float(group.unchanged_elements)
    return series


def _root(square_sum: float) -> float:
    """The L2 norm of a sum of squares; NaN for a negative one, which no tensor gives (a
    client's bytes: a float power of it would be complex, which no figure can hold)."""
    return math.sqrt(square_sum) if square_sum >= 0 else math.nan


def encode_step(point: StepPoint, report: pb.StepReport, same: bool,
                encoded: bytes | None = None) -> bytes | str:
    """The stored form of a combined step: the report itself (``decode_step`` gives its
    figures), or its figures as JSON when the report is not the whole story or too large.

    ``same``: point was read from report (one rank, or an unsharded run's lowest); otherwise
    (a sharded step, summed over ranks) the figures are computed now. A report larger than
    MAX_STORED_STEP_BYTES (a thousand groups, long names) is not kept whole either: its
    figures are bounded (MAX_MODULE_KINDS names of 64 characters). ``encoded``: the report's
    bytes, when the caller serialized it already.
    """
    if same:
        if encoded is None:
            encoded = report.SerializeToString()
        if len(encoded) <= MAX_STORED_STEP_BYTES:
            return encoded
    return json.dumps(step_series(point, report), sort_keys=True)


def decode_step(stored: bytes, at: float) -> dict[str, float]:
    """The figures of a step kept by ``encode_step``."""
    report = pb.StepReport.FromString(stored)
    return step_series(StepPoint.from_report(report, at), report)


def log_series(values: dict[str, float]) -> dict[str, float]:
    """The plotted keys of one log report (eval keys and the rest stay out)."""
    return {key: value for key, value in values.items()
            if key in LOG_KEYS or (key.startswith("rewards/") and key.count("/") == 2)}


def pack_steps(steps: Sequence[StoredStep]) -> bytes:
    """Several kept steps as one value (``unpack_steps`` reads it back)."""
    parts: list[bytes] = []
    header = _PACKED.pack
    for step, at, kept in steps:
        if isinstance(kept, str):
            data = kept.encode()
            parts += (header(step, at, b"J", len(data)), data)
        else:
            parts += (header(step, at, b"R", len(kept)), kept)
    return b"".join(parts)


def unpack_steps(packed: bytes) -> Iterator[StoredStep]:
    """The steps of a ``pack_steps`` value, in the order they were packed.

    Raises ValueError on a value cut short (a damaged row): what came before it is given.
    """
    offset, end = 0, len(packed)
    while offset < end:
        if end - offset < _PACKED.size:
            raise ValueError(f"packed steps cut short at byte {offset} of {end}")
        step, at, form, length = _PACKED.unpack_from(packed, offset)
        offset += _PACKED.size
        data = packed[offset:offset + length]
        if len(data) != length:
            raise ValueError(f"packed step {step} cut short: {len(data)} of {length} bytes")
        offset += length
        yield step, at, data.decode() if form == b"J" else data


def stored_figures(at: float, kept: bytes | str) -> dict[str, float]:
    """The figures of a kept step, whichever form it was kept in."""
    if isinstance(kept, str):
        figures: dict[str, float] = json.loads(kept)
        return figures
    return decode_step(kept, at)
