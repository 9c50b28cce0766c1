"""``deadweight report``: one self-contained HTML page that tells whether a run learned.

It reads the sidecar's state database (``--state-dir``), never the live process, so a report
can be made after the sidecar or the run is gone. Plots are drawn by matplotlib as inline SVG:
the page needs no network and no script to view. matplotlib is the ``report`` extra, kept out
of the sidecar image's required dependencies.

Panels, top to bottom: the verdict; "did the weights move" (update L2 and the scale-free ratio
with the frozen floor, beside loss and grad_norm: what a loss-only view shows); the RL panel
when the run logged reward spread, KL, entropy or completion length; per-module movement; the
verdict timeline with every action; the checkpoint hash chain.
"""

from __future__ import annotations

import datetime
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .store.journal import ActionRow, Store, StoredIncident, StoredRun

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .model.run_state import CheckpointPoint

#: Keys of the RL panel, in the order they are drawn; a run that logged none gets no panel.
RL_KEYS = ("reward_std", "frac_reward_zero_std", "kl", "entropy", "completions/mean_length",
           "completions/clipped_ratio")
#: Module kinds drawn in the per-module panel, largest movement first.
MAX_MODULE_KINDS = 16


class ReportUnavailable(RuntimeError):
    """The report cannot be made (unknown run, or the plotting extra is not installed)."""


@dataclass(frozen=True)
class RunRecord:
    """Everything the state database holds about one run."""

    run: StoredRun
    steps: list[tuple[int, float, dict[str, float]]]
    logs: list[tuple[int, float, dict[str, float]]]
    incidents: list[StoredIncident]
    actions: list[ActionRow]
    checkpoints: list[CheckpointPoint]


def load(store: Store, run_id: str) -> RunRecord:
    run = store.run(run_id)
    if run is None:
        known = ", ".join(r.run_id for r in store.runs()[-10:]) or "none"
        raise ReportUnavailable(f"no run {run_id!r} in the state database (recent: {known})")
    return RunRecord(
        run=run,
        steps=store.history(run_id, "step"),
        logs=store.history(run_id, "log"),
        incidents=store.incidents(run_id),
        actions=store.actions(run_id=run_id),
        checkpoints=store.checkpoints(run_id),
    )


