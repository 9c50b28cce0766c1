"""Saved weights readable by the sidecar's group, as the umask allows.

A sidecar that runs as a uid of its own (the documented set-ups: its own user, the compose
stack, the Kubernetes Job) reads a run's checkpoints through the group the two share. The
safetensors writer creates its files 0600 whatever the umask, so without this the sidecar can
neither hash a checkpoint nor sign a summary over it, and the strict gate refuses every
adapter. After each save the callback grants group read to the weight files the save wrote,
where the process's umask lets the group read (a umask of 077 keeps them private, and then
the sidecar says it cannot read them).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("deadweight")

#: Suffixes of weight files whose writers ignore the umask.
WEIGHT_SUFFIXES = (".safetensors",)
#: Folder levels looked into below the saved folder (a named adapter saves in a subfolder).
MAX_DEPTH = 2
#: Entries looked at per save: a checkpoint folder holds a few dozen.
MAX_ENTRIES = 2048


def umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, racing other
    threads that create files); 0o022 when /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def share_with_group(folder: str | os.PathLike[str]) -> int:
    """Add group read to the weight files under folder that this process owns, where the
    umask lets the group read; returns how many files changed. Never raises: the save
    itself succeeded, and a file left private only means the sidecar says it cannot read it."""
    if umask() & stat.S_IRGRP:
        return 0
    changed = 0
    seen = 0
    uid = os.geteuid()
    pending: list[tuple[Path, int]] = [(Path(folder), 0)]
    while pending:
        where, depth = pending.pop()
        try:
            entries = list(os.scandir(where))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES:
                return changed
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and depth < MAX_DEPTH:
                pending.append((Path(entry.path), depth + 1))
            elif (stat.S_ISREG(info.st_mode) and info.st_uid == uid
                  and entry.name.endswith(WEIGHT_SUFFIXES)
                  and not info.st_mode & stat.S_IRGRP):
                try:
                    os.chmod(entry.path, stat.S_IMODE(info.st_mode) | stat.S_IRGRP)
                    changed += 1
                except OSError as err:
                    log.debug("deadweight: cannot share %s with the group (%s)", entry.path,
                              err)
    return changed
