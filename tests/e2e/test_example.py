"""The README's complete example runs as shipped, against a real sidecar, both ways."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_lora.py"


def _run_example(sidecar: SidecarProcess, run_id: str, out: Path, *flags: str) -> set[str]:
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "DEADWEIGHT_RUN_ID": run_id}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out), *flags], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Its output folder holds only checkpoint folders: no word of an unsigned summary there.
    assert "is not signed" not in done.stderr, done.stderr[-3000:]
    status = sidecar.run_status(run_id)
    assert status is not None, f"the example's run {run_id} never reached the sidecar"
    return {f.detector for f in status.findings}  # every detector that fired at any point


@pytest.mark.slow
def test_example_frozen_is_caught_and_healthy_is_silent(sidecar: SidecarProcess,
                                                        tmp_path: Path) -> None:
    frozen = _run_example(sidecar, "example-frozen", tmp_path / "frozen", "--frozen")
    assert {"empty_optimizer", "frozen_weights"} <= frozen
    healthy = _run_example(sidecar, "example-healthy", tmp_path / "healthy")
    assert healthy == set()
