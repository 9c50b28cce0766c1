"""``deadweight status --json``: the Status answer as one JSON document with stable keys.

For scripts and on-call tooling. The keys below are a contract (the README lists them); a new
key may be added, none is renamed or removed without a new ``schema`` value.

Top level: ``schema`` ("deadweight.status/v1"), ``runs`` (list), ``omitted_runs`` (runs left
out of a bounded answer, 0 normally), ``warnings`` (what the sidecar warns about its own
set-up, one sentence each; empty normally). Each run: ``run_id``, ``trainer``, ``ranks``, ``step``,
``last_seen_seconds``, ``ended``, ``end_reason``, ``started_at`` and ``ended_at`` (unix
seconds, null while unknown or live), ``state`` (the sentence ``deadweight status``
prints), ``wrapper``, ``sharded``, ``baseline`` (the baseline the run is judged against, its
file name and runs as ``deadweight status`` prints them; null when it names none),
``findings``, ``actions``. Each finding (root causes
first): ``detector``, ``severity``, ``policy``, ``state`` ("firing", "firing at end" or
"resolved"), ``firing``, ``step``, ``summary``, ``evidence`` (object of strings). Each action
(oldest first): ``detector``, ``action``, ``result``, ``time`` (unix seconds), ``step``.
"""

from __future__ import annotations

import json
from typing import Any

from ...proto import pb
from ..detectors.spec import root_causes_first
from ..model.finding import verdict_state
from ..registry.status_report import OMITTED_PREFIX
from .status import run_state

SCHEMA = "deadweight.status/v1"
RUN_KEYS = ("run_id", "trainer", "ranks", "step", "last_seen_seconds", "ended", "end_reason",
            "started_at", "ended_at", "state", "wrapper", "sharded", "baseline", "findings",
            "actions")
FINDING_KEYS = ("detector", "severity", "policy", "state", "firing", "step", "summary",
                "evidence")
ACTION_KEYS = ("detector", "action", "result", "time", "step")


def finding_state(finding: pb.Finding, run: pb.RunStatus) -> str:
    """The state the sidecar sent (an older one sends none: read from ``firing``)."""
    return finding.state or verdict_state(finding.firing, run.ended)


def _omitted(run: pb.RunStatus) -> int:
    """How many runs a bounded answer's last line counts ("(omitted) N more runs: ...")."""
    words = run.run_id[len(OMITTED_PREFIX):].split()
    return int(words[0]) if words and words[0].isdigit() else 0


def _run(run: pb.RunStatus) -> dict[str, Any]:
    by_id = {f.detector: f for f in run.findings}
    findings = [by_id[d] for d in root_causes_first(list(by_id))]
    return {
        "run_id": run.run_id, "trainer": run.trainer, "ranks": list(run.ranks),
        "step": run.step, "last_seen_seconds": run.last_seen_seconds, "ended": run.ended,
        "end_reason": run.end_reason, "started_at": run.started_at or None,
        "ended_at": run.ended_at or None, "state": run_state(run), "wrapper": run.wrapper,
        "sharded": run.sharded, "baseline": run.baseline or None,
        "findings": [{
            "detector": f.detector, "severity": f.severity, "policy": f.policy,
            "state": finding_state(f, run), "firing": f.firing, "step": f.step,
            "summary": f.summary, "evidence": dict(sorted(f.evidence.items())),
        } for f in findings],
        "actions": [{"detector": a.detector, "action": a.action, "result": a.result,
                     "time": a.time, "step": a.step} for a in run.actions],
    }


def document(status: pb.StatusResponse) -> dict[str, Any]:
    """The answer as plain data (live and recent runs first, as the sidecar sent them)."""
    runs, omitted = [], 0
    for run in status.runs:
        if run.run_id.startswith(OMITTED_PREFIX):
            omitted += _omitted(run)
        else:
            runs.append(_run(run))
    return {"schema": SCHEMA, "runs": runs, "omitted_runs": omitted,
            "warnings": list(status.warnings)}


def dumps(status: pb.StatusResponse) -> str:
    return json.dumps(document(status), indent=2, sort_keys=False)
