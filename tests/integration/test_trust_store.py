"""The state dir under accident and attack, with a real ``deadweight serve``: corrupt database
files, a world-writable or foreign state dir, and file modes.

The corrupt files are real (garbage bytes; a real database with damaged pages); the foreign
state dir is really owned by a second uid.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.store.files import DB_NAME, StateDirUnsafe
from deadweight.sidecar.store.journal import Store

pytestmark = pytest.mark.slow


def _log_events(process: SidecarProcess) -> list[dict[str, object]]:
    events = []
    for raw in process.log_path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            events.append(line)
    return events


def _damaged_pages(db: Path) -> bytes:
    """A real database with many rows, then a run of its pages overwritten with junk."""
    store = Store(db.parent)
    for i in range(400):
        store.upsert_run(f"run-{i:04d}-" + "x" * 200, "SFTTrainer", pb.RunStart())
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    data = bytearray(db.read_bytes())
    data[4096 * 3: 4096 * 6] = b"\xa5" * (4096 * 3)  # pages 4..6: b-tree pages, now junk
    db.write_bytes(bytes(data))
    return bytes(data)


def _garbage(db: Path) -> bytes:
    db.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    db.write_bytes(b"this is not sqlite " * 500)
    return db.read_bytes()


@pytest.mark.parametrize("damage", [_garbage, _damaged_pages])
def test_a_corrupt_db_is_moved_aside_and_a_fresh_one_started(tmp_path: Path,
                                                              damage: object) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    original = damage(state / DB_NAME)  # type: ignore[operator]
    with SidecarProcess(tmp_path / "sidecar",
                        extra_args=["--state-dir", str(state)]) as process:
        assert process.status().runs is not None  # it serves
        corrupt = [e for e in _log_events(process) if e.get("event") == "state_db_corrupt"]
        assert corrupt and corrupt[0]["level"] == "error", corrupt
        aside = Path(str(corrupt[0]["moved_to"]))
        assert aside.read_bytes() == original  # nothing lost: the old bytes are kept aside
    fresh = Store(state)
    assert fresh.runs() == []  # the fresh database is sound and empty
    fresh.close()


def test_a_new_state_dir_is_0700_and_the_db_0600(tmp_path: Path) -> None:
    state = tmp_path / "deep" / "state"
    with SidecarProcess(tmp_path / "sidecar", extra_args=["--state-dir", str(state)]):
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):
            path = state / name
            if path.exists():
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, name


def test_an_existing_0777_state_dir_and_0644_db_are_tightened_loudly(tmp_path: Path) -> None:
    state = tmp_path / "state"
    Store(state).close()
    os.chmod(state, 0o777)
    os.chmod(state / DB_NAME, 0o644)
    with SidecarProcess(tmp_path / "sidecar",
                        extra_args=["--state-dir", str(state)]) as process:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / DB_NAME).stat().st_mode) == 0o600
        line = next(e for e in _log_events(process) if e.get("event") == "state_dir_tightened")
        assert line["level"] == "error" and line["was"] == "0o777"


def test_a_state_dir_of_another_uid_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 12345, 12345)  # whoever owns it could rewrite the journal
    with pytest.raises(StateDirUnsafe):
        Store(state)
    result = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", "serve", "--socket",
         str(tmp_path / "s.sock"), "--metrics-address", "127.0.0.1:0", "--state-dir",
         str(state)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "owned by uid 12345" in result.stderr and "Traceback" not in result.stderr
