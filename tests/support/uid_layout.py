"""The folders of a sidecar that runs as a uid of its own, laid out as the pod and the
compose stack have them: its folder and socket folder its own (the shared group may enter),
its state dir 0700."""

from __future__ import annotations

import os
from pathlib import Path


def sidecar_folder(folder: Path, sidecar_uid: int, shared_gid: int) -> Path:
    """Make folder (with ``sock/`` and ``state/``) for a sidecar of sidecar_uid; returns its
    state dir."""
    folder.mkdir()
    os.chown(folder, sidecar_uid, shared_gid)
    os.chmod(folder, 0o750)
    (folder / "sock").mkdir(mode=0o750)
    os.chown(folder / "sock", sidecar_uid, shared_gid)
    state = folder / "state"
    state.mkdir(mode=0o700)
    os.chown(state, sidecar_uid, sidecar_uid)
    return state
