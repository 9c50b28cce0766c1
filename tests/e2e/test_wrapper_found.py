"""``deadweight status`` names the wrapper really found on a 2-rank raw loop.

Two real gloo ranks under torchrun against the in-process sidecar: a model never wrapped in
DDP is reported as ``wrapper none`` (it was reported as ``ddp`` because the job had two
ranks); the same loop wrapped in DDP as ``wrapper ddp``. Both runs share one launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import torchrun
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "support" / "unwrapped_worker.py"
#: Each mode of the worker and the wrapper status must name for it.
MODES = {"unwrapped": "none", "ddp": "ddp"}


@pytest.fixture(scope="module")
def both_modes(live: InProcessSidecar) -> dict[str, str]:
    """One launch of two real ranks that runs the loop unwrapped, then wrapped in DDP, each
    its own run; the ``deadweight status`` text of the sidecar once both ended."""
    env = {**os.environ, "DEADWEIGHT_ADDRESS": live.address, "DEADWEIGHT_RUN_ID": "two-ranks",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(WORKER.parents[2])}
    done = torchrun.run([str(WORKER), ",".join(MODES)], env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for mode in MODES:
        run_id = f"two-ranks-{mode}"
        wait_for(lambda run_id=run_id: (run := live.run(run_id)) is not None and run.ended
                 and sorted(run.ranks) == [0, 1], 15, what=f"both ranks of {run_id}")
    status = subprocess.run([sys.executable, "-m", "deadweight.cli", "status", "--address",
                             live.address], env=env, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr[-2000:]
    return {mode: status.stdout.split(f"two-ranks-{mode}", 1)[1].split("\n\n", 1)[0]
            for mode in MODES}


@pytest.mark.parametrize(("mode", "wrapper"), MODES.items())
def test_status_reports_the_wrapper_really_found(mode: str, wrapper: str,
                                                 both_modes: dict[str, str]) -> None:
    block = both_modes[mode]
    assert f"wrapper {wrapper}" in block, block
