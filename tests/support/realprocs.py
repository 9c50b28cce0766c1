"""Start the real Prometheus and Alertmanager binaries on free 127.0.0.1 ports for tests.

Each process gets its own temporary directory, is awaited through its `/-/ready` endpoint
(never a fixed sleep), and is stopped by `stop()` (also on context exit). `.ci/run` installs
the Debian packages; a missing binary fails the session (see conftest.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from deadweight.demo.sidecar_process import free_port

_P = TypeVar("_P", bound="RealProcess")

PROMETHEUS_BINARIES = ("prometheus",)
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")


def find_binary(names: tuple[str, ...]) -> str | None:
    """First of `names` found on PATH, or None."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def http_json(url: str, timeout: float = 5.0) -> Any:
    return json.loads(http_get(url, timeout))


class RealProcess:
    """One external server process with a base URL, a log file and a readiness probe."""

    def __init__(self, name: str, argv: list[str], url: str, workdir: Path) -> None:
        self.name = name
        self.url = url
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=workdir, start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")
            try:
                http_get(self.url + "/-/ready", timeout=1.0)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)  # poll interval of the readiness wait
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class Prometheus(RealProcess):
    """A real Prometheus with an HTTP API helper."""

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; raises on a PromQL error, returns the result vector."""
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            data = http_json(url)
        except urllib.error.HTTPError as exc:
            raise ValueError(f"query {expr!r} failed: {exc.read().decode()}") from exc
        result: list[dict[str, Any]] = data["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = http_json(self.url + "/api/v1/alerts")["data"]["alerts"]
        return alerts

    def targets_up(self) -> bool:
        active = http_json(self.url + "/api/v1/targets")["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


class Alertmanager(RealProcess):
    """A real Alertmanager (no clustering) with an API v2 helper."""

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        query = "&".join(
            "filter=" + urllib.parse.quote(f'{k}="{v}"') for k, v in filters.items()
        )
        url = self.url + "/api/v2/alerts" + ("?" + query if query else "")
        alerts: list[dict[str, Any]] = http_json(url)
        return alerts


def start_prometheus(workdir: Path, config_yaml: str, rule_files: dict[str, str] | None = None,
                     timeout: float = 30.0) -> Prometheus:
    """Write the config (and rule files, by name) into workdir and start Prometheus.

    `config_yaml` may refer to the rule files by their bare names: they sit next to it.
    """
    binary = find_binary(PROMETHEUS_BINARIES)
    if binary is None:
        raise FileNotFoundError("prometheus binary not found")
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in (rule_files or {}).items():
        (workdir / name).write_text(text)
    config = workdir / "prometheus.yml"
    config.write_text(config_yaml)
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
        "--log.level=warn",
    ]
    proc = Prometheus("prometheus", argv, f"http://127.0.0.1:{port}", workdir)
    proc.wait_ready(timeout)
    return proc


def start_alertmanager(workdir: Path, config_yaml: str, timeout: float = 30.0) -> Alertmanager:
    """Write the config into workdir and start a single, non-clustered Alertmanager."""
    binary = find_binary(ALERTMANAGER_BINARIES)
    if binary is None:
        raise FileNotFoundError("alertmanager binary not found")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "alertmanager.yml"
    config.write_text(config_yaml)
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
    ]
    proc = Alertmanager("alertmanager", argv, f"http://127.0.0.1:{port}", workdir)
    proc.wait_ready(timeout)
    return proc


def wait_for(predicate: Any, timeout: float = 15.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll `predicate()` until it returns something truthy; raise TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last={last!r}")

