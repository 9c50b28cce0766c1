"""The callback under sidecar faults: training finishes unharmed and every event is accounted for.

Each test runs a real SFT trainer on a tiny model with the real callback against a real
sidecar (in this process, to count exactly which events arrived, or as a ``deadweight serve``
child process to SIGKILL it), injects one fault at a chosen step, and checks two things:
the trainer reached its last step, and delivered + counted-as-dropped == submitted.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from deadweight.callbacks import DeadweightCallback
from deadweight.callbacks.stream_client import ClientSettings, StreamClient
from deadweight.demo import runs
from deadweight.demo.sidecar_process import SidecarProcess
from tests.support.faults import FAST, at_steps, metric_value
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

STEPS = 8


def _train(tiny: tuple[Path, Path], out: Path, callbacks: list[object], steps: int = STEPS,
           save_steps: int = 3) -> object:
    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    trainer = runs.sft_trainer(model, model_dir, out, callbacks, steps=steps,
                               save_steps=save_steps)
    trainer.train()
    assert trainer.state.global_step == steps  # training finished unharmed
    return trainer


def _client(callback: DeadweightCallback) -> StreamClient:
    assert callback.client is not None
    return callback.client


def _delivered(sidecar: InProcessSidecar, run_id: str) -> int:
    """Events the registry applied for rank 0 (steps, logs, checkpoints, run end)."""
    run = sidecar.run(run_id)
    assert run is not None
    return (len(run.ranks[0].steps) + run.log_steps + run.checkpoints_total
            + (1 if run.ended else 0))


def test_absent_at_start_then_started_mid_run(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """Queued reports reach a sidecar that starts late; the run is monitored from then on."""
    sidecar = InProcessSidecar(tmp_path / "sock" / "dw.sock")
    run_id = "late-sidecar"
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id,
                                  start_timeout_seconds=0.2, settings=FAST)

    def start_and_wait() -> None:
        assert sidecar.run(run_id) is None
        sidecar.start()
        wait_for(lambda: sidecar.steps(run_id) == [1, 2, 3], 20, what="queued steps 1..3 delivered")

    try:
        _train(tiny, tmp_path / "out", [callback, at_steps({3: start_and_wait})])
        client = _client(callback)
        assert sidecar.steps(run_id) == list(range(1, STEPS + 1))
        assert client.dropped == 0
        assert _delivered(sidecar, run_id) == client.submitted
        run = sidecar.run(run_id)
        assert run is not None and run.ended and run.end_reason == "completed"
        assert metric_value(sidecar.metrics(), "deadweight_step", run_id=run_id) == STEPS
    finally:
        sidecar.stop()


def test_drops_are_counted_and_reported_after_reconnect(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A full queue drops the oldest; the sidecar learns the count as soon as it reconnects."""
    sidecar = InProcessSidecar(tmp_path / "sock" / "dw.sock")
    run_id = "drops"
    settings = ClientSettings(max_queue=4, heartbeat_seconds=0.5, connect_timeout_seconds=0.5,
                              backoff_initial_seconds=0.05, backoff_max_seconds=0.2)
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id,
                                  start_timeout_seconds=0.2, settings=settings)
    seen: dict[str, int] = {}

    def start_and_check() -> None:
        client = _client(callback)
        # Steps 1..6, logs 1..5 and checkpoint 3 went into a queue of 4 (step 6 logs and
        # saves after this hook).
        seen["submitted"], seen["dropped"] = client.submitted, client.dropped
        sidecar.start()
        wait_for(lambda: (r := sidecar.run(run_id)) is not None
                 and r.ranks[0].dropped_events == client.dropped, 20,
                 what="drop count at the sidecar")
        text = sidecar.metrics()
        seen["exported"] = int(metric_value(text, "deadweight_client_dropped_events_total",
                                            run_id=run_id, rank="0") or -1)

    try:
        _train(tiny, tmp_path / "out", [callback, at_steps({6: start_and_check})])
        client = _client(callback)
        assert seen["submitted"] == 6 + 5 + 1
        assert seen["dropped"] == seen["submitted"] - settings.max_queue
        assert seen["exported"] == seen["dropped"]
        assert client.dropped == seen["dropped"]  # nothing dropped once connected
        # The survivors were the newest (log 4, step 5, log 5, step 6), then 7 and 8 live.
        assert sidecar.steps(run_id) == [5, 6, 7, 8]
        assert _delivered(sidecar, run_id) + client.dropped == client.submitted
    finally:
        sidecar.stop()


