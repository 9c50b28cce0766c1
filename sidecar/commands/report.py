"""``deadweight report``: one self-contained HTML page that tells whether a run learned.

It reads the sidecar's state database (``--state-dir``), never the live process, so a report
can be made after the sidecar or the run is gone. Plots are drawn by matplotlib as inline SVG:
the page needs no network and no script to view. matplotlib is the ``report`` extra, kept out
of the sidecar image's required dependencies.

Top to bottom: the verdict, with the root cause, its fix in one sentence (the runbook's, by
``runbook_pages.fix_sentence``) and the runbook link, so a reader knows in ten seconds what
went wrong and what to change; "did the weights move" (update L2 and the scale-free ratio with
the frozen floor, beside loss and grad_norm: what a loss-only view shows); the RL section only
for an RL run, the preference section only when DPO's rewards were logged; per-module
movement; the verdicts, root causes first, with every action; the checkpoint hash chain.
"""

from __future__ import annotations

import datetime
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import verdicts as verdict_order
from ..actions.links import DEFAULT_RUNBOOK_URL_PATTERN, runbook_url
from ..detectors import BY_ID, fix_sentence
from ..exposition import report_plots, runbook_pages
from ..model.finding import RESULT_WORDS, evidence_pairs
from ..store.journal import ActionRow, Store, StoredIncident, StoredRun

if TYPE_CHECKING:
    from ..model.run_state import CheckpointPoint


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


def load(store: Store, run_id: str, incarnation: int | None = None) -> RunRecord:
    """One incarnation of a run id (None: its newest); nothing of another one is read, so a
    relaunch under the same id never shows, nor hides, the verdicts of the life before."""
    run = store.run(run_id, incarnation)
    if run is None:
        lives = store.incarnations(run_id)
        if lives:
            raise ReportUnavailable(f"run {run_id!r} has no incarnation {incarnation} in the "
                                    f"state database (it has {', '.join(map(str, lives))})")
        known = ", ".join(r.run_id for r in store.runs()[-10:]) or "none"
        raise ReportUnavailable(f"no run {run_id!r} in the state database (recent: {known}; "
                                "every run: deadweight runs --state-dir DIR)")
    life = run.incarnation
    return RunRecord(
        run=run,
        steps=store.history(run_id, "step", life),
        logs=store.history(run_id, "log", life),
        incidents=store.incidents(run_id, life),
        actions=store.actions(run_id=run_id, incarnation=life),
        checkpoints=store.checkpoints(run_id, life),
    )


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


def verdicts_of(record: RunRecord) -> list[StoredIncident]:
    """Every incident of the run: those of ``ordered_verdicts`` first, then the rest by step
    (info verdicts), each detector's incidents in the order they fired."""
    leading = ordered_verdicts(record)
    shown = {i.detector for i in leading}
    order = leading + sorted((i for i in record.incidents if i.detector not in shown),
                             key=lambda i: i.step)
    rank = {i.detector: n for n, i in enumerate(order)}
    return sorted(record.incidents, key=lambda i: (rank.get(i.detector, len(rank)), i.incident))


def incident_state(record: RunRecord, incident: StoredIncident) -> str:
    """firing / firing at end / resolved (cleared while the run was live)."""
    return verdict_order.state(incident, record.run)


def evidence_text(incident: StoredIncident) -> str:
    """key=value as at firing, with the latest value beside it where it differs (the same
    reading as ``deadweight status``)."""
    pairs = evidence_pairs(incident.evidence, incident.latest_evidence)
    return ", ".join(f"{key}={value}" for key, value in pairs)


def ordered_verdicts(record: RunRecord) -> list[StoredIncident]:
    """One incident per detector, critical and warning ones, root causes first."""
    return verdict_order.first_per_detector(record.incidents)


def verdict_state(incident: StoredIncident, run: StoredRun) -> str:
    """firing / firing at end / resolved at TIME (``verdict_order.state``)."""
    said = verdict_order.state(incident, run)
    return f"{said} {_when(incident.resolved_at)}" if said == verdict_order.RESOLVED else said


@dataclass(frozen=True)
class Headline:
    """What a reader takes in first: the verdict, its root cause, the fix and where to read."""

    css: str
    title: str
    root: StoredIncident | None
    fix: str
    runbook_url: str
    others: list[StoredIncident]


