"""Run ``deadweight serve`` as a real child process on a private socket, and talk to it.

The demo and the tests use this to exercise the daemon exactly as deployed: a separate
process, a unix socket, ``/metrics`` over HTTP. Readiness is polled, never slept on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

import grpc

from ..proto import pb
from ..sidecar.commands import status


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SidecarProcess:
    """A sidecar child process; use as a context manager."""

    def __init__(
        self,
        folder: Path,
        policies: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        watch_roots: list[Path] | None = None,
    ) -> None:
        self.folder = folder
        self.socket_path = folder / "sock" / "deadweight.sock"
        self.address = f"unix://{self.socket_path}"
        self.metrics_port = free_port()
        self.policies = policies or {}
        self.extra_args = extra_args or []
        #: Where runs' checkpoints may be read (default: the temp folder the tests and the
        #: demo write into).
        self.watch_roots = [Path(tempfile.gettempdir())] if watch_roots is None else watch_roots
        self.log_path = log_path or folder / "sidecar.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "deadweight.sidecar.commands.cli", "serve",
            "--socket", str(self.socket_path),
            "--metrics-address", f"127.0.0.1:{self.metrics_port}",
        ]
        for root in self.watch_roots:
            cmd += ["--watch-root", str(root)]
        for detector, action in self.policies.items():
            cmd += ["--policy", f"{detector}={action}"]
        return cmd + self.extra_args

    def start(self, timeout: float = 30.0) -> SidecarProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Started in its own folder: `python -m` puts the working folder first on the import
        # path, and a user's folder that holds a `deadweight/` directory must not shadow us.
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=log, env=env,
                                        cwd=self.folder)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"sidecar exited with {self.process.returncode}: {self.log_path.read_text()}"
                )
            if self.socket_path.exists():
                try:
                    self.status(timeout=1.0)
                    return self
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"sidecar not ready after {timeout}s: {self.log_path.read_text()}")

    def status(self, timeout: float = 5.0) -> pb.StatusResponse:
        return status.fetch(self.address, timeout=timeout)

    def run_status(self, run_id: str) -> pb.RunStatus | None:
        return next((r for r in self.status().runs if r.run_id == run_id), None)

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
