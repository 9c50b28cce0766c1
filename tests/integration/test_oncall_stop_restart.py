"""A STOP sent by hand survives a sidecar crash, like a verdict's STOP, and reaches only the
incarnation it was sent to.

Two real SFT jobs (healthy: no verdict STOPs them) report to a real sidecar journaling in a
state dir. The first is frozen in place (SIGSTOP): the slowest run there is, whose stream
cannot pick anything up. ``deadweight stop`` answers "queued"; the sidecar is SIGKILLed
before the run heard of it and restarted on the same state dir; the job, let go, stops with
the operator's reason on its console. The second job (another run id) trains on untouched.
A new process then reuses the stopped run id (a new incarnation); a second crash and restart
sends the old STOP to it neither.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import start_job, stop_all
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STOPPED = "job-stopped-by-hand"
KEPT = "job-kept-training"
REASON = "bad data shard, restart from checkpoint 40"


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd="/")


def crash(sidecar: SidecarProcess) -> None:
    """SIGKILL: no chance to flush, hand anything on or clean up."""
    assert sidecar.process is not None
    sidecar.process.kill()
    sidecar.process.wait(10)


def operator_rows(store: Store, run_id: str) -> list[tuple[str, str, int]]:
    return [(a.action, a.result, a.incarnation) for a in store.actions(run_id, "operator")]


def step_of(sidecar: SidecarProcess, run_id: str) -> int:
    run = sidecar.run_status(run_id)
    return int(run.step) if run is not None and not run.ended else -1


def test_a_stop_by_hand_survives_a_sidecar_crash(tiny: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    state = tmp_path / "state"

    def sidecar() -> SidecarProcess:
        return SidecarProcess(tmp_path / "sc", extra_args=["--state-dir", str(state)])

    first = sidecar().start()
    store = Store(state)
    stopped = start_job(tiny, tmp_path / "jobs", first.address, STOPPED, "obey",
                        step_pause=0.05, trainable=1)
    kept = start_job(tiny, tmp_path / "jobs", first.address, KEPT, "obey", step_pause=0.05,
                     trainable=1)
    reused: subprocess.Popen[bytes] | None = None
    later: list[SidecarProcess] = []
    try:
        for run_id in (STOPPED, KEPT):
            wait_for(lambda r=run_id: step_of(first, r) >= 2, 120, what=f"{run_id} stepping")
        os.kill(stopped.pid, signal.SIGSTOP)  # its stream picks nothing up from now on
        answer = cli("stop", STOPPED, "--reason", REASON, "--address", first.address)
        assert answer.returncode == 0, answer.stderr
        assert "STOP queued" in answer.stdout
        assert operator_rows(store, STOPPED) == [("stop", "sent", 1)]
        crash(first)

        second = sidecar().start()
        later.append(second)
        os.kill(stopped.pid, signal.SIGCONT)
        assert stopped.wait(120) == 0
        log = (tmp_path / "jobs" / f"{STOPPED}.log").read_text()
        assert "TRAINING_ENDED" in log
        assert "deadweight STOPPED run" in log
        assert f"operator: stopped by on-call: {REASON}" in log, log[-3000:]
        wait_for(lambda: (run := second.run_status(STOPPED)) is not None and run.ended
                 and run.end_reason == "stopped", 30, what="the run ended as stopped")
        status = cli("status", "--address", second.address)
        assert "stopped by operator" in status.stdout, status.stdout
        # Sent once, queued again once by the sidecar that came back; STOP never repeats.
        assert operator_rows(store, STOPPED) == [("stop", "sent", 1), ("stop", "requeued", 1)]
        again = cli("stop", STOPPED, "--address", second.address)
        assert again.returncode in (0, 2)
        assert [r[1] for r in operator_rows(store, STOPPED)] == ["sent", "requeued"]

        # The other run trains on, through the crash, and was never told to stop.
        before = step_of(second, KEPT)
        wait_for(lambda: step_of(second, KEPT) > before + 2, 60, what=f"{KEPT} still stepping")
        assert kept.poll() is None
        assert operator_rows(store, KEPT) == []
        assert "STOPPED" not in (tmp_path / "jobs" / f"{KEPT}.log").read_text()

        # A new process reuses the run id: incarnation 2, which the old STOP must not reach.
        reused = start_job(tiny, tmp_path / "again", second.address, STOPPED, "obey",
                           step_pause=0.05, trainable=1)
        wait_for(lambda: step_of(second, STOPPED) >= 2, 120, what="the run id's second life")
        stored = store.run(STOPPED)
        assert stored is not None and stored.incarnation == 2
        crash(second)
        third = sidecar().start()
        later.append(third)
        # Its first acknowledgement after the restart would carry a STOP queued again; it
        # goes on stepping well past it.
        back = wait_for(lambda: max(step_of(third, STOPPED), 0), 90,
                        what="the second life back")
        wait_for(lambda: step_of(third, STOPPED) > back + 3, 60,
                 what="the second life stepping after the second restart")
        assert reused.poll() is None
        assert "STOPPED" not in (tmp_path / "again" / f"{STOPPED}.log").read_text()
        assert operator_rows(store, STOPPED) == [("stop", "sent", 1), ("stop", "requeued", 1)]
    finally:
        if stopped.poll() is None:
            os.kill(stopped.pid, signal.SIGCONT)
        stop_all(stopped, kept, *([reused] if reused is not None else []))
        for process in (first, *later):
            process.stop()
