"""``deadweight runs``: the runs a state dir or a live sidecar knows, one line each.

From ``--state-dir`` (the sidecar's, or a copy of its database: no sidecar needs to run) it
gives each run's id, trainer, start, end and final verdicts, the journal's own record. From a
live sidecar it asks the Status RPC, which holds the same for the runs in its memory.

``--json`` keys (stable, like ``deadweight status --json``): ``schema``
("deadweight.runs/v1"), ``source`` ("state_dir" or "sidecar"), ``runs``; each run:
``run_id``, ``trainer``, ``started_at`` and ``ended_at`` (unix seconds or null), ``ended``,
``end_reason``, ``verdicts`` (root causes first: ``detector``, ``severity``, ``state``,
``step``, ``summary``), ``incarnation`` (which life of a run id used again: each life is its
own line, with its own verdicts).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from ...proto import pb
from .. import verdicts as verdict_order
from ..registry.status_report import OMITTED_PREFIX
from ..store.journal import Store
from . import status_json

SCHEMA = "deadweight.runs/v1"


@dataclass(frozen=True)
class RunVerdict:
    detector: str
    severity: str
    state: str
    step: int
    summary: str


@dataclass(frozen=True)
class RunLine:
    run_id: str
    trainer: str
    started_at: float | None
    ended_at: float | None
    ended: bool
    end_reason: str
    verdicts: list[RunVerdict]
    incarnation: int = 1


def from_store(store: Store) -> list[RunLine]:
    """Every run in the database, oldest first, each incarnation of a run id on its own
    line with that incarnation's final verdict per detector."""
    lines = []
    for run in sorted(store.runs(), key=lambda r: (r.created, r.incarnation)):
        incidents = store.incidents(run.run_id, run.incarnation)
        verdicts = [RunVerdict(i.detector, i.severity, verdict_order.state(i, run), i.step,
                               i.summary)
                    for i in verdict_order.last_per_detector(incidents)]
        lines.append(RunLine(run.run_id, run.trainer, run.created,
                             run.ended_at if run.ended else None, run.ended, run.end_reason,
                             verdicts, run.incarnation))
    return lines


def from_status(status: pb.StatusResponse, now: float | None = None) -> list[RunLine]:
    """The live sidecar's runs; an older sidecar's answer (no times) falls back to the last
    time an ended run was heard from, and no start."""
    now = time.time() if now is None else now
    lines = []
    for run in status.runs:
        if run.run_id.startswith(OMITTED_PREFIX):
            continue
        data = status_json.document(pb.StatusResponse(runs=[run]))["runs"][0]
        verdicts = [RunVerdict(f["detector"], f["severity"], f["state"], f["step"],
                               f["summary"]) for f in data["findings"]]
        ended_at = (run.ended_at or now - run.last_seen_seconds) if run.ended else None
        lines.append(RunLine(run.run_id, run.trainer, run.started_at or None, ended_at,
                             run.ended, run.end_reason, verdicts, run.incarnation or 1))
    return sorted(lines, key=lambda line: (not line.ended, line.ended_at or now, line.run_id))


def _when(at: float | None) -> str:
    if at is None:
        return "—"
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S")


def _verdicts(line: RunLine) -> str:
    shown = [v for v in line.verdicts if v.severity in ("critical", "warning")]
    if not shown:
        return "no verdict"
    return ", ".join(f"{v.detector} ({v.severity}, {v.state})" for v in shown)


def _name(line: RunLine) -> str:
    """The run id, and which life of it when it was used before (``ID #2``)."""
    return line.run_id if line.incarnation == 1 else f"{line.run_id} #{line.incarnation}"


def render(lines: list[RunLine]) -> str:
    """A table; times in UTC. Final verdicts list critical and warning ones, causes first."""
    if not lines:
        return "no runs"
    width = max(3, *(len(_name(line)) for line in lines))
    trainer = max(7, *(len(line.trainer) for line in lines))
    rows = [f"{'RUN':<{width}}  {'TRAINER':<{trainer}}  {'STARTED (UTC)':<19}  "
            f"{'ENDED (UTC)':<19}  {'END':<14}  FINAL VERDICTS"]
    for line in lines:
        end = (line.end_reason or "ended") if line.ended else "running"
        rows.append(f"{_name(line):<{width}}  {line.trainer:<{trainer}}  "
                    f"{_when(line.started_at):<19}  {_when(line.ended_at):<19}  {end:<14}  "
                    f"{_verdicts(line)}")
    return "\n".join(rows)


def document(lines: list[RunLine], source: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "source": source, "runs": [asdict(line) for line in lines]}


def dumps(lines: list[RunLine], source: str) -> str:
    return json.dumps(document(lines, source), indent=2)