def test_killed_and_restarted_sidecar(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """SIGKILL mid-run, train on without it, restart on the same socket: re-registered."""
    process = SidecarProcess(tmp_path / "sidecar").start()
    run_id = "killed-restarted"
    callback = DeadweightCallback(address=process.address, run_id=run_id, settings=FAST)
    steps = 10

    def kill() -> None:
        assert process.process is not None
        wait_for(lambda: (r := process.run_status(run_id)) is not None and r.step == 3, 20,
                 what="step 3 at the first sidecar")
        process.process.send_signal(signal.SIGKILL)
        process.process.wait(10)

    def restart() -> None:
        assert not process.socket_path.exists() or process.process is not None
        process.start()  # same socket path: the stale socket file is replaced
        # Steps 4..6 were measured while no sidecar ran; the queue delivers them.
        wait_for(lambda: (r := process.run_status(run_id)) is not None and r.step == 6, 20,
                 what="re-registration and the queued steps")

    try:
        _train(tiny, tmp_path / "out", [callback, at_steps({3: kill, 6: restart})], steps=steps)
        client = _client(callback)
        run = process.run_status(run_id)
        assert run is not None and run.step == steps and run.ended
        text = process.metrics()
        assert metric_value(text, "deadweight_step", run_id=run_id, rank="0") == steps
        assert metric_value(text, "deadweight_client_dropped_events_total",
                            run_id=run_id, rank="0") == 0
        assert client.dropped == 0 and client.queued == 0
        assert client.connects == 2
    finally:
        process.stop()


def test_killed_for_good_the_undelivered_are_counted_in_a_warning(
    tiny: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar that never comes back: training ends on time, the loss is stated, not hidden."""
    process = SidecarProcess(tmp_path / "sidecar").start()
    run_id = "killed-for-good"
    callback = DeadweightCallback(address=process.address, run_id=run_id, settings=FAST)

    def kill() -> None:
        assert process.process is not None
        wait_for(lambda: (r := process.run_status(run_id)) is not None and r.step == 3, 20,
                 what="step 3 at the sidecar")
        process.process.send_signal(signal.SIGKILL)
        process.process.wait(10)

    try:
        with caplog.at_level(logging.WARNING, logger="deadweight"):
            _train(tiny, tmp_path / "out", [callback, at_steps({3: kill})])
        client = _client(callback)
        lost = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
        assert len(lost) == 1, lost
        count = int(lost[0].split("deadweight: ")[1].split()[0])
        # After the kill: steps 4-8, logs 3-8 and the summary log, checkpoints 3 and 6, run end.
        assert count >= 5 + 6 + 2 + 1
        assert count <= client.submitted and client.dropped == 0
    finally:
        process.stop()


def test_socket_deleted_mid_run(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """The open stream survives an unlinked socket; the sidecar listens again for new runs."""
    sidecar = InProcessSidecar(tmp_path / "sock" / "dw.sock").start()
    run_id = "socket-deleted"
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id, settings=FAST)
    try:
        _train(tiny, tmp_path / "out",
               [callback, at_steps({2: lambda: sidecar.socket_path.unlink()})])
        client = _client(callback)
        assert sidecar.steps(run_id) == list(range(1, STEPS + 1))
        assert client.dropped == 0 and client.connects == 1  # never had to reconnect
        assert _delivered(sidecar, run_id) == client.submitted

        wait_for(sidecar.socket_path.exists, 20, what="the sidecar to listen again on its socket")
        late = DeadweightCallback(address=sidecar.address, run_id="after-deletion",
                                  settings=FAST)
        _train(tiny, tmp_path / "out2", [late], steps=3)
        assert sidecar.steps("after-deletion") == [1, 2, 3]
    finally:
        sidecar.stop()


def test_a_refused_run_trains_on_with_one_warning(
    tiny: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run id the sidecar refuses costs one warning per reason, not one per batch."""
    sidecar = InProcessSidecar(tmp_path / "sock" / "dw.sock").start()
    callback = DeadweightCallback(address=sidecar.address, run_id="x" * 200, settings=FAST)
    try:
        with caplog.at_level(logging.WARNING, logger="deadweight"):
            _train(tiny, tmp_path / "out", [callback])
        rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert rejected == ["deadweight: sidecar rejected a batch: run_id longer than 128 "
                            "characters"]
        assert sidecar.registry.runs() == []
    finally:
        sidecar.stop()


def test_a_long_odd_output_folder_still_gets_a_valid_run_id(
    tiny: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DEADWEIGHT_RUN_ID", raising=False)
    sidecar = InProcessSidecar(tmp_path / "sock" / "dw.sock").start()
    callback = DeadweightCallback(address=sidecar.address, settings=FAST)
    try:
        _train(tiny, tmp_path / ("hyper-" * 30 + "\tlr=1e-4"), [callback], steps=2)
        run_id = callback.run_id
        assert run_id is not None and len(run_id) <= 128 and run_id.isprintable()
        assert sidecar.steps(run_id) == [1, 2]
    finally:
        sidecar.stop()
