"""Write the run summary a promotion gate checks (``deadweight inspect``).

At train end, rank 0 asks the sidecar for the run's verdicts and actions and writes
``deadweight-summary.json`` into the output folder (beside the adapter a later
``trainer.save_model()`` writes there) and into the last checkpoint, each with the digest of
the adapter that folder holds. Asking takes at most ``timeout`` seconds; a sidecar that does
not answer is written down as such, so a gate can tell "no verdict" from "no problem".
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from ..proto import monitor_stub, pb
from ..proto.run_summary import RunSummary, SummaryVerdict
from ..proto.transport import bearer_metadata, grpc_target, open_channel
from .digest import AdapterDigest

log = logging.getLogger("deadweight")


def fetch_verdicts(address: str, run_id: str, token: str | None, tls_root: bytes | None,
                   timeout: float) -> tuple[pb.RunStatus | None, str]:
    """(the run's status, "answered") or (None, why it is missing)."""
    try:
        with open_channel(grpc_target(address), tls_root) as channel:
            response: pb.StatusResponse = monitor_stub(channel).Status(
                pb.StatusRequest(run_id=run_id), timeout=timeout,
                metadata=bearer_metadata(token))
    except grpc.RpcError as err:
        code = err.code() if hasattr(err, "code") else None
        return None, f"sidecar unreachable at train end ({code})"
    run = next((r for r in response.runs if r.run_id == run_id), None)
    return (run, "answered") if run is not None else (None, "the sidecar does not know the run")


def summary_of(run_id: str, step: int, adapter: AdapterDigest, status: pb.RunStatus | None,
               sidecar: str) -> RunSummary:
    verdicts = [] if status is None else [
        SummaryVerdict(f.detector, f.severity, f.firing, int(f.step), f.summary)
        for f in status.findings]
    actions = [] if status is None else [
        {"detector": a.detector, "action": a.action, "result": a.result} for a in status.actions]
    return RunSummary(run_id=run_id, step=step, adapter_tensors=dict(adapter.tensors),
                      adapter_digest=adapter.combined, sidecar=sidecar,
                      end_reason="" if status is None else status.end_reason,
                      verdicts=verdicts, actions=actions)


def write(folders: list[tuple[Path, AdapterDigest]], run_id: str, step: int,
          status: pb.RunStatus | None, sidecar: str) -> list[Path]:
    """One summary per folder (each with its own adapter digest); failures are logged."""
    written = []
    for folder, adapter in folders:
        if not adapter.tensors or not folder.is_dir():
            continue  # not an adapter run, or the folder is gone
        try:
            written.append(summary_of(run_id, step, adapter, status, sidecar).write(folder))
        except OSError as err:
            log.warning("deadweight: cannot write the run summary into %s (%s)", folder, err)
    return written
