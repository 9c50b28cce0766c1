"""The promotion gate: an adapter passes only if it is the one its run produced and judged.

``deadweight inspect`` calls ``check`` for every path that has a ``deadweight-summary.json``
beside its adapter. It fails the adapter when its bytes are not the ones the run's callback
digested (swapped, retrained or corrupted since), or when the sidecar gave the run a critical
verdict. An adapter with no summary is audited on its files alone, as before.
"""

from __future__ import annotations

from pathlib import Path

from ...proto import run_summary
from ..detectors.base import Verdict
from ..model.inspection import CheckpointInspection

#: Gate outcomes as (id, severity) in the audit's findings; not detectors of a live run.
CHANGED = "adapter_not_what_the_run_produced"
VERDICT = "run_has_critical_verdict"
NO_VERDICTS = "run_verdicts_unknown"


def summary_for(path: Path) -> Path | None:
    """The summary beside an adapter folder or file, if the run wrote one."""
    folder = path if path.is_dir() else path.parent
    candidate = folder / run_summary.FILE_NAME
    return candidate if candidate.is_file() else None


def check(inspection: CheckpointInspection, summary_path: Path
          ) -> list[tuple[str, str, Verdict]]:
    """The gate's findings for one inspected adapter against its run's summary."""
    try:
        summary = run_summary.read(summary_path)
    except run_summary.BadSummary as err:
        return [(CHANGED, "critical", Verdict(True, summary=str(err)))]
    found: list[tuple[str, str, Verdict]] = []
    if inspection.adapter_digest != summary.adapter_digest:
        differ = sorted(name for name, digest in inspection.tensor_digests.items()
                        if summary.adapter_tensors.get(name) != digest)
        missing = sorted(set(summary.adapter_tensors) - set(inspection.tensor_digests))
        found.append((CHANGED, "critical", Verdict(
            True, step=summary.step,
            summary=(f"the adapter's bytes are not the ones run {summary.run_id} produced at "
                     f"step {summary.step}: {len(differ)} tensors differ, {len(missing)} "
                     "missing"),
            evidence={"run_id": summary.run_id, "expected_digest": summary.adapter_digest,
                      "found_digest": inspection.adapter_digest,
                      "first_differing": ", ".join((differ + missing)[:3])})))
    for verdict in summary.critical():
        state = "firing at the end" if verdict.firing else "fired, later resolved"
        found.append((VERDICT, "critical", Verdict(
            True, step=verdict.step,
            summary=f"run {summary.run_id}: {verdict.detector} ({state}): {verdict.summary}",
            evidence={"run_id": summary.run_id, "detector": verdict.detector})))
    if summary.sidecar != "answered":
        found.append((NO_VERDICTS, "warning", Verdict(
            True, summary=f"run {summary.run_id} has no verdicts: {summary.sidecar}",
            evidence={"run_id": summary.run_id})))
    return found
