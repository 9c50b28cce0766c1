"""``SignSummary``: the run summary composed from the sidecar's own state, and signed.

The trainer names the folder it wrote the adapter to and the digest it computed in memory;
the sidecar reads the files there itself (``checkpoints.access``: the checks its watcher
applies to the run's attested uid), digests them as ``deadweight inspect`` does and signs only
when they are the bytes claimed, so the run's own process cannot get a signature over a digest
of its choosing (a healthy twin's adapter, bytes it never wrote). The verdicts, their states,
the actions and the end reason come from the registry and the journal, so a trainer cannot
leave a verdict out. Only a process the kernel names as one bound to the run may ask (a fresh
attestation nonce, redeemed here): another job of the same uid cannot get a healthy run's
summary signed beside its own adapter. Nor the other way round: a run gets no signature over
an adapter another run produced first with a critical verdict (the journal's checkpoints and
signed summaries), unless it started from those bytes (its initial adapter, a resume), so a
clean run cannot launder a critical run's adapter folder.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...proto import pb, run_summary
from ..baseline.live import label as baseline_label
from ..checkpoints.access import inspect_as
from ..checkpoints.inspector import NotACheckpoint
from ..model.finding import Finding, verdict_state
from ..store.journal import StoreWriteFailed
from ..verdicts import causes_first

if TYPE_CHECKING:
    from ..model.inspection import CheckpointInspection
    from ..model.process import ProcessIdentity
    from ..registry import Registry
    from ..store.signing_key import SummarySigner

#: Tensors a summary may carry (an adapter has hundreds; a request with millions is refused).
MAX_TENSORS = 100_000
#: Actions listed in a summary (the newest; the journal keeps them all).
MAX_ACTIONS = 50


class SummaryRefused(Exception):
    """The sidecar does not sign for this request; ``code`` is the gRPC status to answer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _RunView:
    run_id: str
    step: int
    ended: bool
    ended_at: float
    end_reason: str
    output_dir: str
    baseline: str = ""


def summary_state(finding: Finding, ended: bool, ended_at: float) -> str:
    """The finding's state (``verdict_state``) for the summary file."""
    return verdict_state(finding.firing, ended, finding.resolved_at or None, ended_at)


def compose(run: _RunView, findings: list[Finding], actions: list[dict[str, str]],
            adapter: pb.AdapterDigest, now: float) -> dict[str, Any]:
    """The summary body (``run_summary.RunSummary`` fields) for one adapter of run."""
    verdicts = [
        run_summary.SummaryVerdict(
            detector=f.detector, severity=f.severity,
            firing=(state := summary_state(f, run.ended, run.ended_at)) != run_summary.RESOLVED,
            step=int(f.step), summary=f.summary, state=state, policy=f.policy)
        for f in findings if f.incidents or f.firing]
    ordered = causes_first(verdicts, lambda v: (v.detector, v.severity, v.step))
    return run_summary.RunSummary(
        run_id=run.run_id, step=run.step, adapter_tensors=dict(adapter.tensors),
        adapter_digest=adapter.combined, sidecar="answered",
        end_reason=run.end_reason if run.ended else "", verdicts=ordered, actions=actions,
        ended=run.ended, output_dir=run.output_dir, signed_at=int(now),
        baseline=run.baseline,
    ).body()


def _check(request: pb.SignSummaryRequest, from_unix: bool) -> None:
    if not request.run_id:
        raise SummaryRefused("INVALID_ARGUMENT", "run_id is empty")
    if not request.adapter.combined or not request.adapter.tensors:
        raise SummaryRefused("INVALID_ARGUMENT", "the adapter digest is empty")
    if len(request.adapter.tensors) > MAX_TENSORS:
        raise SummaryRefused("INVALID_ARGUMENT",
                             f"more than {MAX_TENSORS} tensors in the adapter digest")
    if not from_unix:
        raise SummaryRefused("PERMISSION_DENIED", "summaries are signed only for a process "
                             "that attests over the unix socket")
    if not request.attestation:
        raise SummaryRefused("PERMISSION_DENIED", "no attestation nonce: the sidecar signs "
                             "only for a process bound to the run")
    if not request.path:
        raise SummaryRefused("INVALID_ARGUMENT", "the request names no adapter folder: the "
                             "sidecar signs only adapter files it read itself (a callback "
                             "older than this sidecar sends none)")


