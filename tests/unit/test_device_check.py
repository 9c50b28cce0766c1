"""``bench/device.sh``, the one prepared device check: its no-GPU answer, and its code run on
the CPU (``--smoke``: a tiny shape, the accelerator's update path forced), so the script a GPU
machine runs is known to work before a GPU ever sees it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.device_check import NO_GPU, NO_GPU_EXIT

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_without_a_gpu_it_says_so_in_one_line() -> None:
    done = _run()
    assert done.returncode == NO_GPU_EXIT
    assert done.stdout.strip().splitlines() == [NO_GPU]


@pytest.mark.slow
def test_smoke_runs_the_device_path_on_the_cpu() -> None:
    done = _run("--smoke", "--steps", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines()
            if line.startswith(("LoRA r16", "full fine-tune"))]
    assert len(rows) == 2, done.stdout
    for row in rows:
        reads = row.split()[row.split().index("trainable)") + 1]
        assert reads == "0.0", row  # host reads per step in deadweight's hooks
    assert "device check done" in done.stdout
