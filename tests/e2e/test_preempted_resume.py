"""A job preempted by its scheduler (SIGKILL mid-run) and restarted under the same run id,
resuming from its last checkpoint: a healthy run, so no incident, no page and no verdict on
the trainer's console, in either life of the run id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.journal import Store
from tests.support import preempted_worker
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

WORKER = Path(preempted_worker.__file__)
RUN_ID = "job-preempted"


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def test_a_preempted_job_resumed_under_its_run_id_draws_no_verdict(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    with SidecarProcess(tmp_path / "sc", extra_args=["--state-dir", str(state)]) as sidecar:
        env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "DEADWEIGHT_RUN_ID": RUN_ID,
               "OMP_NUM_THREADS": "1"}

        def job(mode: str) -> list[str]:
            return [sys.executable, str(WORKER), str(model_dir), str(out), mode]

        first = subprocess.Popen(job("fresh"), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: _progress(out) >= 5 or first.poll() is not None, 180,
                     what="the first life at step 5")
            assert first.poll() is None, first.communicate()[1][-3000:]
            first.send_signal(signal.SIGKILL)  # preempted
        finally:
            first.kill()
            first.wait(30)
        store = Store(state)
        try:
            wait_for(lambda: any(r.ended for r in store.runs() if r.run_id == RUN_ID), 60,
                     what="the killed life ended by the sidecar's exit check")
            second = subprocess.run(job("resume"), env=env, capture_output=True, text=True,
                                    timeout=300)
            assert second.returncode == 0, second.stderr[-3000:]
            lives = wait_for(lambda: [r for r in store.runs() if r.run_id == RUN_ID
                                      and r.ended and r.end_reason == "completed"], 30,
                             what="the resumed life completed")
            runs = [r for r in store.runs() if r.run_id == RUN_ID]
            assert [(r.incarnation, r.end_reason) for r in runs] == [
                (1, "process_exited"), (2, "completed")], runs
            assert lives[0].incarnation == 2
            assert store.incidents(RUN_ID) == []
        finally:
            store.close()
    console = [line for line in second.stderr.splitlines() if line.startswith("deadweight")]
    assert any(f"run {RUN_ID} ended (completed) at step {preempted_worker.STEPS}; no verdict"
               in line for line in console), console
