"""The run summary written next to a trained adapter: what a promotion gate checks.

The callback writes ``deadweight-summary.json`` at train end (and into the last checkpoint);
``deadweight inspect`` reads it beside the adapter it audits, checks that the adapter's bytes
are still the ones the run produced, and fails when a critical verdict stands. Both sides
share this one schema, so it lives with the wire format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FILE_NAME = "deadweight-summary.json"
SCHEMA = 1


@dataclass(frozen=True)
class SummaryVerdict:
    detector: str
    severity: str
    firing: bool
    step: int
    summary: str


@dataclass(frozen=True)
class RunSummary:
    """The facts a gate needs: the adapter's digests and what the sidecar concluded."""

    run_id: str
    step: int
    #: tensor name -> xxh3-128 of its bytes (the same digest the sidecar's inspector takes).
    adapter_tensors: dict[str, str]
    adapter_digest: str
    #: "answered" when the verdicts below came from the sidecar, else why they are missing.
    sidecar: str
    end_reason: str = ""
    verdicts: list[SummaryVerdict] = field(default_factory=list)
    actions: list[dict[str, str]] = field(default_factory=list)

    def critical(self) -> list[SummaryVerdict]:
        """Critical verdicts that fired during the run (resolved ones included: a run that
        stopped learning for a while still produced a suspect adapter)."""
        return [v for v in self.verdicts if v.severity == "critical"]

    def write(self, folder: Path) -> Path:
        path = folder / FILE_NAME
        body = {"schema": SCHEMA, **asdict(self)}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)  # a reader never sees half a file
        return path


class BadSummary(ValueError):
    """A summary file that cannot be read or has the wrong shape."""


def read(path: Path) -> RunSummary:
    try:
        body: Any = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(body, dict) or body.get("schema") != SCHEMA:
            raise BadSummary(f"{path}: not a deadweight summary (schema {SCHEMA})")
        verdicts = [SummaryVerdict(**v) for v in body.get("verdicts", [])]
        return RunSummary(
            run_id=str(body["run_id"]), step=int(body["step"]),
            adapter_tensors={str(k): str(v) for k, v in body["adapter_tensors"].items()},
            adapter_digest=str(body["adapter_digest"]), sidecar=str(body["sidecar"]),
            end_reason=str(body.get("end_reason", "")), verdicts=verdicts,
            actions=[{str(k): str(v) for k, v in a.items()} for a in body.get("actions", [])],
        )
    except BadSummary:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadSummary(f"{path}: unreadable deadweight summary ({err})") from err
