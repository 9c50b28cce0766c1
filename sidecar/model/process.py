"""A process identified so that a reused pid never matches it, and whether it still runs.

The identity comes from the kernel (``SO_PEERCRED`` and ``/proc/<pid>/stat``, read by
``ingest.attestation``); the registry binds it to a run's rank and the enforcer checks it
again before every signal. Only ``/proc`` is read here: no sockets, no threads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, identified so that a reused pid never matches it."""

    pid: int
    uid: int
    gid: int
    start_time: int  # clock ticks since boot (field 22 of /proc/<pid>/stat)
    boot_id: str

    def describe(self) -> str:
        return f"pid {self.pid} (uid {self.uid}, start {self.start_time})"


@functools.cache
def boot_id() -> str:
    """This boot's id: start times restart at every boot, so an identity carries it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of pid, None when no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return fields[0], int(fields[19])  # fields 3 and 22 of the whole line
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """The start time of pid in clock ticks since boot, or None when no such process."""
    found = _stat(pid)
    return None if found is None else found[1]


def is_alive(identity: ProcessIdentity) -> bool:
    """True while identity's pid still runs the very process that was identified.

    A zombie (exited, not yet reaped by its parent) counts as gone: it runs nothing.
    """
    return not exited(state(identity))


def state(identity: ProcessIdentity) -> str | None:
    """The state letter of identity's process (``/proc/<pid>/stat``: "R", "S", "T" when
    stopped, "Z" a zombie, ...), or None when its pid no longer runs that very process."""
    if identity.boot_id and identity.boot_id != boot_id():
        return None
    found = _stat(identity.pid)
    return found[0] if found is not None and found[1] == identity.start_time else None


def exited(letter: str | None) -> bool:
    """Whether a process state (``state``) means the process is gone: no such process, or
    a zombie (exited, not yet reaped by its parent), which runs nothing."""
    return letter in (None, "Z", "X")


def is_suspended(letter: str | None) -> bool:
    """Whether a process state (``state``) is stopped (SIGSTOP: a scheduler suspended it,
    or a debugger holds it): silent, yet nothing is wrong with its training."""
    return letter in ("T", "t")


def reused(identity: ProcessIdentity) -> bool:
    """True when identity's pid now belongs to another process (never signal it)."""
    current = start_time(identity.pid)
    return current is not None and (
        current != identity.start_time or identity.boot_id not in ("", boot_id())
    )