def headline(record: RunRecord, runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN
             ) -> Headline:
    verdicts = ordered_verdicts(record)
    stopped = [a for a in record.actions if a.action in ("stop", "sigterm", "sigkill")
               and a.result in ("sent", "delivered", "ok", "signalled")]
    if not verdicts:
        norms = [values["update_norm"] for _, _, values in record.steps
                 if "update_norm" in values]
        moved = sum(1 for n in norms if n > 0)
        if not norms:  # unjudged is not healthy
            return Headline("warn", "NO OPTIMIZER STEP RECORDED: nothing to judge the weights "
                            "by; no verdict fired", None, "", "", [])
        return Headline("good", f"HEALTHY: the weights moved at {moved} of {len(norms)} "
                        "optimizer steps; no critical or warning verdict", None, "", "", [])
    root = verdicts[0]
    if any(v.severity == "critical" for v in verdicts):
        css, title = "bad", f"NOT LEARNING: root cause {root.detector} (fired at step {root.step})"
        if stopped:
            title += (f"; deadweight stopped the run ({stopped[0].action} for "
                      f"{stopped[0].detector})")
    else:
        css, title = "warn", f"WARNING: {root.detector} (fired at step {root.step})"
    return Headline(css, title, root, fix_sentence(root.detector, root.evidence),
                    runbook_url(runbook_url_pattern, root.detector), verdicts[1:])


_CODE = re.compile(r"`([^`]+)`")


def _inline(text: str) -> str:
    """Escaped text with Markdown `code` spans as <code>."""
    return _CODE.sub(r"<code>\1</code>", html.escape(text, quote=False))


def _banner(top: Headline, run: StoredRun) -> str:
    parts = [f"<section class='verdict {top.css}'>",
             f"<p class=title>{html.escape(top.title)}</p>"]
    root = top.root
    if root is not None:
        meaning = BY_ID[root.detector].spec.meaning if root.detector in BY_ID else ""
        parts.append(f"<p class=root-cause><b>{html.escape(root.detector)}</b> "
                     f"({html.escape(root.severity)}, {html.escape(verdict_state(root, run))})"
                     f": {html.escape(meaning or root.summary)}</p>")
        if meaning:
            parts.append(f"<p class=evidence>Evidence: {html.escape(root.summary)}</p>")
        if top.fix:
            parts.append(f"<p class=fix><b>Fix:</b> {_inline(top.fix)}</p>")
        url = html.escape(top.runbook_url)
        parts.append(f"<p class=runbook><b>Runbook:</b> <a href=\"{url}\">{url}</a> "
                     "(also <a href=\"#runbook\">at the end of this page</a>)</p>")
    if top.others:
        listed = ", ".join(f"{html.escape(i.detector)} (fired at step {i.step})"
                           for i in top.others)
        parts.append(f"<p class=others>Also fired, in cause order: {listed}</p>")
    parts.append("</section>")
    return "\n".join(parts)


def _verdict_caption(verdicts: Sequence[StoredIncident]) -> str:
    """The names of the dashed lines on the plots (kept off the axes, where they overlap)."""
    if not verdicts:
        return "<p class=caption>No verdict fired.</p>"
    by_step: dict[int, list[str]] = {}
    for i in sorted(verdicts, key=lambda i: i.step):
        by_step.setdefault(i.step, []).append(i.detector)
    marks = " · ".join(f"step {s}: {', '.join(names)}" for s, names in by_step.items())
    return (f"<p class=caption>Dashed lines mark verdicts (<span class=crit>red</span> "
            f"critical, <span class=warnc>orange</span> warning): {html.escape(marks)}</p>")


def module_movement(record: RunRecord) -> dict[str, report_plots.ModuleMovement]:
    """module kind -> how it moved, from the per-step history."""
    return report_plots.module_movement(record.steps)


def _module_note(movement: dict[str, report_plots.ModuleMovement]) -> str:
    frozen = sorted(name for name, m in movement.items() if m.not_moving)
    if frozen and len(frozen) == len(movement):
        return ("<p class='caption crit'>Not moving: every module kind stayed byte-identical "
                "at every optimizer step.</p>")
    if frozen:
        return (f"<p class='caption crit'>Not moving: {html.escape(', '.join(frozen))} stayed "
                "byte-identical at every optimizer step; the others moved.</p>")
    return "<p class=caption>Every module kind moved.</p>"


STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#212121;max-width:1200px}
h1{font-size:20px;margin-bottom:4px} h2{font-size:16px;margin-top:28px}
.verdict{padding:12px 18px;border-radius:6px;font-size:15px;line-height:1.45}
.verdict p{margin:6px 0}.verdict .title{font-size:20px;font-weight:700}
.verdict code{background:rgba(255,255,255,.7);padding:0 .25em;border-radius:3px}
.bad{background:#ffebee;color:#b71c1c}.warn{background:#fff3e0;color:#e65100}
.good{background:#e8f5e9;color:#1b5e20}.verdict .fix{font-size:17px;color:#212121}
.verdict a{color:#0d47a1}.others,.evidence{color:#424242;font-size:13px}
.caption{color:#616161;font-size:13px;margin:2px 0 8px}.crit{color:#c62828}
.warnc{color:#ef6c00}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f5f5f5}td:nth-child(-n+6){white-space:nowrap}.quiet{color:#757575}
.meta{color:#616161;font-size:13px}svg{max-width:100%;height:auto}
.runbook-text{font-size:14px;line-height:1.5;max-width:52rem}.runbook-text h1{font-size:16px}
.runbook-text h2{font-size:14px}.runbook-text code{background:#f3f3f3;padding:0 .2em}
"""


def render(record: RunRecord, frozen_ratio_floor: float = 0.01,
           runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN) -> str:
    """The whole page as one HTML string (inline SVG and CSS, no script, nothing fetched).

    Top to bottom: the verdict with its root cause, fix and runbook link; did the weights
    move; the RL or preference signals when the run logged them; per-module movement; the
    verdicts, root causes first; the actions; the checkpoint hash chain.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError as err:
        raise ReportUnavailable(
            "the report needs matplotlib: pip install 'deadweight[report]'") from err
    run = record.run
    top = headline(record, runbook_url_pattern)
    verdicts = ordered_verdicts(record)
    state = (f"ended ({run.end_reason}) at {_when(run.ended_at)}" if run.ended else "running")
    life = (f"incarnation {run.incarnation} (the run id was used before: --incarnation N for "
            f"an earlier one) · " if run.incarnation > 1 else "")
    last_step = record.steps[-1][0] if record.steps else 0
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>deadweight report: {html.escape(run.run_id)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>deadweight report: {html.escape(run.run_id)}</h1>",
        f"<p class=meta>{html.escape(life)}trainer {html.escape(run.trainer or '?')} · "
        f"{html.escape(state)} · "
        f"{len(record.steps)} optimizer steps recorded (last {last_step}) · "
        f"{len(record.checkpoints)} checkpoints</p>",
        _banner(top, run),
        "<h2>Did the weights move?</h2>",
        report_plots.movement(record.steps, record.logs, verdicts, frozen_ratio_floor),
        _verdict_caption(verdicts),
    ]
    rl = report_plots.small_multiples(
        record.logs, report_plots.rl_keys(record.logs, run.trainer), verdicts)
    if rl is not None:
        parts += ["<h2 id=rl>Reinforcement learning signals</h2>", rl]
    preference = report_plots.small_multiples(
        record.logs, [k for k in report_plots.PREFERENCE_KEYS
                      if report_plots.series(record.logs, k)[0]], verdicts)
    if preference is not None:
        parts += ["<h2 id=preference>Preference signals (DPO implicit rewards)</h2>", preference]
    parts += _baseline_section(record)
    movement = module_movement(record)
    modules = report_plots.modules(movement)
    if modules is not None:
        parts += ["<h2>Per-module movement</h2>", _module_note(movement), modules]
    parts += [
        "<h2>Verdicts (root causes first)</h2>",
        _table(("detector", "severity", "policy", "fired at step", "fired", "state",
                "latest summary",
                "evidence (at firing, latest where it differs)"), [
            (i.detector, i.severity, i.policy, str(i.step), _when(i.fired_at),
             verdict_state(i, run), i.summary, evidence_text(i)) for i in verdicts_of(record)]),
        "<h2>Actions</h2>",
        _table(("time", "detector", "action", "result", "rank", "pid"), [
            (_when(a.time), f"{a.detector}#{a.incident}", a.action + (" (dry run)" if a.dry_run
                                                                       else ""),
             RESULT_WORDS.get(a.result, a.result), "" if a.rank is None else str(a.rank),
             "" if a.pid is None else str(a.pid))
            for a in record.actions]),
        "<h2>Checkpoint hash chain</h2>",
        _table(("step", "path", "adapter digest", "bytes", "same as"), _chain(record)),
    ]
    if top.root is not None:
        parts += [f"<h2 id=runbook>Runbook of the root cause: {html.escape(top.root.detector)}"
                  "</h2>", _embedded_runbook(top.root.detector, runbook_url_pattern)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _baseline_section(record: RunRecord) -> list[str]:
    """The run's figures over the bands of the baseline it was judged against (none: [])."""
    from ..baseline.live import label, parsed
    from ..baseline.model import Baseline
    from ..baseline.plots import overlay

    start = record.run.start
    baseline = parsed(start)
    if start is None or baseline is None:
        return []
    head = [f"<h2 id=baseline>Compared with baseline {html.escape(label(start))}</h2>"]
    if not isinstance(baseline, Baseline):
        return [*head, "<p class='caption crit'>The baseline could not be read: nothing was "
                "compared.</p>"]
    total = int(start.config.get("total_steps", 0.0)) or baseline.steps
    drawn = overlay(record.steps, record.logs, baseline, total)
    caption = ("<p class=caption>Grey: the band healthy runs of this recipe showed at each "
               "point of training (dashed: their median); blue: this run.</p>")
    return [*head, caption, drawn or "<p class=quiet>no figure in common</p>"]


_RUNBOOK_LINK = re.compile(r'href="([a-z0-9_]+)\.md"')


def _embedded_runbook(detector: str, pattern: str) -> str:
    """The root cause's runbook inside the page (the page is read where no link may open);
    its links to sibling runbooks point where the runbook link does."""
    fragment = runbook_pages.body(detector)
    return "<div class=runbook-text>" + _RUNBOOK_LINK.sub(
        lambda m: f'href="{html.escape(runbook_url(pattern, m.group(1)))}"', fragment) + "</div>"


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
