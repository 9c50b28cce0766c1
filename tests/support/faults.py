"""Shared helpers for the fault tests: fast client settings, a hook-at-step callback, a
/metrics sample reader and a hand-driven stream (the in-process sidecar is in
``tests/support/inprocess_sidecar.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deadweight.callbacks.stream_client import ClientSettings

#: Reconnect quickly so a test does not wait out production backoffs.
FAST = ClientSettings(
    heartbeat_seconds=0.5,
    connect_timeout_seconds=0.5,
    backoff_initial_seconds=0.05,
    backoff_max_seconds=0.2,
)


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
