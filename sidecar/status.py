"""``deadweight status``: ask a running sidecar for its live runs and show them as a table.

The sidecar bounds its answer (``registry.status_report.bounded``); this client accepts up to
``STATUS_MAX_BYTES`` (the stream's 4 MB limit is for training clients).
"""

from __future__ import annotations

from ..proto import monitor_stub, pb
from ..proto.transport import bearer_metadata, grpc_target, open_channel
from .registry.status_report import STATUS_MAX_BYTES


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
    """running / ended (reason) / stopped by <detector> ... : what happened to the run."""
    taken = [a for a in run.actions if a.action in ENDING_ACTIONS and a.result in SENT]
    if taken:
        last = taken[-1]
        what = ENDING_ACTIONS[last.action] + (" (dry run)" if last.result == "dry_run" else "")
        verb = "stopped" if last.action == "stop" else "killed"
        at = f" at step {last.step}" if last.step else ""
        state = f"{verb} by {last.detector}{at} ({what})"
        return state + (f", ended ({run.end_reason})" if run.ended else ", still running")
    if run.ended:
        return f"ended ({run.end_reason})" if run.end_reason else "ended"
    return "running"


def render(status: pb.StatusResponse) -> str:
    """One block per run: a header line, then one line per detector that has fired."""
    if not status.runs:
        return "no runs"
    lines = [f"{'RUN':<32} {'TRAINER':<14} {'RANKS':<6} {'STEP':>6} {'SEEN':>7}  STATE"]
    for run in sorted(status.runs, key=lambda r: r.run_id):
        firing = [f for f in run.findings if f.firing]
        state = run_state(run)
        if firing:
            state += "; FIRING " + ",".join(f.detector for f in firing)
        lines.append(
            f"{run.run_id:<32} {run.trainer:<14} {len(run.ranks):<6} {run.step:>6} "
            f"{run.last_seen_seconds:>6.0f}s  {state}"
        )
        if run.wrapper:
            lines.append(f"  wrapper {run.wrapper}" + (", sharded" if run.sharded else ""))
        for f in run.findings:
            mark = "FIRING  " if f.firing else "resolved"
            lines.append(f"  {mark} {f.detector} [{f.severity}, policy {f.policy}] "
                         f"fired at step {f.step}: {f.summary}")
            for key, value in sorted(f.evidence.items()):
                lines.append(f"      {key} = {value}")
        for a in run.actions:
            at = f" at step {a.step}" if a.step else ""
            lines.append(f"  action   {a.action} for {a.detector}{at}: {a.result}")
    return "\n".join(lines)
