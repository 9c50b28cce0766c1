"""Kernel-verified identity of the process behind a stream, for the right to signal it.

grpc-python does not expose the peer credentials of a unix-socket connection, so the sidecar
listens on a second unix socket next to the gRPC one (``<socket>.attest``). A training process
connects there first; the sidecar reads the connecting process's pid, uid and gid from the
kernel (``SO_PEERCRED``), reads that pid's start time from ``/proc/<pid>/stat``, and answers
with a random one-time nonce. The callback puts the nonce into ``RunStart.attestation``; the
registry redeems it and binds the run's rank to that (pid, start time, boot id). A pid named in
any message field is never used: only a redeemed nonce yields an identity.

Between ``SO_PEERCRED`` and the ``/proc`` read the peer could exit and its pid be reused; where
the kernel has ``SO_PEERPIDFD`` (Linux 6.5+) the sidecar holds a pidfd of the peer across the
read and checks afterwards that it still names a live process, so the start time read is the
peer's own. ``/proc/<pid>`` must also belong to the uid the kernel reported. The listener
serves connections from several threads with a deep backlog, so a flood of connections delays
a real client's nonce by moments instead of denying it (the client also retries).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import structlog

from ..model.nonces import Attestor
from ..model.process import ProcessIdentity, boot_id, start_time
from .socket_access import grant

log = structlog.get_logger("deadweight.attestation")

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
#: SO_PEERPIDFD (Linux 6.5+); the socket module of older Pythons lacks the name.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
#: Threads answering attestation connections.
ACCEPT_THREADS = 4


def _peer_pidfd(conn: socket.socket) -> int | None:
    """A pidfd of the peer from the kernel, None where SO_PEERPIDFD is not supported."""
    try:
        return int(conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError:
        return None


def _pidfd_names(pidfd: int, pid: int) -> bool:
    """True while pidfd still refers to the live process pid (fdinfo shows -1 once it exited)."""
    try:
        info = Path(f"/proc/self/fdinfo/{pidfd}").read_text()
    except OSError:
        return False
    for line in info.splitlines():
        if line.startswith("Pid:"):
            return line.split()[1] == str(pid)
    return False


def peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid as the kernel reports it (one getsockopt)."""
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                              _UCRED.size))
    return int(uid)


def peer_identity(conn: socket.socket) -> ProcessIdentity | None:
    """The connecting process as the kernel reports it (None when not visible here, or when
    its pid no longer names it by the time /proc was read)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    if pid <= 0:  # a process in another PID namespace shows as 0
        return None
    pidfd = _peer_pidfd(conn)
    try:
        if pidfd is not None and not _pidfd_names(pidfd, pid):
            return None  # the peer is gone already: nothing read about pid would be its own
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return None
        started = start_time(pid)
        if started is None or owner != uid:
            return None  # another process (of another uid) holds the pid now
        if pidfd is not None and not _pidfd_names(pidfd, pid):
            return None  # exited during the read: the start time may be a newcomer's
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return ProcessIdentity(pid=pid, uid=uid, gid=gid, start_time=started, boot_id=boot_id())


class AttestationServer:
    """The ``<socket>.attest`` listener: one short exchange per connection, several threads."""

    def __init__(self, path: str | Path, attestor: Attestor,
                 threads: int = ACCEPT_THREADS, group: int | None = None,
                 allowed_uids: frozenset[int] = frozenset()) -> None:
        self.path = Path(path)
        self.group = group
        #: When known (the trainer uids), a connection of any other uid is closed at once:
        #: no /proc read, no pidfd, no nonce, so a flood of other uids costs one getsockopt.
        self.allowed_uids = allowed_uids
        #: Connections closed because their uid may not report.
        self.refused_uid = 0
        self.attestor = attestor
        self.threads = threads
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.relistened = 0
        #: Exchanges the client broke off.
        self.failed = 0

    def _listen(self) -> socket.socket:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(f"{self.path} exists and is not a socket")
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)  # the socket is never reachable with a wider mode
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        try:
            grant(self.path, self.group)
        except OSError:
            sock.close()
            raise
        sock.listen(socket.SOMAXCONN)
        sock.settimeout(0.2)
        return sock

    def start(self) -> None:
        self._sock = self._listen()
        for index in range(self.threads):
            thread = threading.Thread(target=self._serve, args=(index,),
                                      name=f"deadweight-attest-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("attestation_listening", socket=str(self.path), threads=self.threads)

    def ensure_listening(self) -> None:
        """Listen again when the socket file was deleted (clients would go unattested)."""
        if self._sock is None or self._stop.is_set():
            return
        if self.path.exists() or self.path.is_symlink():
            return
        log.error("attestation_socket_missing", socket=str(self.path), action="listening again")
        old, self._sock = self._sock, self._listen()
        old.close()
        self.relistened += 1

    def _serve(self, index: int = 0) -> None:
        checked = time.monotonic()
        while not self._stop.is_set():
            if index == 0 and time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                try:
                    self.ensure_listening()
                except OSError as err:
                    log.error("attestation_relisten_failed", socket=str(self.path),
                              error=str(err))
            sock = self._sock
            assert sock is not None
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    self._answer(conn)
                except OSError:  # the client hung up: counted, not logged (a flood would
                    self.failed += 1  # turn one line per connection into a disk filler)

    def _answer(self, conn: socket.socket) -> None:
        if self.allowed_uids and peer_uid(conn) not in self.allowed_uids:
            self.refused_uid += 1
            return  # closed by the caller, before any work
        conn.settimeout(1.0)
        identity = peer_identity(conn)
        if identity is None:
            conn.sendall(b"ERR peer not visible in this PID namespace\n")
            return
        conn.sendall(f"OK {self.attestor.issue(identity)}\n".encode())

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(2.0)
        if self._sock is not None:
            self._sock.close()
        self.path.unlink(missing_ok=True)

