"""The promotion gate: an adapter passes only if it is the one its run produced and judged.

``deadweight inspect`` calls ``check`` for every adapter it audits, with the run summary
found beside it or up the folders (``summary_for``). The gate verifies the summary's
signature against the trusted public keys (``--trust-key``), fails an adapter whose bytes
are not the ones the run digested, lists every verdict of the run (root causes first: the
sidecar ordered them) and fails on critical ones and on a run the sidecar stopped. Warnings
are listed and fail only with ``--fail-on warning``; an unsigned or untrusted summary fails
with ``--require-signed``, a missing one with ``--require-summary``. A summary taken while
the run was live (a checkpoint's) says nothing of what the run did later: under
``--require-signed`` only one signed at or after the run's end (or its STOP) passes, so a
summary signed while the run was still healthy cannot be copied back beside the same bytes
after it froze.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...proto import run_summary
from ..detectors import BY_ID
from ..detectors.base import Verdict
from ..model.finding import fired_and_latest
from ..model.inspection import CheckpointInspection
from ..verdicts import causes_first

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

#: Gate outcomes as (id, severity) in the audit's findings; not detectors of a live run.
CHANGED = "adapter_not_what_the_run_produced"
VERDICT = "run_has_critical_verdict"
WARNING_VERDICT = "run_has_warning_verdict"
STOPPED = "run_stopped"
NO_VERDICTS = "run_verdicts_unknown"
MISSING = "summary_missing"
UNSIGNED = "summary_unsigned"
UNTRUSTED = "summary_untrusted_key"
TAMPERED = "summary_tampered"
NOT_FINAL = "summary_not_final"
GATE_IDS = frozenset({CHANGED, VERDICT, WARNING_VERDICT, STOPPED, NO_VERDICTS, MISSING,
                      UNSIGNED, UNTRUSTED, TAMPERED, NOT_FINAL})

#: Folders above an adapter searched for its run's summary (a checkpoint's output folder,
#: and one more for ``out/final``-style layouts).
MAX_FOLDERS_UP = 3

Finding = tuple[str, str, Verdict]


@dataclass(frozen=True)
class GateOptions:
    """What the gate trusts and what it treats as fatal (the inspect flags)."""

    #: key id -> trusted public key (``--trust-key``).
    trusted: dict[str, Ed25519PublicKey] = field(default_factory=dict)
    require_signed: bool = False
    require_summary: bool = False
    #: "critical" (default) or "warning": the least severe run verdict that fails.
    fail_on: str = "critical"


@dataclass(frozen=True)
class GateResult:
    findings: list[Finding]
    #: Lines a reader needs that are no finding (where the summary was found, ...).
    notes: list[str]


def summary_for(path: Path) -> Path | None:
    """The run summary beside an adapter folder or file, else the nearest one up to
    MAX_FOLDERS_UP folders above (the run's output folder holds one)."""
    folder = (path if path.is_dir() else path.parent).absolute()
    for candidate_dir in [folder, *folder.parents][:MAX_FOLDERS_UP + 1]:
        candidate = candidate_dir / run_summary.FILE_NAME
        if candidate.is_file():
            return candidate
    return None


def _required(flag: bool) -> str:
    return "critical" if flag else "warning"


def _signature(read: run_summary.SummaryFile, options: GateOptions) -> list[Finding]:
    run_id = read.summary.run_id
    if read.signature is None:
        why = read.unsigned_because or ("an old summary format" if read.schema == 1
                                        else "no reason given")
        return [(UNSIGNED, _required(options.require_signed), Verdict(
            True, summary=f"run {run_id}'s summary is not signed by a sidecar ({why}): "
            "anyone could have written it", evidence={"run_id": run_id}))]
    if not options.trusted:
        return []  # nothing to check it with: said in a note
    from ..store.signing_key import verifies  # keys given: it is installed
    key = options.trusted.get(read.signature.key_id)
    if key is None:
        return [(UNTRUSTED, _required(options.require_signed), Verdict(
            True, summary=f"run {run_id}'s summary is signed by key {read.signature.key_id}, "
            "which is not a trusted key", evidence={
                "run_id": run_id, "key_id": read.signature.key_id,
                "trusted": ", ".join(sorted(options.trusted))}))]
    if (read.signature.algorithm != run_summary.ALGORITHM
            or not verifies(key, read.signed_bytes, read.signature.value)):
        return [(TAMPERED, "critical", Verdict(
            True, summary=f"run {run_id}'s summary does not match its signature: it was "
            "changed after the sidecar signed it", evidence={
                "run_id": run_id, "key_id": read.signature.key_id}))]
    return []


def _changed(inspection: CheckpointInspection, summary: run_summary.RunSummary
             ) -> list[Finding]:
    if inspection.adapter_digest == summary.adapter_digest:
        return []
    differ = sorted(name for name, digest in inspection.tensor_digests.items()
                    if summary.adapter_tensors.get(name) != digest)
    missing = sorted(set(summary.adapter_tensors) - set(inspection.tensor_digests))
    return [(CHANGED, "critical", Verdict(
        True, step=summary.step,
        summary=(f"the adapter's bytes are not the ones run {summary.run_id} produced at "
                 f"step {summary.step}: {len(differ)} tensors differ, {len(missing)} "
                 "missing"),
        evidence={"run_id": summary.run_id, "expected_digest": summary.adapter_digest,
                  "found_digest": inspection.adapter_digest,
                  "first_differing": ", ".join((differ + missing)[:3])}))]


def _stopped(summary: run_summary.RunSummary) -> list[Finding]:
    if not summary.stopped():
        return []
    stops = [a for a in summary.actions if a.get("action") in ("stop", "sigterm", "sigkill")]
    cause = (f"{stops[0].get('detector', '')}: {stops[0].get('action')} "
             f"{stops[0].get('result')}" if stops else f"ended as {summary.end_reason}")
    return [(STOPPED, "critical", Verdict(
        True, step=summary.step,
        summary=f"run {summary.run_id} was stopped before it finished ({cause}): the adapter "
        "is what an interrupted run left", evidence={
            "run_id": summary.run_id, "end_reason": summary.end_reason or "n/a"}))]


def _runbook(detector: str) -> str:
    known = BY_ID.get(detector)
    return f"alerts/runbooks/{known.spec.runbook}" if known is not None else "n/a"


def _verdicts(summary: run_summary.RunSummary) -> list[Finding]:
    found: list[Finding] = []
    ordered = causes_first(summary.verdicts, lambda v: (v.detector, v.severity, v.step))
    for verdict in ordered:
        state = verdict.state or ("firing" if verdict.firing else "resolved")
        gate = VERDICT if verdict.severity == "critical" else WARNING_VERDICT
        found.append((gate, verdict.severity, Verdict(
            True, step=verdict.step,
            summary=(f"{verdict.detector} ({state}, {verdict.severity}): "
                     f"{fired_and_latest(verdict.step, verdict.summary)}"),
            evidence={"run_id": summary.run_id, "detector": verdict.detector,
                      "state": state, "runbook": _runbook(verdict.detector)})))
    return found


def check(inspection: CheckpointInspection, summary_path: Path | None,
          options: GateOptions | None = None) -> GateResult:
    """The gate's findings and notes for one inspected adapter against its run's summary."""
    options = options or GateOptions()
    if summary_path is None:
        note = (f"no {run_summary.FILE_NAME} beside this adapter or up to {MAX_FOLDERS_UP} "
                "folders above: the run's verdicts are unknown")
        if not options.require_summary:
            return GateResult([], [note + " (--require-summary makes this fatal)"])
        return GateResult([(MISSING, "critical", Verdict(True, summary=note))], [])
    notes = []
    adapter = Path(inspection.path).absolute()
    if summary_path.parent != (adapter if adapter.is_dir() else adapter.parent):
        notes.append(f"run summary from {summary_path} (no summary beside the adapter)")
    try:
        read = run_summary.read(summary_path)
    except run_summary.BadSummary as err:
        return GateResult([(TAMPERED, "critical", Verdict(True, summary=str(err)))], notes)
    summary = read.summary
    if read.signature is not None and not options.trusted:
        notes.append(f"summary signed by key {read.signature.key_id}; signature not checked "
                     "(no --trust-key)")
    signature = _signature(read, options)
    if read.signature is not None and read.signature.key_id in options.trusted and not signature:
        notes.append(f"summary of run {summary.run_id}: signature verified (trusted key "
                     f"{read.signature.key_id})")
    found = [*signature, *_changed(inspection, summary), *_stopped(summary),
             *_verdicts(summary)]
    if summary.ended:
        notes.append(f"run {summary.run_id} ended ({summary.end_reason or 'n/a'}) at step "
                     f"{summary.step}; {len(summary.verdicts)} verdict(s)")
    elif options.require_signed:
        found.append((NOT_FINAL, "critical", Verdict(
            True, step=summary.step,
            summary=f"the summary was taken while run {summary.run_id} was live (step "
            f"{summary.step}): what the run did after it is not in it, and --require-signed "
            "takes only a summary signed at or after the run's end. Promote the adapter the "
            "finished run saved (its output folder, or the last checkpoint), whose summary "
            "is final", evidence={"run_id": summary.run_id, "step": str(summary.step)})))
    else:
        notes.append(f"summary taken while run {summary.run_id} was live (step "
                     f"{summary.step}): later verdicts are not in it (--require-signed "
                     "refuses such a summary)")
    if summary.baseline:
        notes.append(f"run {summary.run_id} was judged against baseline {summary.baseline}")
    if summary.sidecar != "answered":
        found.append((NO_VERDICTS, "warning", Verdict(
            True, summary=f"run {summary.run_id} was never judged by a sidecar, its summary "
            f"holds no verdicts ({summary.sidecar}): no problem found is not judged healthy "
            "(exit status 3)",
            evidence={"run_id": summary.run_id})))
    return GateResult(found, notes)


def fatal(detector: str, severity: str, fail_on: str = "critical") -> bool:
    """Whether a finding of the audit fails the gate: every finding on the adapter's own
    files (as always); of the run's, the critical ones, and warnings with fail_on="warning"
    (the flags that require a signed summary, or one at all, make those critical)."""
    return (detector not in GATE_IDS or severity == "critical"
            or (fail_on == "warning" and severity == "warning"))
