"""One state dir, one sidecar: an exclusive lock on the state dir for the process's lifetime.

Two sidecars on one journal would both page, STOP and signal for the same incidents (a
restart race, a second ``serve`` started by hand). ``serve`` takes an ``fcntl`` lock on
``<state dir>/sidecar.lock`` before it opens the database and keeps it until it exits; the
kernel drops it when the process dies, however it dies, so a crash never leaves it stale.
The file holds the holder's pid, so the refusal can name it. Readers of the journal
(``deadweight report``) take no lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .files import private_dir

LOCK_NAME = "sidecar.lock"


class StateDirLocked(OSError):
    """Another live sidecar holds the state dir."""


class StateDirLock:
    """The held lock; ``release`` (or the process's exit) lets the next sidecar in."""

    def __init__(self, state_dir: str | Path) -> None:
        folder = Path(state_dir)
        private_dir(folder)  # created 0700, and refused when another uid owns it
        self.path = folder / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise StateDirLocked(
                f"state dir {folder} is in use by another sidecar (pid {holder}); one state "
                "dir serves one sidecar: stop that one, or give this one its own --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def _read_pid(fd: int) -> str:
    """The holder's pid as it wrote it (``unknown`` while it has not written it yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"
