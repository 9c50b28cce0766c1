"""Whether the sidecar may read a checkpoint's files for a run: the one set of checks.

Every path comes from a client, so none is trusted. A folder is read only when it and every
file in it belong to the uid the kernel named for the run (the run's process could read them
anyway, so the sidecar reads nothing on its behalf that its own uid could not write), only
while its resolved path lies under a ``--watch-root`` where the operator gave any, and never
through a symlink out of its folder. The checkpoint watcher applies these to the folders it
inspects; ``SignSummary`` applies them to the adapter folder whose digest it signs.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from pathlib import Path

from ..model.inspection import CheckpointInspection
from .inspector import CheckpointRefused, inspect_path


def under_roots(path: Path, roots: Iterable[Path]) -> bool:
    """True when path, with every symlink resolved, lies in (or is) one of the roots."""
    real = Path(os.path.realpath(path))
    return any(real == root or root in real.parents for root in roots)


def outside(path: Path, roots: Collection[Path]) -> str | None:
    """Why path may not be read (outside every root), or None (no roots: the run's own uid
    is the restriction)."""
    if not roots or under_roots(path, roots):
        return None
    return f"outside the allowed roots ({', '.join(str(r) for r in roots)})"


def foreign(path: Path, owners: Collection[int], rooted: bool,
            files: bool = True) -> str | None:
    """Why a folder (and, with files, every entry in it) is not the run's own: owned by
    another uid than the one the kernel named for the run. A run that did not attest (no
    owners) is read only under a --watch-root (rooted: the operator's word for those
    folders)."""
    if not owners:
        if rooted:
            return None
        return ("the run did not attest, so no uid vouches for its folders, and no "
                "--watch-root is configured to allow them")
    try:
        listed = files and path.is_dir() and not path.is_symlink()
        entries = [path, *(sorted(path.iterdir()) if listed else [])]
        for entry in entries:
            owner = entry.lstat().st_uid
            if owner not in owners:
                what = "" if entry == path else f"{entry.name} in it is "
                return f"{what}owned by uid {owner}, not by the run's uid {min(owners)}"
    except OSError:
        return None  # gone or unreadable: the inspector reports it
    return None


def leaves_folder(path: Path) -> str | None:
    """Why a checkpoint must not be read: a symlink out of its folder could make the sidecar
    read files the run's user cannot, or block forever on a FIFO. None when it stays inside."""
    try:
        real = path.resolve(strict=True)
        if real.parent != path.parent.resolve():
            return f"the folder is a symlink to {real}, outside the output folder"
        for entry in path.iterdir():
            if entry.is_symlink() and entry.resolve().parent != real:
                return (f"{entry.name} is a symlink to {entry.resolve()}, outside the "
                        "checkpoint folder")
    except OSError:
        return None  # gone or unreadable: the inspector reports it
    return None


def inspect_as(path: Path, roots: Collection[Path], owner_uid: int) -> CheckpointInspection:
    """The inspection of an adapter folder's files (what ``deadweight inspect`` computes),
    read only when the uid the kernel named may have written every file in it.

    Raises CheckpointRefused with the reason when a check fails, NotACheckpoint or OSError
    when there is nothing to read."""
    if not path.is_absolute():
        raise CheckpointRefused(f"{path}: not an absolute path")
    why = (outside(path, roots) or foreign(path, {owner_uid}, bool(roots))
           or leaves_folder(path))
    if why is not None:
        raise CheckpointRefused(f"{path}: {why}")
    return inspect_path(path)
