"""Thresholds of the fixed detectors, read from a run's baseline where it names one.

A fixed constant encodes what healthy looks like on the recipes it was checked against; a
recipe whose healthy behaviour is unusual (a model whose weights are large against any step,
so each step moves them by less than ``negligible_relative_update`` of their norm) would page
at every run. Its baseline shows what healthy is for it: the threshold moves below the
lowest healthy value, by a decade, and never above the fixed one (a baseline can only quiet a
detector on what healthy runs of the recipe really did). Likewise a recipe whose healthy
gradient norm jumps now and then (a periodic hard batch, a shard of another scale) would draw
``grad_norm_spike`` at every such batch: with a baseline, a spike must also jump further over
its recent level than healthy runs of the recipe ever did (by ``baseline_margin``, as every
band of a baseline is widened). And a job whose ranks do unequal work by design (rank 0 logs
and evaluates, a shard larger than the others) would draw ``rank_straggler`` at every run:
its ratio rises to what the slowest rank of the recipe's healthy runs showed, widened alike.
"""

from __future__ import annotations

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .live import baseline_of

#: How far below the lowest healthy value a calibrated floor lies.
FLOOR_DECADES = 10.0


def straggler_ratio(run: RunState, settings: DetectorSettings) -> float:
    """``rank_straggler``'s ratio (slowest rank's own seconds over the next one's) for this
    run: ``straggler_ratio``, or the baseline's healthy ratio widened by ``baseline_margin``
    when that is higher."""
    ratio = settings.straggler_ratio
    baseline = baseline_of(run)
    if baseline is None or baseline.rank_time_ratio is None:
        return ratio
    return max(ratio, baseline.rank_time_ratio * (1.0 + settings.baseline_margin))


def spike_jump(run: RunState, settings: DetectorSettings) -> float | None:
    """The jump over its recent level (``quantities.jump``) a grad norm must exceed for
    ``grad_norm_spike`` to fire on this run, besides its z-score: the largest healthy jump
    of the run's baseline, widened by ``baseline_margin``; None without one (the z-score
    alone decides, as on any run)."""
    baseline = baseline_of(run)
    if baseline is None or baseline.grad_norm_jump is None:
        return None
    return baseline.grad_norm_jump * (1.0 + settings.baseline_margin)


def negligible_floor(run: RunState, settings: DetectorSettings) -> float:
    """``negligible_updates``' relative-update floor for this run."""
    floor = settings.negligible_relative_update
    baseline = baseline_of(run)
    if baseline is None:
        return floor
    lows = [b.low for b in baseline.series.get("relative_update", ()) if b is not None
            and b.low > 0]
    if not lows:
        return floor
    return min(floor, min(lows) / FLOOR_DECADES)
