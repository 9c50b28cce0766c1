"""Claiming the unix socket's path at start: a stale socket from a crash is replaced, a live
sidecar's is refused, and a squatter's (a process that is no sidecar, bound there while the
sidecar restarted) loses its name instead of keeping the sidecar down."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from pathlib import Path

import structlog

from .socket_access import secure_folder

log = structlog.get_logger("deadweight.server")


class SocketInUse(OSError):
    """Another process answers on the socket path: a second sidecar must not take it over."""


def refuse_if_listening(path: Path) -> None:
    """Raise SocketInUse when a sidecar accepts connections on the unix socket at path.

    A socket file left by a crash refuses connections and may be replaced; a live one belongs
    to a running sidecar, whose runs would silently lose their channel (and their kill path,
    through the attestation socket) if a second sidecar unlinked it. A listener that is no
    sidecar (another uid, or a process whose command line is not ``deadweight serve``: a job
    that bound the path while the sidecar restarted) must not keep the sidecar down: its name
    is unlinked and the squatter logged, so the sidecar listens there again.
    """
    if not path.exists() or not stat.S_ISSOCK(path.lstat().st_mode):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        pid, uid, _ = struct.unpack("3i", probe.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: nobody listens
    except OSError as err:
        raise SocketInUse(err.errno, f"cannot tell whether {path} is in use: {err.strerror}"
                          ) from err
    finally:
        probe.close()
    if _is_sidecar(pid, uid):
        raise SocketInUse(errno.EADDRINUSE,
                          f"another process is listening on {path} (a running sidecar, pid "
                          f"{pid}); refusing to replace its socket")
    command = _command_line(pid)
    try:
        path.unlink()
    except OSError as err:
        raise SocketInUse(errno.EADDRINUSE,
                          f"{path} is held by pid {pid} (uid {uid}, {command!r}), which is no "
                          f"sidecar, and this sidecar cannot remove it ({err.strerror}): stop "
                          "that process or give the sidecar a folder of its own") from err
    log.error("socket_squatted", socket=str(path), pid=pid, uid=uid, command=command,
              action="removed its name; listening there again")


#: Words a sidecar's command line holds (``deadweight serve``, ``-m deadweight.sidecar.commands.cli
#: serve``, ``-m deadweight.cli serve``).
_SIDECAR_WORDS = ("deadweight", "serve")


def _command_line(pid: int) -> str:
    """The process's command line, arguments joined by spaces ('' when it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _is_sidecar(pid: int, uid: int) -> bool:
    """Whether the listener may be a sidecar this one must not displace: one of this uid (or
    root's) whose command line is ``deadweight ... serve``. A process of any other uid, or
    one that cannot be read, is judged by what can be seen: unreadable counts as a sidecar."""
    if uid not in (os.geteuid(), 0):
        return False
    command = _command_line(pid)
    if not command:
        return Path(f"/proc/{pid}").exists()  # alive but unreadable: do not displace it
    return all(word in command for word in _SIDECAR_WORDS)


def prepare_socket(path: Path) -> None:
    """Create the socket's folder (owner and group only; see ``secure_folder``) and clear a
    stale socket from a crash."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    secure_folder(path.parent)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
