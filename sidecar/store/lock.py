"""One state dir, one sidecar: an exclusive lock on the state dir for the process's lifetime.

Two sidecars on one journal would both page, STOP and signal for the same incidents (a
restart race, a second ``serve`` started by hand). ``serve`` takes an ``flock`` on
the state dir itself before it opens the database and keeps it until it exits; the kernel
drops it when the process dies, however it dies, so a crash never leaves it stale. The lock is
on the folder, not on a file in it: a clean-up that deletes ``*.lock`` cannot let a second
sidecar in (a lock on a deleted file is a lock nobody else will ever ask for). The file
``sidecar.lock`` only holds the holder's pid, so the refusal can name it. Readers of the
journal (``deadweight report``) take no lock.
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
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateDirLocked(
                f"state dir {folder} is in use by another sidecar (pid {_read_pid(self.path)}); "
                "one state dir serves one sidecar: stop that one, or give this one its own "
                "--state-dir"
            ) from None
        self._fd: int | None = fd
        _write_pid(self.path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def _write_pid(path: Path) -> None:
    """Say who holds the lock, for the next one's refusal (replacing the file atomically, so a
    reader never sees it half written)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    os.replace(scratch, path)


def _read_pid(path: Path) -> str:
    """The holder's pid as it wrote it (``unknown`` while it has not, or the file is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "unknown"
    try:
        text = os.read(fd, 32).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return text if text.isdigit() else "unknown"