def _files(request: pb.SignSummaryRequest, roots: Collection[Path],
           identity: ProcessIdentity) -> pb.AdapterDigest:
    """The digest of the adapter files at the request's path, read as the asker's uid may;
    refused when they cannot be read or are not the bytes the asker claims."""
    folder = Path(request.path)
    try:
        files: CheckpointInspection = inspect_as(folder, roots, identity.uid)
    except (NotACheckpoint, OSError) as err:  # CheckpointRefused is a NotACheckpoint
        raise SummaryRefused("FAILED_PRECONDITION", f"the sidecar cannot read the adapter "
                             f"files it would sign ({err}): nothing is signed that it did "
                             "not read") from err
    if not files.is_adapter or not files.tensor_digests:
        raise SummaryRefused("FAILED_PRECONDITION", f"{folder} holds no adapter weights to "
                             "sign")
    if files.adapter_digest != request.adapter.combined:
        raise SummaryRefused(
            "FAILED_PRECONDITION", f"the adapter files in {folder} digest to "
            f"{files.adapter_digest[:16]}, not the {request.adapter.combined[:16]} the request "
            "claims: the sidecar signs only the bytes it read (the files changed after the "
            "save, or the digest is not theirs)")
    return pb.AdapterDigest(combined=files.adapter_digest, tensors=files.tensor_digests,
                            bytes=files.tensor_bytes)


def _asker(registry: Registry, request: pb.SignSummaryRequest) -> ProcessIdentity:
    if registry.attestor is None:
        raise SummaryRefused("FAILED_PRECONDITION", "this sidecar has no attestation")
    identity = registry.attestor.redeem(request.attestation)
    if identity is None:
        raise SummaryRefused("PERMISSION_DENIED", "unknown, used or stale attestation nonce")
    return identity


def _produced_here(registry: Registry, request: pb.SignSummaryRequest, incarnation: int,
                   initial: str) -> None:
    """Refuse to sign over an adapter that another run (or another life of this run id)
    reported first and that drew a critical verdict there, unless this run started from it.
    A deterministic recipe run twice writes the same bytes twice: when the first run was
    healthy, the second one's signature gives those bytes no better record than they had."""
    digest = request.adapter.combined
    if digest == initial:
        return
    producer = registry.store.first_producer(digest)
    if producer is None or producer == (request.run_id, incarnation):
        return
    other, life = producer
    if not registry.store.had_critical(other, life):
        return
    raise SummaryRefused(
        "PERMISSION_DENIED", f"the adapter at {request.path} is the one run {other!r} (life "
        f"#{life}) produced, with a critical verdict, and run {request.run_id!r} did not "
        "start from it: its verdicts are that run's, and this run cannot sign over them")


def signed_summary(registry: Registry, signer: SummarySigner, request: pb.SignSummaryRequest,
                   from_unix: bool, now: float | None = None,
                   roots: Collection[str | Path] = ()) -> pb.SignSummaryResponse:
    """The signed summary for the run's own process, over the adapter files it read at the
    request's path (roots: the ``--watch-root`` folders); raises SummaryRefused otherwise."""
    _check(request, from_unix)
    identity = _asker(registry, request)
    with registry.lock:
        state = registry.run(request.run_id)
        if state is None:
            raise SummaryRefused("NOT_FOUND", f"the sidecar does not know run "
                                 f"{request.run_id!r} (never started, or expired)")
        bound = registry.identities(request.run_id)
        if identity not in bound.values():
            raise SummaryRefused(
                "PERMISSION_DENIED", f"{identity.describe()} is not a process of run "
                f"{request.run_id!r}: only the run's own processes get its summary signed")
        run = _RunView(state.run_id, state.step, state.ended, state.ended_at,
                       state.end_reason, state.start.output_dir if state.start else "",
                       baseline_label(state.start))
        findings = list(registry.findings(request.run_id).values())
        incarnation = state.incarnation
        initial = state.start.initial_adapter.combined if state.start else ""
    _produced_here(registry, request, incarnation, initial)
    # Read outside the lock: hashing an adapter takes longer than a batch may wait.
    adapter = _files(request, [Path(os.path.realpath(r)) for r in roots], identity)
    actions = [{"detector": a.detector, "action": a.action, "result": a.result,
                "step": str(a.detail.get("step", "") or "")}
               for a in registry.store.actions(run_id=request.run_id,
                                               incarnation=incarnation)[-MAX_ACTIONS:]]
    at = time.time() if now is None else now
    body = run_summary.canonical(compose(run, findings, actions, adapter, at))
    response = pb.SignSummaryResponse(body=body, signature=signer.sign(body),
                                      key_id=signer.key_id)
    # A full disk (logged by the store) must not cost the run its signature.
    with contextlib.suppress(StoreWriteFailed):
        registry.store.add_signed_adapter(adapter.combined, run.run_id, incarnation, at)
    return response
