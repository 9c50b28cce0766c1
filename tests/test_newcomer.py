"""A newcomer's rough edges: each one reproduced as it was met, and shown gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess


def test_sidecar_starts_from_a_folder_that_holds_a_deadweight_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shadow = tmp_path / "deadweight"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('a user folder, not the package')\n")
    monkeypatch.chdir(tmp_path)
    with SidecarProcess(tmp_path / "sidecar") as process:
        assert process.status().runs == []
