"""``deadweight inspect``: the sidecar's checkpoint verdicts, offline, for a promotion gate.

The paths are audited in the order given (``checkpoint-<step>`` folders by step, so a shell
glob's ``checkpoint-10`` before ``checkpoint-2`` does not matter; a run's output folder that
holds no weights of its own stands for the ``checkpoint-<step>`` folders in it): each one
is compared with the one before it and, with ``--initial``, with the adapter the run started
from. Other adapter folders under such a folder (``out/final``) are audited each alone.
The same detector classes as the live sidecar decide, so a gate and a page agree. The run
summary beside each adapter (or up the folders) adds what the run knew: every verdict,
the end, the signature (``promotion``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...proto import pb
from ..checkpoints import summary_gate as promotion
from ..checkpoints.adapter_methods import CONFIG_FILE
from ..checkpoints.inspector import holds_weights, inspect_path
from ..checkpoints.watcher import CHECKPOINT_DIR
from ..detectors import ALL, ARTIFACT_IDS, fix_sentence
from ..detectors.base import Verdict
from ..detectors.checkpoints import judge
from ..model.inspection import CheckpointInspection
from ..model.run_state import CheckpointPoint, RunState
from ..model.settings import DetectorSettings
from ..verdicts import causes_first


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
    #: An adapter folder found under a given folder (``out/final``), audited on its own.
    alone: bool = False

    @property
    def failed(self) -> bool:
        return any(promotion.fatal(d, s, self.fail_on) for d, s, _ in self.findings)

    @property
    def unjudged(self) -> bool:
        """Its run summary holds no verdicts: no sidecar judged the run (exit status 3)."""
        return any(d == promotion.NO_VERDICTS for d, _, _ in self.findings)


#: ``deadweight inspect``'s exit status when no adapter fails but a run was never judged.
EXIT_UNJUDGED = 3


def exit_status(results: list[AuditResult]) -> int:
    """1 when an adapter fails the gate; else 3 when a run summary holds no verdicts (the
    run had no sidecar: "no problem found" is not "judged healthy"); else 0."""
    if any(r.failed for r in results):
        return 1
    return EXIT_UNJUDGED if any(r.unjudged for r in results) else 0


#: How deep under a given folder adapter folders are looked for (``out/final``,
#: ``out/exports/v2``); a checkpoint or adapter folder is not looked into.
ADAPTER_SEARCH_DEPTH = 3


ALONE_NOTE = ("an adapter folder found under the folder given: audited on its own, not "
              "compared with the checkpoints")


def _is_adapter_folder(folder: Path) -> bool:
    return holds_weights(folder) or (folder / CONFIG_FILE).is_file()


def adapter_folders(root: Path, depth: int = ADAPTER_SEARCH_DEPTH) -> list[Path]:
    """The folders under root, by name, that hold an adapter (weights or
    ``adapter_config.json``) and are no ``checkpoint-<step>`` folder: ``final/`` and the
    like, which a script's ``save_model`` writes beside the trainer's checkpoints."""
    found: list[Path] = []
    try:
        children = sorted(c for c in root.iterdir()
                          if c.is_dir() and not c.is_symlink() and not c.name.startswith("."))
    except OSError:
        return found
    for child in children:
        if CHECKPOINT_DIR.match(child.name):
            continue
        if _is_adapter_folder(child):
            found.append(child)
        elif depth > 1:
            found += adapter_folders(child, depth - 1)
    return found


def expand(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(the paths to audit as one sequence, the adapter folders to audit each on its own).

    Each path is audited as given, except a folder with no weights of its own (a trainer's
    output_dir): its ``checkpoint-<step>`` folders join the sequence, by step, and the other
    adapter folders under it (``final/``) are audited each alone: compared with a checkpoint
    of the same step, a final save would read as a copy."""
    expanded: list[Path] = []
    alone: list[Path] = []
    for path in paths:
        if not path.is_dir() or holds_weights(path):
            expanded.append(path)
            continue
        inner = sorted((c for c in path.iterdir() if c.is_dir() and CHECKPOINT_DIR.match(c.name)),
                       key=lambda c: int(c.name.split("-")[-1]))
        others = adapter_folders(path)
        if not inner and not others:
            expanded.append(path)  # inspect_path says what is missing there
        expanded += inner
        alone += others
    return expanded, alone


def audit(paths: list[Path], initial: Path | None = None,
          settings: DetectorSettings | None = None,
          gate: promotion.GateOptions | None = None) -> list[AuditResult]:
    """Inspect every path and run the checkpoint detectors on it (raises NotACheckpoint)."""
    settings = settings or DetectorSettings()
    gate = gate or promotion.GateOptions()
    sequence, alone = expand(paths)
    # Fail on a bad path before any output.
    start = inspect_path(initial) if initial is not None else None
    inspected = [_inspected(sequence)] if sequence else []
    inspected += [_inspected([p]) for p in alone]
    return [result for index, (numbered, inspections) in enumerate(inspected)
            for result in _judge(numbered, inspections, start, settings, gate,
                                 alone=index >= (1 if sequence else 0))]


def _inspected(paths: list[Path]) -> tuple[list[tuple[int, Path]], list[CheckpointInspection]]:
    """The paths by step (``checkpoint-<step>`` folders) or by position, and what each holds."""
    matches = [CHECKPOINT_DIR.match(p.name) for p in paths]
    # checkpoint-<step> folders are labelled with their own steps; other paths by position.
    steps = ([int(m.group(1)) for m in matches if m] if all(matches)
             else list(range(1, len(paths) + 1)))
    numbered = sorted(zip(steps, paths, strict=True), key=lambda sp: sp[0])
    return numbered, [inspect_path(p) for _, p in numbered]


def _judge(numbered: list[tuple[int, Path]], inspections: list[CheckpointInspection],
           start: CheckpointInspection | None, settings: DetectorSettings,
           gate: promotion.GateOptions, alone: bool = False) -> list[AuditResult]:
    """The checkpoint detectors over one sequence of saves, and the gate for each (alone:
    an adapter folder found under a given folder, audited on its own)."""
    real_steps = all(CHECKPOINT_DIR.match(p.name) for _, p in numbered)
    run = RunState("inspect")
    if start is not None:
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
        notes = ((ALONE_NOTE,) if alone else ()) + tuple(checked.notes)
        results.append(AuditResult(inspection, findings, real_steps, notes, gate.fail_on,
                                   alone))
    return results


def render(results: list[AuditResult]) -> str:
    """Readable report: one block per path, one line per finding with its evidence."""
    lines = []
    if any(not r.real_steps and not r.alone for r in results):
        lines.append("note: the paths are not all checkpoint-<step> folders; \"step N\" below "
                     "means the N-th path given")
    for result in results:
        ins = result.inspection
        what = (f"{ins.weights_file}, {len(ins.tensor_digests)} tensors, {ins.tensor_bytes} "
                f"bytes, digest {ins.adapter_digest[:16]}" if ins.weights_file
                else "no safetensors weights")
        status = ("FAIL" if result.failed else "UNJUDGED" if result.unjudged
                  else "WARN" if result.findings else "ok")
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
    unjudged = sum(1 for r in results if r.unjudged and not r.failed)
    never = (f", {unjudged} whose run no sidecar judged (exit status {EXIT_UNJUDGED})"
             if unjudged else "")
    lines.append(f"{len(results)} checkpoint(s) inspected, {found} with findings, {failed} "
                 f"failing the gate{never}")
    return "\n".join(lines)
