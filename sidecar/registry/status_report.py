"""The registry's runs as the ``Status`` RPC's answer (what ``deadweight status`` prints).

The answer is bounded (``bounded``): texts and evidence are cut, and past ``STATUS_MAX_BYTES``
the least recently seen runs are left out and counted in a last line, so many runs or a
hostile client's long strings never make Status fail.
"""

from __future__ import annotations

from ...proto import pb
from ..baseline.live import label as baseline_label
from ..detectors.spec import root_causes_first
from ..model.finding import SEVERITY_ORDER, Finding, verdict_state
from ..model.run_state import RunState
from ..store.journal import ActionRow


def ordered(findings: list[Finding]) -> list[Finding]:
    """Root causes before their symptoms; otherwise critical first, then by detector id."""
    by_id = {f.detector: f for f in findings}
    ids = sorted(by_id, key=lambda d: (SEVERITY_ORDER.get(by_id[d].severity, 3), d))
    return [by_id[d] for d in root_causes_first(ids)]


#: Largest Status answer the sidecar sends and ``deadweight status`` accepts.
STATUS_MAX_BYTES = 16 * 1024 * 1024
#: Longest summary or evidence value shown per finding.
MAX_STATUS_TEXT = 512
#: Most evidence entries shown per finding.
MAX_STATUS_EVIDENCE = 32
#: Marks the line that counts runs left out of a bounded answer.
OMITTED_PREFIX = "(omitted)"


def _cut(text: str, limit: int = MAX_STATUS_TEXT) -> str:
    return text if len(text) <= limit else text[:limit] + f"... (+{len(text) - limit} chars)"


def bounded(response: pb.StatusResponse, limit: int = STATUS_MAX_BYTES) -> pb.StatusResponse:
    """The same answer with cut texts, and no more runs than fit in limit bytes."""
    runs = []
    for run in response.runs:
        clean = pb.RunStatus()
        clean.CopyFrom(run)
        clean.run_id, clean.trainer = _cut(run.run_id), _cut(run.trainer)
        for finding in clean.findings:
            finding.summary = _cut(finding.summary)
            for evidence in (finding.evidence, finding.evidence_at_firing):
                pairs = sorted(evidence.items())
                evidence.clear()
                for key, value in pairs[:MAX_STATUS_EVIDENCE]:
                    evidence[_cut(key, 128)] = _cut(value)
        runs.append(clean)
    runs.sort(key=lambda r: (r.ended, r.last_seen_seconds))  # live and recent first
    out, size = pb.StatusResponse(), 0
    budget = limit - 1024  # room for the line that counts what was left out
    for index, run in enumerate(runs):
        cost = run.ByteSize() + 8
        if size + cost > budget:
            out.runs.append(pb.RunStatus(
                run_id=f"{OMITTED_PREFIX} {len(runs) - index} more runs: the answer is "
                f"capped at {limit} bytes", ended=True))
            break
        out.runs.append(run)
        size += cost
    return out


def status_response(runs: list[tuple[RunState, list[Finding]]],
                    actions: dict[str, list[ActionRow]], now: float) -> pb.StatusResponse:
    response = pb.StatusResponse()
    for run, findings in runs:
        response.runs.append(
            pb.RunStatus(
                run_id=run.run_id,
                trainer=run.trainer,
                ranks=sorted(run.ranks),
                step=run.step,
                last_seen_seconds=max(0.0, now - run.last_seen),
                ended=run.ended,
                wrapper=run.start.wrapper if run.start is not None else "",
                sharded=run.start.sharded if run.start is not None else False,
                end_reason=run.end_reason if run.ended else "",
                started_at=run.created,
                incarnation=run.incarnation,
                baseline=baseline_label(run.start),
                ended_at=run.ended_at if run.ended else 0.0,
                actions=[
                    pb.ActionTaken(detector=a.detector, action=a.action, result=a.result,
                                   time=a.time, step=int(a.detail.get("step", 0) or 0))
                    for a in actions.get(run.run_id, [])
                ],
                findings=[
                    pb.Finding(
                        detector=f.detector, severity=f.severity, firing=f.firing,
                        step=f.step, summary=f.summary, evidence=f.evidence,
                        policy=f.policy,
                        state=verdict_state(f.firing, run.ended, f.resolved_at or None,
                                            run.ended_at),
                        evidence_at_firing=f.fired_evidence or f.evidence,
                    )
                    for f in ordered(findings)
                ],
            )
        )
    return response