def _series(rows: Sequence[tuple[int, float, dict[str, float]]],
            key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for step, _, values in rows:
        if key in values:
            xs.append(step)
            ys.append(values[key])
    return xs, ys


def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog: the SVG sits inside HTML


def _mark_verdicts(axes: Axes, incidents: Sequence[StoredIncident], label: bool) -> None:
    for incident in incidents:
        if incident.severity not in ("critical", "warning"):
            continue
        color = "#c62828" if incident.severity == "critical" else "#ef6c00"
        axes.axvline(incident.step, color=color, linestyle="--", linewidth=1)
        if label:
            axes.annotate(incident.detector, (incident.step, 1.0),
                          xycoords=("data", "axes fraction"), rotation=90, va="top",
                          ha="right", fontsize=7, color=color)


def _movement_plot(record: RunRecord, floor: float) -> str:
    import matplotlib.pyplot as plt

    figure, (moved, ratio, loss) = plt.subplots(1, 3, figsize=(13, 3.2))
    xs, norms = _series(record.steps, "update_norm")
    moved.plot(xs, norms, marker="o", markersize=3, color="#1565c0")
    moved.set_title("update L2 per optimizer step", fontsize=10)
    moved.set_xlabel("optimizer step", fontsize=8)
    if norms and max(norms) == 0:
        moved.text(0.5, 0.75, "0 on every step: nothing moved", transform=moved.transAxes,
                   ha="center", color="#b71c1c", fontsize=10, fontweight="bold")
    _mark_verdicts(moved, record.incidents, label=True)
    rx, ratios = _series(record.steps, "update_ratio")
    ratio.plot(rx, ratios, marker="s", markersize=3, color="#2e7d32", label="update / (lr·√n)")
    ratio.axhline(floor, color="#c62828", linestyle=":", label=f"frozen floor {floor:g}")
    ratio.set_title("scale-free update ratio", fontsize=10)
    ratio.set_xlabel("optimizer step", fontsize=8)
    ratio.legend(fontsize=7)
    _mark_verdicts(ratio, record.incidents, label=False)
    for key, color in (("loss", "#6a1b9a"), ("grad_norm", "#ef6c00")):
        lx, ly = _series(record.logs, key)
        if lx:
            loss.plot(lx, ly, marker="o", markersize=3, color=color, label=key)
    loss.set_xlabel("step", fontsize=8)
    loss.set_title("what a loss-only view shows", fontsize=10)
    loss.legend(fontsize=7)
    return _svg(figure)


def _rl_plot(record: RunRecord) -> str | None:
    present = [k for k in RL_KEYS if _series(record.logs, k)[0]]
    if not present:
        return None
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(present), figsize=(2.9 * len(present), 2.6),
                                squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        xs, ys = _series(record.logs, key)
        ax.plot(xs, ys, marker="o", markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        _mark_verdicts(ax, record.incidents, label=False)
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


_MODULE_FIELDS = ("update_norm", "unchanged", "tensors", "unchanged_elements", "elements")


def module_movement(record: RunRecord) -> dict[str, ModuleMovement]:
    """module kind -> how it moved, from the per-step history."""
    sums: dict[str, dict[str, float]] = {}
    for _, _, values in record.steps:
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


def _module_plot(record: RunRecord) -> str | None:
    movement = module_movement(record)
    if not movement:
        return None
    import matplotlib.pyplot as plt

    ranked = sorted(movement.items(), key=lambda item: -item[1].update_norm)[:MAX_MODULE_KINDS]
    names = [name for name, _ in ranked]
    figure, (norm_ax, frozen_ax, element_ax) = plt.subplots(
        1, 3, figsize=(14, 0.35 * len(names) + 1.2), sharey=True)
    norm_ax.barh(names, [m.update_norm for _, m in ranked], color="#1565c0")
    norm_ax.set_title("update L2 summed over the run, per module kind", fontsize=9)
    norm_ax.invert_yaxis()
    frozen_ax.barh(names, [m.unchanged_tensors for _, m in ranked], color="#c62828")
    frozen_ax.set_xlim(0, 1)
    frozen_ax.set_title("fraction of tensor-steps unchanged", fontsize=9)
    element_ax.barh(names, [m.unchanged_elements or 0.0 for _, m in ranked], color="#ef6c00")
    element_ax.set_xlim(0, 1)
    element_ax.set_title("fraction of element-steps unchanged (precision loss)", fontsize=9)
    return _svg(figure)


def _when(at: float | None) -> str:
    if not at:
        return "—"
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    if not rows:
        return "<p class=quiet>none</p>"
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table><tr>{header}</tr>{cells}</table>"


def headline(record: RunRecord) -> tuple[str, str]:
    """(css class, sentence): the verdict a person reads first."""
    critical = [i for i in record.incidents if i.severity == "critical"]
    stopped = [a for a in record.actions if a.action in ("stop", "sigterm", "sigkill")
               and a.result in ("sent", "delivered", "ok", "signalled")]
    if critical:
        names = ", ".join(sorted({i.detector for i in critical}))
        first = min(critical, key=lambda i: i.step)
        text = f"NOT LEARNING: {names} (first at step {first.step})"
        if stopped:
            text += f"; run stopped by deadweight ({stopped[0].action} for {stopped[0].detector})"
        return "bad", text
    warnings = [i for i in record.incidents if i.severity == "warning"]
    if warnings:
        return "warn", "warnings: " + ", ".join(sorted({i.detector for i in warnings}))
    return "good", "healthy: no critical or warning verdict"


STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#212121;max-width:1200px}
h1{font-size:20px;margin-bottom:4px} h2{font-size:16px;margin-top:28px}
.verdict{padding:12px 16px;border-radius:6px;font-size:18px;font-weight:600}
.bad{background:#ffebee;color:#b71c1c}.warn{background:#fff3e0;color:#e65100}
.good{background:#e8f5e9;color:#1b5e20}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f5f5f5}.quiet{color:#757575}
.meta{color:#616161;font-size:13px}svg{max-width:100%;height:auto}
"""


def render(record: RunRecord, frozen_ratio_floor: float = 0.01) -> str:
    """The whole page as one HTML string (inline SVG and CSS, no script, no network)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError as err:
        raise ReportUnavailable(
            "the report needs matplotlib: pip install 'deadweight[report]'") from err
    run = record.run
    css, sentence = headline(record)
    state = (f"ended ({run.end_reason}) at {_when(run.ended_at)}" if run.ended else "running")
    last_step = record.steps[-1][0] if record.steps else 0
    parts = [
        "<!doctype html><html><head><meta charset=utf-8>",
        f"<title>deadweight report: {html.escape(run.run_id)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>deadweight report: {html.escape(run.run_id)}</h1>",
        f"<p class=meta>trainer {html.escape(run.trainer or '?')} · {html.escape(state)} · "
        f"{len(record.steps)} optimizer steps recorded (last {last_step}) · "
        f"{len(record.checkpoints)} checkpoints</p>",
        f"<p class='verdict {css}'>{html.escape(sentence)}</p>",
        "<h2>Did the weights move?</h2>", _movement_plot(record, frozen_ratio_floor),
    ]
    rl = _rl_plot(record)
    if rl is not None:
        parts += ["<h2>Reinforcement learning signals</h2>", rl]
    modules = _module_plot(record)
    if modules is not None:
        parts += ["<h2>Per-module movement</h2>", modules]
    parts += [
        "<h2>Verdicts</h2>",
        _table(("detector", "severity", "policy", "step", "fired", "resolved", "summary"), [
            (i.detector, i.severity, i.policy, str(i.step), _when(i.fired_at),
             _when(i.resolved_at), i.summary) for i in record.incidents]),
        "<h2>Actions</h2>",
        _table(("time", "detector", "action", "result", "rank", "pid"), [
            (_when(a.time), f"{a.detector}#{a.incident}", a.action + (" (dry run)" if a.dry_run
                                                                       else ""),
             a.result, "" if a.rank is None else str(a.rank), "" if a.pid is None else str(a.pid))
            for a in record.actions]),
        "<h2>Checkpoint hash chain</h2>",
        _table(("step", "path", "adapter digest", "bytes", "same as"), _chain(record)),
        "</body></html>",
    ]
    return "\n".join(parts)


def _chain(record: RunRecord) -> list[tuple[str, str, str, str, str]]:
    rows = []
    seen: dict[str, int] = {}
    start = record.run.start
    if start is not None and start.initial_adapter.combined:
        initial = start.initial_adapter
        rows.append(("0", "(initial adapter, in memory at train begin)",
                     initial.combined[:16], str(initial.bytes), ""))
        seen[initial.combined] = 0
    for point in record.checkpoints:
        same = seen.get(point.combined_digest)
        rows.append((str(point.step), point.path, point.combined_digest[:16],
                     str(point.adapter_bytes),
                     "" if same is None else "initial adapter (identical bytes)" if same == 0 else
                     f"step {same} (identical bytes)"))
        seen.setdefault(point.combined_digest, point.step)
    return rows
