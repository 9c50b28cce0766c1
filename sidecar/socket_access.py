"""Who may connect to the sidecar's unix sockets: its uid and one group, nobody else.

A socket is created with mode 0660 and the sidecar's primary group (or the folder's, when the
folder is setgid, as a Kubernetes ``fsGroup`` volume is). When the trainer runs as another uid
(``--trainer-uid``), ``--socket-group`` names the group both share; the socket is handed to
that group, so the trainer can connect and every other uid still cannot.
"""

from __future__ import annotations

import os
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
