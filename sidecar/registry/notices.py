"""Verdicts in the words the trainer's console prints: each incident once per rank's stream.

The callback prints one line per incident (severity, cause, fix, runbook link) and a summary
at train end; it knows no detector, so the sidecar sends the words with the ack, the first
time a stream could be told. A stream that reconnects (its RunStart again) is told again: a
lost answer must not lose a line, and the callback drops the incidents it already printed.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import Path

from ...proto import pb
from ..actions.links import DEFAULT_RUNBOOK_URL_PATTERN, runbook_url
from ..detectors.base import Detector
from ..detectors.spec import DetectorSpec, cause_rank
from .run_table import RunEntry


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:1].upper() + text[1:] if text else text


class VerdictNotices:
    """Builds the ``VerdictNotice`` messages a rank was not sent yet."""

    def __init__(self, active: Iterable[Detector],
                 runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN) -> None:
        self._specs: dict[str, DetectorSpec] = {d.id: d.spec for d in active}
        self.follow(runbook_url_pattern)

    def follow(self, runbook_url_pattern: str) -> None:
        """Link every notice's runbook through this pattern from now on (the sidecar's own
        /runbooks/ pages once it knows the address it serves them on)."""
        self._links = {d: runbook_url(runbook_url_pattern, d) for d in self._specs}

    def untold(self, entry: RunEntry, rank: int, reconnected: bool) -> list[pb.VerdictNotice]:
        """Notices of the run's firing incidents rank has not been told (under the lock)."""
        told = entry.told.setdefault(rank, set())
        if reconnected:
            told.clear()
        notices = []
        for detector, finding in entry.findings.items():
            if not finding.firing or finding.incident_id in told:
                continue
            told.add(finding.incident_id)
            spec = self._specs.get(detector)
            notices.append(pb.VerdictNotice(
                detector=detector, severity=finding.severity, policy=finding.policy,
                incident=finding.incidents, step=finding.step, evidence=finding.summary,
                cause=_sentence(spec.meaning if spec else finding.summary),
                fix=_sentence(spec.fix_for(finding.evidence)) if spec else "",
                runbook_url=self._links.get(detector, ""), cause_rank=cause_rank(detector)))
        return notices


def report_command(run_id: str, database: Path | None) -> str:
    """The command that opens run_id's report from this sidecar's state dir, quoted for a
    shell; empty when the sidecar keeps its state in memory only (no report outlives it)."""
    if database is None:
        return ""
    folder = shlex.quote(str(database.parent))
    return f"deadweight report {shlex.quote(run_id)} --state-dir {folder}"
