"""The report's baseline section: each compared figure drawn over its baseline's band.

The band (lowest to highest healthy value at each point of training, median dashed) lies
behind the run's own curve, so a reader sees where the run left what healthy looks like.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..exposition import report_plots
from .model import Baseline
from .quantities import LOG_QUANTITIES, step_values

#: Figures drawn, in this order, when both the baseline and the run have them.
DRAWN = ("loss", "grad_norm", "grad_l2", "learning_rate", "update_rms", "reward",
         "reward_std", "kl", "entropy")
BAND_COLOR, RUN_COLOR = "#90a4ae", "#1565c0"


def run_series(steps: report_plots.Rows, logs: report_plots.Rows
               ) -> dict[str, tuple[list[int], list[float]]]:
    """Every compared figure of a stored run: (steps, values)."""
    found: dict[str, tuple[list[int], list[float]]] = {}
    for step, _, figures in steps:
        for quantity, value in step_values(figures).items():
            xs, ys = found.setdefault(quantity, ([], []))
            xs.append(step)
            ys.append(value)
    for quantity in LOG_QUANTITIES:
        xs, ys = report_plots.series(logs, quantity)
        if xs:
            found[quantity] = (xs, ys)
    return found


def overlay(steps: report_plots.Rows, logs: report_plots.Rows, baseline: Baseline,
            total: int, per_row: int = 4) -> str | None:
    """Panels of the run's figures over the baseline's bands (None: nothing to compare)."""
    found = run_series(steps, logs)
    keys = [q for q in DRAWN if q in found and q in baseline.series]
    if not keys:
        return None
    rows = [keys[i:i + per_row] for i in range(0, len(keys), per_row)]
    return "\n".join(_row(row, found, baseline, total) for row in rows)


def _row(keys: Sequence[str], found: dict[str, tuple[list[int], list[float]]],
         baseline: Baseline, total: int) -> str:
    figure, axes = report_plots._figure(len(keys), 3.2 * len(keys), 2.6)
    last = max(max(found[k][0]) for k in keys)
    for ax, key in zip(axes, keys, strict=True):
        xs = list(range(1, max(last, total) + 1))
        bands = [baseline.band(key, x, total) for x in xs]
        kept = [(x, b) for x, b in zip(xs, bands, strict=True) if b is not None]
        if kept:
            bx = [x for x, _ in kept]
            ax.fill_between(bx, [b.low for _, b in kept], [b.high for _, b in kept],
                            color=BAND_COLOR, alpha=0.35, step="mid", linewidth=0,
                            label="baseline band")
            ax.plot(bx, [b.median for _, b in kept], color=BAND_COLOR, linestyle="--",
                    linewidth=1)
        rx, ry = found[key]
        ax.plot(rx, ry, marker="o", markersize=2, color=RUN_COLOR, label="this run")
        report_plots._style(ax, key)
        ax.yaxis.set_major_formatter(report_plots._formatter())
    axes[0].legend(fontsize=7, loc="best")
    return report_plots._svg(figure)
