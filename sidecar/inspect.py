"""``deadweight inspect``: the sidecar's checkpoint verdicts, offline, for a promotion gate.

The paths are audited in the order given (``checkpoint-<step>`` folders by step, so a shell
glob's ``checkpoint-10`` before ``checkpoint-2`` does not matter; a run's output folder that
holds no weights of its own stands for the ``checkpoint-<step>`` folders in it): each one
is compared with the one before it and, with ``--initial``, with the adapter the run started
from. The same detector classes as the live sidecar decide, so a gate and a page agree. The
run summary beside each adapter (or up the folders) adds what the run knew: every verdict,
the end, the signature (``promotion``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..proto import pb
from .checkpoints import summary_gate as promotion
from .checkpoints.inspector import holds_weights, inspect_path
from .checkpoints.watcher import CHECKPOINT_DIR
from .detectors import ALL, ARTIFACT_IDS, fix_sentence
from .detectors.base import Verdict
from .detectors.checkpoints import judge
from .model.inspection import CheckpointInspection
from .model.run_state import CheckpointPoint, RunState
from .model.settings import DetectorSettings
from .verdicts import causes_first


@dataclass(frozen=True)
class AuditResult:
    """One path: what it holds and the verdicts that fired on it."""

    inspection: CheckpointInspection
    findings: list[tuple[str, str, Verdict]]
    #: False when the paths are not all ``checkpoint-<step>`` folders: steps are positions.
    real_steps: bool = True
    #: What the reader should know that is no finding (where the summary came from, ...).
    notes: tuple[str, ...] = ()
    #: The least severe run verdict that fails the gate (``--fail-on``).
    fail_on: str = "critical"

    @property
    def failed(self) -> bool:
        return any(promotion.fatal(d, s, self.fail_on) for d, s, _ in self.findings)


def expand(paths: list[Path]) -> list[Path]:
    """Each path as given, except a folder with no weights of its own that holds
    ``checkpoint-<step>`` folders (a trainer's output_dir): those folders, by step."""
    expanded: list[Path] = []
    for path in paths:
        if not path.is_dir() or holds_weights(path):
            expanded.append(path)
            continue
        inner = sorted((c for c in path.iterdir() if c.is_dir() and CHECKPOINT_DIR.match(c.name)),
                       key=lambda c: int(c.name.split("-")[-1]))
        expanded += inner or [path]  # none: inspect_path says what is missing there
    return expanded


def audit(paths: list[Path], initial: Path | None = None,
          settings: DetectorSettings | None = None,
          gate: promotion.GateOptions | None = None) -> list[AuditResult]:
    """Inspect every path and run the checkpoint detectors on it (raises NotACheckpoint)."""
    settings = settings or DetectorSettings()
    gate = gate or promotion.GateOptions()
    paths = expand(paths)
    matches = [CHECKPOINT_DIR.match(p.name) for p in paths]
    real_steps = all(matches)
    # checkpoint-<step> folders are labelled with their own steps; other paths by position.
    steps = ([int(m.group(1)) for m in matches if m] if real_steps
             else list(range(1, len(paths) + 1)))
    numbered = sorted(zip(steps, paths, strict=True), key=lambda sp: sp[0])
    paths = [p for _, p in numbered]
    inspections = [inspect_path(p) for p in paths]  # fail on a bad path before any output
    run = RunState("inspect")
    if initial is not None:
        start = inspect_path(initial)
        run.start = pb.RunStart(initial_adapter=pb.AdapterDigest(
            combined=start.adapter_digest, tensors=start.tensor_digests))
    detectors = [d for d in ALL if d.id in ARTIFACT_IDS]
    results = []
    for (step, _), inspection in zip(numbered, inspections, strict=True):
        point = CheckpointPoint(step=step, path=inspection.path, combined_digest="",
                                tensor_digests={}, adapter_bytes=inspection.tensor_bytes,
                                time=time.time(), inspection=inspection)
        run.add_checkpoint(point)
        judge(run, point)
        fired = []
        for detector in detectors:
            verdict = detector.evaluate(run, settings)
            if verdict is not None and verdict.firing:
                fired.append((detector.id, detector.severity.value, verdict))
        checked = promotion.check(inspection, promotion.summary_for(Path(inspection.path)), gate)
        # The run's own copy of a verdict this adapter shows now is said once, as found here.
        seen = {d for d, _, _ in fired}
        told = [f for f in checked.findings if f[2].evidence.get("detector") not in seen]
        findings = causes_first(fired + told, lambda f: (f[2].evidence.get("detector", f[0]),
                                                          f[1], f[2].step))
        results.append(AuditResult(inspection, findings, real_steps, tuple(checked.notes),
                                   gate.fail_on))
    return results


def render(results: list[AuditResult]) -> str:
    """Readable report: one block per path, one line per finding with its evidence."""
    lines = []
    if results and not results[0].real_steps:
        lines.append("note: the paths are not all checkpoint-<step> folders; \"step N\" below "
                     "means the N-th path given")
    for result in results:
        ins = result.inspection
        what = (f"{ins.weights_file}, {len(ins.tensor_digests)} tensors, {ins.tensor_bytes} "
                f"bytes, digest {ins.adapter_digest[:16]}" if ins.weights_file
                else "no safetensors weights")
        status = "FAIL" if result.failed else "WARN" if result.findings else "ok"
        lines.append(f"{status:4}  {ins.path}  ({what})")
        for note in result.notes:
            lines.append(f"      note: {note}")
        for detector, severity, verdict in result.findings:
            lines.append(f"      {detector} [{severity}]: {verdict.summary}")
            evidence = ", ".join(f"{k}={v}" for k, v in sorted(verdict.evidence.items())
                                 if k not in {"checkpoint", "step"})
            lines.append(f"        evidence: {evidence}")
            fix = fix_sentence(verdict.evidence.get("detector", detector), verdict.evidence)
            if fix:
                lines.append(f"        fix: {fix}")
    found = sum(1 for r in results if r.findings)
    failed = sum(1 for r in results if r.failed)
    lines.append(f"{len(results)} checkpoint(s) inspected, {found} with findings, {failed} "
                 "failing the gate")
    return "\n".join(lines)
