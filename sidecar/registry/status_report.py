"""The registry's runs as the ``Status`` RPC's answer (what ``deadweight status`` prints)."""

from __future__ import annotations

from ...proto import pb
from ..model.finding import Finding
from ..model.run_state import RunState
from ..store.journal import ActionRow


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
                    )
                    for f in sorted(findings, key=lambda f: f.detector)
                ],
            )
        )
    return response
