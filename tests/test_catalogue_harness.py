"""An in-process sidecar for catalogue tests: real gRPC over a real unix socket, real watcher.

The registry is read directly, so a test sees every finding with its evidence, including the
ones that resolved when the run ended (``incidents`` counts how often a detector fired).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deadweight.callbacks import DeadweightCallback
from deadweight.sidecar.app import Sidecar
from deadweight.sidecar.finding import Finding
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.server import ServerConfig
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import RunState
from tests.realprocs import wait_for

#: Short windows so a handful of real steps can show a trend (defaults are in the README).
TEST_SETTINGS = DetectorSettings(
    zero_reward_logs=3, trend_logs=3, dpo_window=5, kl_zero_logs=3, decay_only_steps=3,
    kl_missing_logs=2, inactive_adapter_steps=2,
)


def poll(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """check() until it returns something truthy, or fail saying what never happened."""
    return wait_for(check, timeout, interval=0.05, what=what)


class LiveSidecar:
    """An app.Sidecar around a Registry in this process, on a socket in a temp folder."""

    def __init__(self, folder: Path, settings: DetectorSettings = TEST_SETTINGS) -> None:
        self.registry = Registry(settings=settings)
        self.socket = folder / "deadweight.sock"
        self.server = Sidecar(
            self.registry, None,
            ServerConfig(socket_path=str(self.socket), metrics_address=None,
                         checkpoint_settle_seconds=0.5,
                         watch_roots=(tempfile.gettempdir(),)),
        )
        self.server.start()

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    def callback(self, run_id: str, **kwargs: Any) -> DeadweightCallback:
        return DeadweightCallback(address=self.address, run_id=run_id, **kwargs)

    def run(self, run_id: str) -> RunState:
        state = self.registry.run(run_id)
        assert state is not None, f"the sidecar never saw run {run_id}"
        return state

    def findings(self, run_id: str) -> dict[str, Finding]:
        return self.registry.findings(run_id)

    def fired(self, run_id: str) -> dict[str, Finding]:
        """Every detector that fired at some point of the run, firing now or resolved."""
        return {k: f for k, f in self.findings(run_id).items() if f.incidents > 0}

    def wait_inspected(self, run_id: str, count: int | None = None) -> RunState:
        """Until every reported checkpoint of the run has been inspected from disk."""
        def done() -> bool:
            run = self.run(run_id)
            points = list(run.checkpoints)
            enough = count is None or len(points) >= count
            return bool(points) and enough and all(p.inspection is not None for p in points)

        poll(done, f"checkpoint inspection of {run_id}")
        return self.run(run_id)

    def stop(self) -> None:
        self.server.stop()
