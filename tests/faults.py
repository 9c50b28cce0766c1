"""Shared helpers for the fault tests: an in-process sidecar, a hook-at-step callback, polling.

The in-process sidecar is the real ``app.Sidecar`` (grpc.aio on a real unix socket plus
``/metrics`` over HTTP); keeping it in the test process lets a test read the registry and
count exactly which events arrived.
"""

from __future__ import annotations

import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deadweight.callbacks.stream_client import ClientSettings
from deadweight.sidecar.app import Sidecar
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.server import ServerConfig
from deadweight.sidecar.state import RunState
from tests.realprocs import wait_for

#: Reconnect quickly so a test does not wait out production backoffs.
FAST = ClientSettings(
    heartbeat_seconds=0.5,
    connect_timeout_seconds=0.5,
    backoff_initial_seconds=0.05,
    backoff_max_seconds=0.2,
)


def poll(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Return check()'s first truthy value; fail after timeout (never a fixed sleep)."""
    return wait_for(check, timeout, interval=0.02, what=what)


class InProcessSidecar:
    """A real sidecar server in this process: start, stop, restart, read its registry."""

    def __init__(self, socket_path: Path, registry: Registry | None = None) -> None:
        self.socket_path = socket_path
        self.address = f"unix://{socket_path}"
        self.registry = registry or Registry()
        self.server: Sidecar | None = None

    def start(self) -> InProcessSidecar:
        config = ServerConfig(socket_path=str(self.socket_path), metrics_address="127.0.0.1:0",
                              watch_roots=(tempfile.gettempdir(),))
        self.server = Sidecar(self.registry, None, config)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def metrics(self) -> str:
        assert self.server is not None and self.server.metrics_port is not None
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def run(self, run_id: str) -> RunState | None:
        return self.registry.run(run_id)

    def steps(self, run_id: str, rank: int = 0) -> list[int]:
        run = self.registry.run(run_id)
        if run is None or rank not in run.ranks:
            return []
        return [p.step for p in run.ranks[rank].steps]


def at_steps(actions: dict[int, Callable[[], None]]) -> Any:
    """A TrainerCallback that runs actions[step] at that step's end (the fault injector)."""
    from transformers import TrainerCallback

    def on_step_end(self: Any, args: Any, state: Any, control: Any, **kw: Any) -> None:
        action = actions.get(state.global_step)
        if action is not None:
            action()

    return type("FaultAt", (TrainerCallback,), {"on_step_end": on_step_end})()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a /metrics page, matched on a subset of its labels."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in body for k, v in labels.items()):
            return float(value)
    return None


class Pipe:
    """One open Stream driven by hand: send a batch, read its answer, as any client could."""

    def __init__(self, address: str, options: list[tuple[str, int]] | None = None,
                 attest: bool = True) -> None:
        import queue

        import grpc

        from deadweight.proto import monitor_stub
        from deadweight.proto.transport import grpc_target, unix_socket_path

        self.attest = attest
        self.socket_path = unix_socket_path(grpc_target(address))

        self.channel = grpc.insecure_channel(grpc_target(address), options=options or [])
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses = monitor_stub(self.channel).Stream(iter(self._requests.get, None))

    def send(self, request: Any) -> Any:
        """Send one batch; a RunStart without a nonce gets one, as the callback does (this
        process attests: the sidecar requires it on the unix socket)."""
        if self.attest and self.socket_path is not None:
            for event in request.events:
                if event.WhichOneof("body") == "run_start" and not event.run_start.attestation:
                    from deadweight.callbacks.stream_client import fetch_attestation

                    event.run_start.attestation = fetch_attestation(self.socket_path) or ""
        self._requests.put(request)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()
