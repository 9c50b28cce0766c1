"""One state dir, one sidecar: a second ``serve`` on a held state dir exits 2 naming the holder.

Real ``deadweight serve`` processes: the first holds the dir; a second one on the same dir
(another socket, another port) exits 2 at once, says which pid holds it and leaves the
holder's journal alone; once the holder is SIGKILLed (no clean-up at all) the next one starts,
because the kernel drops the lock with the process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from deadweight.demo.sidecar_process import SidecarProcess, free_port


def _serve(folder: Path, state: Path) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", "serve",
         "--socket", str(folder / "sock" / "deadweight.sock"),
         "--metrics-address", f"127.0.0.1:{free_port()}", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60, cwd=folder)


def test_second_sidecar_on_one_state_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = SidecarProcess(tmp_path / "one", extra_args=["--state-dir", str(state)]).start()
    try:
        assert first.process is not None
        second = _serve(tmp_path / "two", state)
        assert second.returncode == 2, second.stderr
        assert f"pid {first.process.pid}" in second.stderr
        assert "in use by another sidecar" in second.stderr
        assert first.process.poll() is None  # the holder goes on serving
        assert first.status().runs is not None
        first.process.send_signal(signal.SIGKILL)  # no clean-up: the kernel drops the lock
        first.process.wait(10)
        third = SidecarProcess(tmp_path / "three",
                               extra_args=["--state-dir", str(state)]).start()
        third.stop()
    finally:
        first.stop()


def test_deleting_the_lock_file_does_not_let_a_second_sidecar_in(tmp_path: Path) -> None:
    """A clean-up that deletes ``*.lock`` used to let a second sidecar start on the same
    journal (both would page and signal for the same incidents): the lock is on the folder."""
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "one", extra_args=["--state-dir", str(state)]) as first:
        assert first.process is not None
        (state / "sidecar.lock").unlink()
        second = _serve(tmp_path / "two", state)
        assert second.returncode == 2, second.stderr
        assert "in use by another sidecar" in second.stderr
        assert first.process.poll() is None and first.status() is not None


def test_sidecars_on_different_state_dirs_both_run(tmp_path: Path) -> None:
    """The control: the lock is per state dir, not per machine."""
    with SidecarProcess(tmp_path / "a", extra_args=["--state-dir", str(tmp_path / "sa")]), \
            SidecarProcess(tmp_path / "b", extra_args=["--state-dir", str(tmp_path / "sb")]) as b:
        assert b.status() is not None
