"""Keeping a run's report after its pod: the sidecar's state dir copied out while the sidecar
still runs (as `kubectl cp` does) is enough for `deadweight report` elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from tests.support.enforcement_support import start_raw_client, stop_all
from tests.support.realprocs import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_report_from_a_state_dir_copied_out_of_a_running_sidecar(tmp_path: Path) -> None:
    run_id = "run-kept"
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "sc", extra_args=["--state-dir", str(state)]) as sidecar:
        client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log", attest=True)
        try:
            wait_for(lambda: any(f.detector == "frozen_weights" and f.firing for f in
                                 (sidecar.run_status(run_id) or pb.RunStatus()).findings),
                     30, what="frozen_weights firing")
            wait_for(lambda: (sidecar.run_status(run_id) or pb.RunStatus()).step >= 20, 30,
                     what="some steps recorded")
            copy = tmp_path / "copied" / "state"
            shutil.copytree(state, copy)  # the database and its write-ahead log, live
        finally:
            stop_all(client)
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "deadweight.cli", "report", run_id,
                           "--state-dir", str(copy), "--out", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert run_id in page and "frozen_weights" in page
