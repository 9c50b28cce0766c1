"""``deadweight baseline save``: a baseline from finished healthy runs in a state database.

Everything comes from what the sidecar already keeps: each run's RunStart (the fingerprint,
the trainable share), its step history (learning rate, update size, gradient, per module
kind movement, step times) and its log history (loss, grad norm, RL signals, tokens). Several
runs (seeds, data orders) widen the bands; a fact they disagree on leaves the fingerprint.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..model.settings import DetectorSettings
from ..store.journal import RANKS, Store
from . import fingerprint as prints
from .model import BINS, MAX_MODULES, Band, Baseline, BaselineError, ModuleFacts, bin_of
from .quantities import LOG_QUANTITIES, largest_jump, step_values, update_over_lr

#: Steps a run needs for a baseline (fewer say nothing about a trajectory).
MIN_STEPS = 5

_MODULE = "module/"


@dataclass
class _Module:
    steps: int = 0
    moved: int = 0
    tensors: int = 0
    over_lr: list[float] = field(default_factory=list)


@dataclass
class _Collected:
    """Values of every run, per quantity and bin."""

    bins: dict[str, list[list[float]]] = field(default_factory=dict)
    modules: dict[str, _Module] = field(default_factory=dict)
    shares: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    jumps: list[float] = field(default_factory=list)
    rank_ratios: list[float] = field(default_factory=list)

    def add(self, quantity: str, step: int, last: int, value: float) -> None:
        bins = self.bins.setdefault(quantity, [[] for _ in range(BINS)])
        bins[bin_of(step, last)].append(value)


def build(store: Store, run_ids: Sequence[str]) -> Baseline:
    """The baseline of the runs named (each its newest incarnation); raises BaselineError."""
    if not run_ids:
        raise BaselineError("name at least one run")
    collected = _Collected()
    fingerprints: list[dict[str, str]] = []
    lasts: list[int] = []
    for run_id in run_ids:
        run = store.run(run_id)
        if run is None:
            known = ", ".join(r.run_id for r in store.runs()[-10:]) or "none"
            raise BaselineError(f"no run {run_id!r} in the state database (recent: {known})")
        steps = store.history(run_id, "step", run.incarnation)
        logs = store.history(run_id, "log", run.incarnation)
        if len(steps) < MIN_STEPS:
            raise BaselineError(f"run {run_id!r} has {len(steps)} optimizer steps recorded; a "
                                f"baseline needs at least {MIN_STEPS}")
        last = max(steps[-1][0], logs[-1][0] if logs else 0)
        lasts.append(last)
        if run.start is not None:
            fingerprints.append(prints.fingerprint(run.start))
            model_params = run.start.config.get("model_params", 0.0)
            if model_params > 0:
                collected.shares.append(run.start.membership.optimizer_params / model_params)
        _collect_steps(collected, steps, last)
        _collect_logs(collected, logs, last)
        found = largest_jump(_grad_norms(steps, logs))
        if found is not None:
            collected.jumps.append(found)
        ratio = _rank_time_ratio(store.history(run_id, RANKS, run.incarnation))
        if ratio is not None:
            collected.rank_ratios.append(ratio)
    return Baseline(
        runs=tuple(run_ids),
        steps=round(sum(lasts) / len(lasts)),
        fingerprint=prints.common(fingerprints),
        modules=_modules(collected.modules),
        series={q: _bands(bins) for q, bins in sorted(collected.bins.items())},
        trainable_share=Band.of(collected.shares),
        step_seconds=Band.of(collected.step_seconds),
        tokens_per_step=Band.of(collected.tokens),
        grad_norm_jump=max(collected.jumps, default=None),
        rank_time_ratio=max(collected.rank_ratios, default=None),
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def _collect_steps(collected: _Collected, steps: list[tuple[int, float, dict[str, float]]],
                   last: int) -> None:
    previous: tuple[int, float] | None = None
    for step, at, figures in steps:
        for quantity, value in step_values(figures).items():
            collected.add(quantity, step, last, value)
        if previous is not None and step == previous[0] + 1 and at > previous[1]:
            collected.step_seconds.append(at - previous[1])
        previous = (step, at)
        lr = figures.get("learning_rate", 0.0)
        for key, value in figures.items():
            if not key.startswith(_MODULE) or not key.endswith("/update_norm"):
                continue
            name = key[len(_MODULE):-len("/update_norm")]
            module = collected.modules.setdefault(name, _Module())
            module.steps += 1
            module.moved += value > 0
            prefix = f"{_MODULE}{name}/"
            module.tensors = max(module.tensors, int(figures.get(prefix + "tensors", 0)))
            over = update_over_lr(value * value, figures.get(prefix + "elements", 0.0), lr)
            if over is not None and value > 0:
                module.over_lr.append(over)


def _collect_logs(collected: _Collected, logs: list[tuple[int, float, dict[str, float]]],
                  last: int) -> None:
    tokens: tuple[int, float] | None = None
    for step, _, values in logs:
        for quantity in LOG_QUANTITIES:
            if quantity in values:
                collected.add(quantity, step, last, values[quantity])
        seen = values.get("num_tokens")
        if seen is not None:
            if tokens is not None and step > tokens[0] and seen >= tokens[1]:
                collected.tokens.append((seen - tokens[1]) / (step - tokens[0]))
            tokens = (step, seen)


def _grad_norms(steps: list[tuple[int, float, dict[str, float]]],
                logs: list[tuple[int, float, dict[str, float]]]) -> list[float]:
    """A run's gradient norms as ``grad_norm_spike`` reads them live
    (``divergence.grad_norm_series``): the logged ``grad_norm`` where the run logged a
    positive one, else each optimizer step's measured gradient."""
    logged = [v["grad_norm"] for _, _, v in logs
              if math.isfinite(v.get("grad_norm", math.nan)) and v["grad_norm"] > 0]
    if logged:
        return logged
    return [f["grad_l2"] for _, _, f in steps
            if math.isfinite(f.get("grad_l2", math.nan)) and f["grad_l2"] > 0]


def _rank_time_ratio(timed: list[tuple[int, float, dict[str, float]]]) -> float | None:
    """The largest median of the slowest rank's own seconds over the next one's, over
    windows of ``straggler_steps`` consecutive timed steps (the window ``rank_straggler``
    judges); None when the run timed fewer steps on every rank (one rank, an older
    sidecar)."""
    window = DetectorSettings().straggler_steps
    ratios = [f["slowest_over_next"] for _, _, f in timed
              if math.isfinite(f.get("slowest_over_next", math.nan))]
    if len(ratios) < window:
        return None
    return max(statistics.median(ratios[i:i + window])
               for i in range(len(ratios) - window + 1))


def _bands(bins: list[list[float]]) -> tuple[Band | None, ...]:
    """Each bin's band over its own values and its neighbours' (a step's noise is not all a
    run of a few dozen steps shows in one bin)."""
    return tuple(Band.of([v for near in bins[max(0, i - 1):i + 2] for v in near])
                 for i in range(len(bins)))


def _modules(modules: dict[str, _Module]) -> dict[str, ModuleFacts]:
    ranked = sorted(modules.items(), key=lambda kv: -kv[1].moved)[:MAX_MODULES]
    return {name: ModuleFacts(m.moved / m.steps if m.steps else 0.0, m.tensors,
                              Band.of(m.over_lr)) for name, m in sorted(ranked)}
