"""Training jobs forked from a warm interpreter: the imports done once per test worker.

A training job in a process of its own spends 5 to 6 s of CPU importing torch, transformers,
peft and trl before its first step, and the tests start dozens of them. The zygote is one
process per test worker that imported those libraries once and forks a fresh job per request,
as ``multiprocessing``'s forkserver does. The job is still a real process of its own: its own
pid, signals and sockets; it imports deadweight itself and runs its script as ``__main__``
with the test's argv, environment, folder and output files, and it ends through Python's
normal exit (atexit handlers, non-daemon threads). Only its parent differs: the zygote reaps
it and passes its exit status on (``ForkedJob`` answers like ``subprocess.Popen``).

Jobs that must start as a fresh ``exec`` (under ``setpriv`` as another uid, torchrun ranks)
keep ``subprocess``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

#: What a job imports before its first step; deadweight itself is never preloaded.
PRELOAD = ("torch", "transformers", "peft", "datasets", "trl")
REQUEST_BYTES = 1 << 20


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from trl import GRPOTrainer, SFTTrainer  # noqa: F401  (lazy modules, imported now)


def _tell(conn: socket.socket, number: int) -> None:
    """One line to a requester; one that went away (its test ended) is no error here."""
    with contextlib.suppress(OSError):
        conn.sendall(f"{number}\n".encode())


def _serve(path: str) -> tuple[dict[str, Any], list[int]] | None:
    """The zygote's loop. Returns only in a forked child: its request and its fds."""
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # ready: the imports are done
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # the test worker's lifeline
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not sys.stdin.buffer.read1(4096):
                    return None  # the test worker is gone
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                conn.settimeout(10)
                try:
                    message, fds, _, _ = socket.recv_fds(conn, REQUEST_BYTES, 2)
                except OSError:
                    conn.close()  # a requester that failed before its request
                    continue
                if len(fds) != 2:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for other in (*children.values(), conn):
                        other.close()
                    return json.loads(message), fds
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                _tell(conn, pid)
            else:
                os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    done = children.pop(pid)
                    _tell(done, status)
                    done.close()


def _run_job(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the job, then run its script as ``__main__``."""
    stdout, stderr = fds
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
        os.close(source)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["argv"][0])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
    sys.argv = [script, *request["argv"][1:]]
    runpy.run_path(script, run_name="__main__")


class ForkedJob:
    """A job the zygote forked: the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, conn: socket.socket, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        # Signals go through a pidfd: never to another process that took the pid later.
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already ended and reaped: its status is on the way
            self._pidfd = None

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                status = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not status.endswith(b"\n"):
                raise RuntimeError(f"the zygote lost job {self.pid} (it said {status!r})")
            self.returncode = os.waitstatus_to_exitcode(int(status))
            self._conn.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this test worker (``shared()``); ``popen`` forks a job."""

    def __init__(self) -> None:
        folder = tempfile.mkdtemp(prefix="zygote-", dir="/tmp")  # short: AF_UNIX paths
        self.path = os.path.join(folder, "zygote.sock")
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", self.path],
                                        stdin=subprocess.PIPE, cwd=root, env=env)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start ({self.process.returncode})")
            time.sleep(0.05)  # poll interval of the readiness wait

    def popen(self, argv: list[str], stdout: IO[bytes] | int, stderr: IO[bytes] | int,
              env: dict[str, str] | None = None, cwd: str | Path | None = None) -> ForkedJob:
        """Start ``argv`` (a script and its arguments, no interpreter) as a forked job."""
        if stdout == subprocess.DEVNULL or stderr == subprocess.DEVNULL:
            with open(os.devnull, "wb") as null:
                return self.popen(argv, null if stdout == subprocess.DEVNULL else stdout,
                                  null if stderr == subprocess.DEVNULL else stderr, env, cwd)
        out = stdout if isinstance(stdout, int) else stdout.fileno()
        err = out if stderr == subprocess.STDOUT else (
            stderr if isinstance(stderr, int) else stderr.fileno())
        request = {"argv": argv, "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd())}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        socket.send_fds(conn, [json.dumps(request).encode()], [out, err])
        pid = b""
        while not pid.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise RuntimeError("the zygote closed the connection before forking")
            pid += chunk
        return ForkedJob(int(pid), conn, argv)

    def run(self, argv: list[str], timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(..., capture_output=True, text=True)`` for a forked job."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            job = self.popen(argv, stdout=out, stderr=err, env=env)
            try:
                code = job.wait(timeout)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait(30)
                raise
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(argv, code, out.read().decode(errors="replace"),
                                               err.read().decode(errors="replace"))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


_SHARED: Zygote | None = None


def shared() -> Zygote:
    """This process's zygote, started on first use and ended at exit."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Zygote()
        atexit.register(_SHARED.close)
    return _SHARED


if __name__ == "__main__":
    child = _serve(sys.argv[1])
    if child is not None:
        _run_job(*child)
