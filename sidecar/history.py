"""The per-step figures the sidecar keeps for ``deadweight report``.

Detectors look at short windows held in memory; a report needs the whole run. This module
says which figures of a step or a log go to the state database, so that the choice is made
once and stays bounded (a run logging hundreds of keys stores only these).

A step is normally kept as its ``StepReport`` (encoded: a microsecond, where building and
encoding its figures took tens at every step received) and turned into figures when the
history is read, which is rare: ``encode_step`` at ingest, ``decode_step`` for the report.
"""

from __future__ import annotations

import json
import re

from deadweight.proto import pb
from deadweight.sidecar.state import StepPoint

#: Log keys worth a plot: the loss-only view, the RL signals and DPO's rewards.
LOG_KEYS = frozenset({
    "loss", "grad_norm", "learning_rate", "kl", "reward", "reward_std",
    "frac_reward_zero_std", "entropy", "completions/mean_length",
    "completions/clipped_ratio", "completions/mean_terminated_length",
    "rewards/chosen", "rewards/rejected", "rewards/margins",
})
#: Module kinds kept per step (groups of kind "module"); the rest are summed as "other".
MAX_MODULE_KINDS = 24
#: Largest step report kept as it came (a LoRA run's, with a group per module kind and
#: adapter, is a few hundred bytes).
MAX_STORED_STEP_BYTES = 4096
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


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
    modules = [g for g in report.groups if g.kind == "module"]
    modules.sort(key=lambda g: -g.update_sq_sum)
    for index, group in enumerate(modules):
        name = _SAFE_NAME.sub("_", group.name)[:64] if index < MAX_MODULE_KINDS else "other"
        prefix = f"module/{name}/"
        series[prefix + "update_norm"] = series.get(prefix + "update_norm", 0.0) + (
            group.update_sq_sum ** 0.5)
        series[prefix + "unchanged"] = series.get(prefix + "unchanged", 0.0) + float(
            group.unchanged_tensors)
        series[prefix + "tensors"] = series.get(prefix + "tensors", 0.0) + float(group.tensors)
        if group.elements:  # per-element counts: what a precision loss leaves behind
            series[prefix + "elements"] = series.get(prefix + "elements", 0.0) + float(
                group.elements)
            series[prefix + "unchanged_elements"] = series.get(
                prefix + "unchanged_elements", 0.0) + float(group.unchanged_elements)
    return series


def encode_step(point: StepPoint, report: pb.StepReport, same: bool) -> bytes | str:
    """The stored form of a combined step: the report itself (``decode_step`` gives its
    figures), or its figures as JSON when the report is not the whole story or too large.

    ``same``: point was read from report (one rank, or an unsharded run's lowest); otherwise
    (a sharded step, summed over ranks) the figures are computed now. A report larger than
    MAX_STORED_STEP_BYTES (a thousand groups, long names) is not kept whole either: its
    figures are bounded (MAX_MODULE_KINDS names of 64 characters).
    """
    if same:
        encoded: bytes = report.SerializeToString()
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
