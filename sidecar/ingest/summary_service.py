"""``SignSummary``: the run summary composed from the sidecar's own state, and signed.

The trainer sends only what the sidecar cannot know, the digest of the adapter it is about to
write; the verdicts, their states, the actions and the end reason come from the registry and
the journal, so a trainer cannot leave a verdict out. Only a process the kernel names as one
bound to the run may ask (a fresh attestation nonce, redeemed here): another job of the same
uid cannot get a healthy run's summary signed beside its own adapter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...proto import pb, run_summary
from ..model.finding import Finding
from ..verdicts import causes_first

if TYPE_CHECKING:
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


def verdict_state(finding: Finding, ended: bool, ended_at: float) -> str:
    """firing, firing at end (it stood when the run ended: the end does not resolve it), or
    resolved (it cleared while the run was live)."""
    if finding.firing:
        return run_summary.FIRING_AT_END if ended else run_summary.FIRING
    if ended and finding.resolved_at and finding.resolved_at >= ended_at:
        return run_summary.FIRING_AT_END  # resolved by the end itself, not by a recovery
    return run_summary.RESOLVED


def compose(run: _RunView, findings: list[Finding], actions: list[dict[str, str]],
            adapter: pb.AdapterDigest, now: float) -> dict[str, Any]:
    """The summary body (``run_summary.RunSummary`` fields) for one adapter of run."""
    verdicts = [
        run_summary.SummaryVerdict(
            detector=f.detector, severity=f.severity,
            firing=(state := verdict_state(f, run.ended, run.ended_at)) != run_summary.RESOLVED,
            step=int(f.step), summary=f.summary, state=state, policy=f.policy)
        for f in findings if f.incidents or f.firing]
    ordered = causes_first(verdicts, lambda v: (v.detector, v.severity, v.step))
    return run_summary.RunSummary(
        run_id=run.run_id, step=run.step, adapter_tensors=dict(adapter.tensors),
        adapter_digest=adapter.combined, sidecar="answered",
        end_reason=run.end_reason if run.ended else "", verdicts=ordered, actions=actions,
        ended=run.ended, output_dir=run.output_dir, signed_at=int(now),
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


def _asker(registry: Registry, request: pb.SignSummaryRequest) -> ProcessIdentity:
    if registry.attestor is None:
        raise SummaryRefused("FAILED_PRECONDITION", "this sidecar has no attestation")
    identity = registry.attestor.redeem(request.attestation)
    if identity is None:
        raise SummaryRefused("PERMISSION_DENIED", "unknown, used or stale attestation nonce")
    return identity


def signed_summary(registry: Registry, signer: SummarySigner, request: pb.SignSummaryRequest,
                   from_unix: bool, now: float | None = None) -> pb.SignSummaryResponse:
    """The signed summary for the run's own process; raises SummaryRefused otherwise."""
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
                       state.end_reason, state.start.output_dir if state.start else "")
        findings = list(registry.findings(request.run_id).values())
        incarnation = state.incarnation
    actions = [{"detector": a.detector, "action": a.action, "result": a.result,
                "step": str(a.detail.get("step", "") or "")}
               for a in registry.store.actions(run_id=request.run_id,
                                               incarnation=incarnation)[-MAX_ACTIONS:]]
    body = run_summary.canonical(compose(run, findings, actions, request.adapter,
                                         time.time() if now is None else now))
    return pb.SignSummaryResponse(body=body, signature=signer.sign(body), key_id=signer.key_id)
