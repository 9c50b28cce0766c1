"""The report's plots, drawn by matplotlib as inline SVG (the ``report`` extra).

Each function returns one SVG (or None when the run has no data for it). The rules that keep
a plot readable at a glance live here: movement axes start at 0 (an update norm is never
negative), every figure uses matplotlib's constrained layout so tick labels stay inside their
own panel, and verdicts are vertical lines without text on the axes (their names go in the
page's caption, where they cannot overlap).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ..store.journal import StoredIncident

#: A history series: (step, time, figures) rows as the store gives them.
Rows = Sequence[tuple[int, float, dict[str, float]]]

#: Signals only an RL trainer (GRPO, RLOO, ...) logs; one of them makes the RL section.
RL_ONLY_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "kl",
                "completions/mean_length", "completions/clipped_ratio")
#: Drawn in the RL section when the run is an RL run (SFT logs entropy too: it is no RL sign).
RL_KEYS = ("reward_std", "frac_reward_zero_std", "kl", "entropy", "completions/mean_length",
           "completions/clipped_ratio")
#: Signals that are never negative: their axis starts at 0, so a flat 0 reads as 0.
NONNEGATIVE_KEYS = frozenset({"reward_std", "frac_reward_zero_std", "kl",
                              "completions/clipped_ratio"})
#: DPO's implicit rewards: their own section.
PREFERENCE_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
#: Module kinds drawn in the per-module panel, largest movement first.
MAX_MODULE_KINDS = 16
CRITICAL_COLOR, WARNING_COLOR = "#c62828", "#ef6c00"


def _formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(_scientific)


def series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for step, _, values in rows:
        if key in values:
            xs.append(step)
            ys.append(values[key])
    return xs, ys


def _figure(panels: int, width: float, height: float) -> tuple[Any, list[Axes]]:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, panels, figsize=(width, height), squeeze=False,
                                layout="constrained")
    return figure, list(axes[0])


def _svg(figure: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog: the SVG sits inside HTML


def _style(axes: Axes, title: str, xlabel: str = "optimizer step",
           numeric: Literal["both", "x", "y"] = "both") -> None:
    axes.set_title(title, fontsize=10)
    axes.set_xlabel(xlabel, fontsize=8)
    axes.tick_params(labelsize=8)
    axes.locator_params(axis=numeric, nbins=5)
    axes.grid(alpha=0.25)


def _from_zero(axes: Axes, values: Sequence[float], empty_note: str,
               alarming: bool = True) -> None:
    """An axis of magnitudes: bottom at 0; all zeros get a readable range and a note."""
    top = max((v for v in values if v == v), default=0.0)  # NaN left out
    if top > 0:
        axes.set_ylim(0, top * 1.15)
        if top < 1e-2:  # each tick says its own scale (an offset label above is missed)
            axes.yaxis.set_major_formatter(_formatter())
    else:
        axes.set_ylim(0, 1)
        axes.set_yticks([0])
        if values:
            axes.text(0.5, 0.55, empty_note, transform=axes.transAxes, ha="center",
                      color="#b71c1c" if alarming else "#616161", fontsize=10,
                      fontweight="bold" if alarming else "normal")


def _scientific(value: float, _: int) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def mark_verdicts(axes: Axes, incidents: Sequence[StoredIncident]) -> None:
    for incident in incidents:
        if incident.severity in ("critical", "warning"):
            color = CRITICAL_COLOR if incident.severity == "critical" else WARNING_COLOR
            axes.axvline(incident.step, color=color, linestyle="--", linewidth=1, alpha=0.8)


def movement(steps: Rows, logs: Rows, incidents: Sequence[StoredIncident],
             floor: float) -> str:
    """Update L2 and the scale-free ratio (did the weights move) beside loss and grad_norm
    (what a loss-only view shows)."""
    figure, (moved, ratio, loss) = _figure(3, 13, 3.3)
    xs, norms = series(steps, "update_norm")
    moved.plot(xs, norms, marker="o", markersize=3, color="#1565c0")
    _style(moved, "update L2 per optimizer step")
    _from_zero(moved, norms, "0 at every step: not moving")
    mark_verdicts(moved, incidents)
    rx, ratios = series(steps, "update_ratio")
    ratio.plot(rx, ratios, marker="s", markersize=3, color="#2e7d32", label="update / (lr·√n)")
    ratio.axhline(floor, color=CRITICAL_COLOR, linestyle=":", label=f"frozen floor {floor:g}")
    _style(ratio, "scale-free update ratio")
    top = max([floor, *(r for r in ratios if r == r)])
    ratio.set_ylim(0, top * 1.15)
    ratio.legend(fontsize=7, loc="upper right")
    mark_verdicts(ratio, incidents)
    _style(loss, "what a loss-only view shows", "step")
    # loss and grad_norm on their own axes (left and right): on one, a loss of 5 flattens a
    # grad_norm of 0.4 and neither shows that it moves.
    lines = []
    lx, ly = series(logs, "loss")
    if lx:
        lines += loss.plot(lx, ly, marker="o", markersize=3, color="#6a1b9a")
        loss.set_ylabel("loss", fontsize=8, color="#6a1b9a")
    gx, gy = series(logs, "grad_norm")
    if gx:
        grad = loss.twinx()
        lines += grad.plot(gx, gy, marker="s", markersize=3, color="#ef6c00")
        grad.set_ylabel("grad_norm", fontsize=8, color="#ef6c00")
        grad.tick_params(labelsize=8)
        grad.locator_params(axis="y", nbins=5)
        top = max((g for g in gy if g == g), default=0.0)
        grad.set_ylim(0, top * 1.15 if top > 0 else 1)  # a norm: never below 0
    if len(lines) == 2:  # the axis labels, in the lines' colours, say which is which
        loss.set_title("what a loss-only view shows:\nloss (left axis), grad_norm (right)",
                       fontsize=10)
    return _svg(figure)


def rl_keys(logs: Rows, trainer: str) -> list[str]:
    """The RL signals to draw: none unless the run is an RL run (it logged a reward or KL,
    or its trainer is one), so an SFT run gets no RL section."""
    logged = {key for _, _, values in logs for key in values}
    rl_run = bool(logged & set(RL_ONLY_KEYS)) or trainer.upper().startswith(
        ("GRPO", "RLOO", "PPO", "ONLINEDPO", "XPO", "NASH"))
    return [key for key in RL_KEYS if key in logged] if rl_run else []


def small_multiples(logs: Rows, keys: Sequence[str],
                    incidents: Sequence[StoredIncident]) -> str | None:
    """One small panel per logged key, verdict lines on each."""
    if not keys:
        return None
    columns = min(len(keys), 6)
    figure, axes = _figure(columns, 2.15 * columns, 2.5)
    for ax, key in zip(axes, keys[:columns], strict=True):
        xs, ys = series(logs, key)
        ax.plot(xs, ys, marker="o", markersize=3, color="#1565c0")
        _style(ax, key, "step")
        if key in NONNEGATIVE_KEYS:
            _from_zero(ax, ys, "0 at every log", alarming=False)
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
        mark_verdicts(ax, incidents)
    return _svg(figure)


@dataclass(frozen=True)
class ModuleMovement:
    """How one module kind moved over the run."""

    #: Update L2 summed over the run's steps.
    update_norm: float
    #: Fraction of its tensor-steps in which the whole tensor stayed byte-identical.
    unchanged_tensors: float
    #: Fraction of its element-steps that stayed identical (None: not measured, older data).
    unchanged_elements: float | None

    @property
    def not_moving(self) -> bool:
        """Every tensor of this kind stayed byte-identical at every step."""
        return self.unchanged_tensors >= 1.0 or self.update_norm == 0


_MODULE_FIELDS = ("update_norm", "unchanged", "tensors", "unchanged_elements", "elements")


def module_movement(steps: Rows) -> dict[str, ModuleMovement]:
    """module kind -> how it moved, from the per-step history."""
    sums: dict[str, dict[str, float]] = {}
    for _, _, values in steps:
        for key, value in values.items():
            if not key.startswith("module/"):
                continue
            _, name, field = key.split("/", 2)
            if field in _MODULE_FIELDS:
                entry = sums.setdefault(name, dict.fromkeys(_MODULE_FIELDS, 0.0))
                entry[field] += value
    return {
        name: ModuleMovement(
            update_norm=entry["update_norm"],
            unchanged_tensors=entry["unchanged"] / entry["tensors"] if entry["tensors"] else 0.0,
            unchanged_elements=(entry["unchanged_elements"] / entry["elements"]
                                if entry["elements"] else None),
        )
        for name, entry in sums.items()
    }


def modules(movement: dict[str, ModuleMovement]) -> str | None:
    """Per module kind: how far it moved, and how often it did not move at all.

    A kind that never moved says "not moving" on its bars. The element panel, which shows
    elements lost to precision in tensors that did move, is drawn only when some kind moved:
    in a frozen run every element is unchanged because nothing moved, not for precision.
    """
    if not movement:
        return None
    ranked = sorted(movement.items(), key=lambda item: -item[1].update_norm)[:MAX_MODULE_KINDS]
    names = [name for name, _ in ranked]
    moving = [m for _, m in ranked if not m.not_moving]
    panels = 3 if moving and any(m.unchanged_elements is not None for _, m in ranked) else 2
    figure, axes = _figure(panels, 13, 0.4 * len(names) + 1.3)
    norm_ax, frozen_ax = axes[0], axes[1]
    norm_ax.barh(names, [m.update_norm for _, m in ranked], color="#1565c0")
    norm_ax.invert_yaxis()
    _style(norm_ax, "update L2 summed over the run", "update L2", numeric="x")
    norm_ax.set_xlim(0, max(m.update_norm for _, m in ranked) * 1.15 or 1)
    frozen_ax.barh(names, [m.unchanged_tensors for _, m in ranked], color=CRITICAL_COLOR)
    frozen_ax.set_xlim(0, 1)
    frozen_ax.invert_yaxis()
    _style(frozen_ax, "share of steps a tensor did not move", "fraction of tensor-steps",
           numeric="x")
    for row, (_, m) in enumerate(ranked):
        if m.not_moving:
            for ax in (norm_ax, frozen_ax):
                ax.text(0.0, row, "  not moving", va="center", ha="left", fontsize=8,
                        color="white" if ax is frozen_ax else CRITICAL_COLOR,
                        fontweight="bold")
        else:
            frozen_ax.text(m.unchanged_tensors, row, f"  {m.unchanged_tensors:.0%}",
                           va="center", ha="left", fontsize=8)
    if panels == 3:
        element_ax = axes[2]
        shares = [0.0 if m.not_moving else m.unchanged_elements or 0.0 for _, m in ranked]
        element_ax.barh(names, shares, color=WARNING_COLOR)
        element_ax.set_xlim(0, 1)
        element_ax.invert_yaxis()
        _style(element_ax, "moving tensors: elements left unchanged\n(lost to precision)",
               "fraction of element-steps", numeric="x")
        for row, ((_, m), share) in enumerate(zip(ranked, shares, strict=True)):
            element_ax.text(share, row, "  not moving" if m.not_moving else f"  {share:.1%}",
                            va="center", ha="left", fontsize=8)
    for ax in axes[1:]:
        ax.tick_params(labelleft=False)
    return _svg(figure)
