"""``deadweight status``: ask a running sidecar for its live runs and show them as a table.

The sidecar bounds its answer (``registry.status_report.bounded``); this client accepts up to
``STATUS_MAX_BYTES`` (the stream's 4 MB limit is for training clients).
"""

from __future__ import annotations

from ...proto import monitor_stub, pb
from ...proto.transport import bearer_metadata, grpc_target, open_channel
from ..detectors.spec import root_causes_first
from ..model.finding import (
    FIRING,
    FIRING_AT_END,
    OPERATOR,
    RESULT_WORDS,
    evidence_pairs,
    fired_and_latest,
    verdict_state,
)
from ..registry.status_report import STATUS_MAX_BYTES


def fetch(
    address: str, token: str | None = None, timeout: float = 5.0, tls_ca: bytes | None = None,
    run_id: str = "",
) -> pb.StatusResponse:
    """The sidecar's Status answer (one run when run_id is given); raises ``grpc.RpcError``
    when it cannot be reached."""
    metadata = bearer_metadata(token)
    with open_channel(grpc_target(address), tls_ca,
                      max_receive_bytes=STATUS_MAX_BYTES + 1024 * 1024) as channel:
        stub = monitor_stub(channel)
        response: pb.StatusResponse = stub.Status(
            pb.StatusRequest(run_id=run_id), timeout=timeout, metadata=metadata
        )
        return response


#: Actions that end a run, in the order the sidecar escalates them.
ENDING_ACTIONS = {"stop": "STOP", "sigterm": "SIGTERM", "sigkill": "SIGKILL"}
SENT = frozenset({"sent", "delivered", "signalled", "dry_run"})


def run_state(run: pb.RunStatus) -> str:
    """running / ended (reason) / stopped by <detector> ..., root cause <detector>: what
    happened to the run. A verdict's STOP or signal names the root cause among the run's
    firing verdicts when it is not the detector that triggered it."""
    taken = [a for a in run.actions if a.action in ENDING_ACTIONS and a.result in SENT]
    if taken:
        last = taken[-1]
        what = ENDING_ACTIONS[last.action] + (" (dry run)" if last.result == "dry_run" else "")
        verb = "stopped" if last.action == "stop" else "killed"
        at = f" at step {last.step}" if last.step else ""
        state = f"{verb} by {last.detector}{at} ({what})"
        if last.detector != OPERATOR:
            firing = [f.detector for f in run.findings if f.firing]
            root = root_causes_first([*firing, last.detector])[0]
            if root != last.detector:
                state += f", root cause {root}"
        return state + (f", ended ({run.end_reason})" if run.ended else ", still running")
    if run.ended:
        return f"ended ({run.end_reason})" if run.end_reason else "ended"
    return "running"


def state_mark(finding: pb.Finding, run_ended: bool) -> str:
    """FIRING / FIRING AT END / resolved (a sidecar without ``state`` is read from firing)."""
    state = finding.state or verdict_state(finding.firing, run_ended)
    return {FIRING: "FIRING  ", FIRING_AT_END: "FIRING AT END"}.get(state, "resolved")


def evidence_lines(finding: pb.Finding) -> list[str]:
    """key = value as at firing, with the latest value beside it where it differs."""
    at_firing = dict(finding.evidence_at_firing) or dict(finding.evidence)
    return [f"{key} = {value}" for key, value in evidence_pairs(at_firing, finding.evidence)]


def render(status: pb.StatusResponse) -> str:
    """What the sidecar warns about its set-up, then one block per run: a header line, then
    one line per detector that has fired."""
    warnings = [f"WARNING: {text}" for text in status.warnings]
    if not status.runs:
        return "\n".join([*warnings, "no runs"])
    lines = [*warnings,
             f"{'RUN':<32} {'TRAINER':<14} {'RANKS':<6} {'STEP':>6} {'SEEN':>7}  STATE"]
    for run in sorted(status.runs, key=lambda r: r.run_id):
        by_id = {f.detector: f for f in run.findings}
        findings = [by_id[d] for d in root_causes_first(list(by_id))]  # causes lead
        firing = [f for f in findings if f.firing]
        state = run_state(run)
        if firing:
            state += ("; FIRING AT END " if run.ended else "; FIRING ") + ",".join(
                f.detector for f in firing)
        lines.append(
            f"{run.run_id:<32} {run.trainer:<14} {len(run.ranks):<6} {run.step:>6} "
            f"{run.last_seen_seconds:>6.0f}s  {state}"
        )
        if run.wrapper:
            lines.append(f"  wrapper {run.wrapper}" + (", sharded" if run.sharded else ""))
        if run.baseline:
            lines.append(f"  judged against baseline {run.baseline}")
        for f in findings:
            lines.append(f"  {state_mark(f, run.ended)} {f.detector} [{f.severity}, policy "
                         f"{f.policy}] {fired_and_latest(f.step, f.summary)}")
            lines += [f"      {line}" for line in evidence_lines(f)]
        for a in run.actions:
            at = f" at step {a.step}" if a.step else ""
            lines.append(f"  action   {a.action} for {a.detector}{at}: "
                         f"{RESULT_WORDS.get(a.result, a.result)}")
        for silence in run.silences:
            lines.append(silence_line(silence))
    return "\n".join(lines)


def silence_line(silence: pb.SilenceStatus, now: float | None = None) -> str:
    """``silenced DETECTOR until HH:MM:SSZ (Ns left): reason`` for one silence."""
    import time

    left = max(0.0, silence.until - (time.time() if now is None else now))
    until = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(silence.until))
    why = f": {silence.reason}" if silence.reason else ""
    return f"  silenced {silence.detector} until {until} ({left:.0f}s left){why}"
