"""The one in-process sidecar for tests: the real ``app.Sidecar`` (grpc.aio on a real unix
socket, the real checkpoint watcher, ``/metrics`` over HTTP) with its registry in this process.

Keeping the sidecar in the test process lets a test read every finding with its evidence,
including the ones that resolved when the run ended (``fired``), and count exactly which
events arrived (``steps``).
"""

from __future__ import annotations

import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from deadweight.callbacks import DeadweightCallback
from deadweight.sidecar.ingest.server import ServerConfig
from deadweight.sidecar.model.finding import Finding
from deadweight.sidecar.model.run_state import RunState
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.serve import Sidecar
from tests.support.realprocs import wait_for

#: Short windows so a handful of real steps can show a trend (defaults are in the README).
TEST_SETTINGS = DetectorSettings(
    zero_reward_logs=3, trend_logs=3, dpo_window=5, kl_zero_logs=3, decay_only_steps=3,
    kl_missing_logs=2, inactive_adapter_steps=2,
)


class InProcessSidecar:
    """An app.Sidecar around a Registry in this process: start, stop, restart, read it."""

    def __init__(self, socket_path: Path, registry: Registry | None = None,
                 settings: DetectorSettings | None = None,
                 checkpoint_settle_seconds: float = 2.0) -> None:
        self.socket_path = socket_path
        self.address = f"unix://{socket_path}"
        self.registry = registry or Registry(settings=settings or DetectorSettings())
        self.checkpoint_settle_seconds = checkpoint_settle_seconds
        self.server: Sidecar | None = None

    @classmethod
    def live(cls, folder: Path, settings: DetectorSettings = TEST_SETTINGS) -> InProcessSidecar:
        """Started, on folder/deadweight.sock, with the short test windows and a quick
        checkpoint settle: the harness of the catalogue tests."""
        return cls(folder / "deadweight.sock", settings=settings,
                   checkpoint_settle_seconds=0.5).start()

    def start(self) -> InProcessSidecar:
        # The test machine's temp folder holds every run's output: the sidecar may read there.
        config = ServerConfig(socket_path=str(self.socket_path), metrics_address="127.0.0.1:0",
                              checkpoint_settle_seconds=self.checkpoint_settle_seconds,
                              watch_roots=(tempfile.gettempdir(),))
        self.server = Sidecar(self.registry, None, config)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def callback(self, run_id: str, **kwargs: Any) -> DeadweightCallback:
        return DeadweightCallback(address=self.address, run_id=run_id, **kwargs)

    def metrics(self) -> str:
        assert self.server is not None and self.server.metrics_port is not None
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def run(self, run_id: str) -> RunState | None:
        return self.registry.run(run_id)

    def seen(self, run_id: str) -> RunState:
        """The run's state; fails the test when the sidecar never heard of it."""
        state = self.registry.run(run_id)
        assert state is not None, f"the sidecar never saw run {run_id}"
        return state

    def steps(self, run_id: str, rank: int = 0) -> list[int]:
        run = self.registry.run(run_id)
        if run is None or rank not in run.ranks:
            return []
        return [p.step for p in run.ranks[rank].steps]

    def findings(self, run_id: str) -> dict[str, Finding]:
        return self.registry.findings(run_id)

    def fired(self, run_id: str) -> dict[str, Finding]:
        """Every detector that fired at some point of the run, firing now or resolved."""
        return {k: f for k, f in self.findings(run_id).items() if f.incidents > 0}

    def wait_inspected(self, run_id: str, count: int | None = None) -> RunState:
        """Until every reported checkpoint of the run has been inspected from disk."""
        def done() -> bool:
            points = list(self.seen(run_id).checkpoints)
            enough = count is None or len(points) >= count
            return bool(points) and enough and all(p.inspection is not None for p in points)

        wait_for(done, 20, what=f"checkpoint inspection of {run_id}")
        return self.seen(run_id)
