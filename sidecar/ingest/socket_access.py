"""Who may connect to the sidecar's unix sockets: its uid and one group, nobody else.

A socket is created with mode 0660 and the sidecar's primary group (or the folder's, when the
folder is setgid, as a Kubernetes ``fsGroup`` volume is). When the trainer runs as another uid
(``--trainer-uid``), ``--socket-group`` names the group both share; the socket is handed to
that group, so the trainer can connect and every other uid still cannot.

The folder decides who could swap a socket for their own: ``secure_folder`` closes a folder
this sidecar owns to other uids, and says so when it cannot.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog

log = structlog.get_logger("deadweight.socket_access")

SOCKET_MODE = 0o660


class SocketGroupRefused(PermissionError):
    """The socket cannot be handed to the group (the sidecar is not a member of it)."""


def grant(path: Path | str, group: int | None) -> None:
    """Give the socket at path its mode (0660) and, when given, its group."""
    if group is not None:
        try:
            os.chown(path, -1, group)
        except PermissionError as err:
            raise SocketGroupRefused(
                f"cannot give {path} to group {group}: this sidecar (uid {os.geteuid()}, "
                f"groups {sorted({os.getegid(), *os.getgroups()})}) is not a member of it"
            ) from err
    os.chmod(path, SOCKET_MODE)


def secure_folder(folder: Path) -> None:
    """Make sure no uid but this sidecar's (and root, and the folder's group) can replace a
    socket in folder, or log ``socket_dir_not_private`` when that cannot be made so.

    A folder other uids may write is safe when it is sticky: they may add names but never
    remove or rename this sidecar's sockets (a Kubernetes emptyDir on tmpfs arrives as 3777,
    root's and the fsGroup's). A folder this sidecar owns is closed to other uids (its group,
    the one the trainer shares, keeps its access: 2777 becomes 2770). A folder another uid
    owns, or one owned by root and open to every uid without the sticky bit (a disk-backed
    emptyDir, 2777), the sidecar cannot change: the warning stays.
    """
    info = folder.stat()
    mode = stat.S_IMODE(info.st_mode)
    sticky = bool(mode & stat.S_ISVTX)
    if info.st_uid == os.geteuid() and mode & 0o002 and not sticky:
        os.chmod(folder, mode & ~0o007)
        log.info("socket_dir_made_private", folder=str(folder), mode_was=oct(mode),
                 mode=oct(mode & ~0o007))
        mode &= ~0o007
    if info.st_uid not in (os.geteuid(), 0) or (mode & 0o002 and not sticky):
        # Whoever else may write here could swap the socket for their own.
        log.warning("socket_dir_not_private", folder=str(folder), owner=info.st_uid,
                    mode=oct(mode))
