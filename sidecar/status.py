"""``deadweight status``: ask a running sidecar for its live runs and show them as a table."""

from __future__ import annotations

from deadweight.proto import monitor_stub, pb
from deadweight.proto.transport import bearer_metadata, grpc_target, open_channel


def fetch(
    address: str, token: str | None = None, timeout: float = 5.0, tls_ca: bytes | None = None
) -> pb.StatusResponse:
    """The sidecar's Status answer; raises ``grpc.RpcError`` when it cannot be reached."""
    metadata = bearer_metadata(token)
    with open_channel(grpc_target(address), tls_ca) as channel:
        stub = monitor_stub(channel)
        response: pb.StatusResponse = stub.Status(
            pb.StatusRequest(), timeout=timeout, metadata=metadata
        )
        return response


def render(status: pb.StatusResponse) -> str:
    """One block per run: a header line, then one line per detector that has fired."""
    if not status.runs:
        return "no runs"
    lines = [f"{'RUN':<32} {'TRAINER':<14} {'RANKS':<6} {'STEP':>6} {'SEEN':>7}  STATE"]
    for run in sorted(status.runs, key=lambda r: r.run_id):
        firing = [f for f in run.findings if f.firing]
        state = "ended" if run.ended else "running"
        if firing:
            state += " FIRING " + ",".join(f.detector for f in firing)
        lines.append(
            f"{run.run_id:<32} {run.trainer:<14} {len(run.ranks):<6} {run.step:>6} "
            f"{run.last_seen_seconds:>6.0f}s  {state}"
        )
        for f in run.findings:
            mark = "FIRING  " if f.firing else "resolved"
            lines.append(f"  {mark} {f.detector} [{f.severity}, policy {f.policy}] "
                         f"step {f.step}: {f.summary}")
            for key, value in sorted(f.evidence.items()):
                lines.append(f"      {key} = {value}")
    return "\n".join(lines)
