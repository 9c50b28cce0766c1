"""The checked-in generated code matches the schema, and the schema lints clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from deadweight.proto import generate

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    for fresh in generate.generate(tmp_path):
        checked_in = ROOT / "proto" / "deadweight" / "v1" / fresh.name
        assert fresh.read_text() == checked_in.read_text(), f"{fresh.name} is stale"


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf") or str(Path(__import__("sys").executable).parent / "buf")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_event_kinds_are_the_event_body_fields() -> None:
    from deadweight.proto import pb
    from deadweight.proto.kinds import EventKind, kind_of

    body = pb.Event.DESCRIPTOR.oneofs_by_name["body"]
    assert [kind.value for kind in EventKind] == [f.name for f in body.fields]
    assert kind_of(pb.Event(step=pb.StepReport(step=1))) is EventKind.STEP
    assert kind_of(pb.Event()) is None
