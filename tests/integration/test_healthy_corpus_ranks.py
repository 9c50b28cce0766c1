"""The healthy corpus's multi-process recipes: DDP and FSDP2 loops under a real
``torchrun --nproc-per-node 2`` (gloo, CPU), and a busy machine (a process spinning a core
beside a healthy run). Each must end with no warning or critical verdict and no console line
but deadweight's begin and end lines; the stall, straggler and rank detectors must take a
busy machine for what it is.

The three loops run one after the other in one launch (``healthy_ranks_worker``); the
in-process recipes are in ``test_healthy_corpus.py``, with the same check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import healthy_ranks_worker, torchrun
from tests.support.healthy_recipes import (
    BEGIN,
    Kit,
    console,
    corpus_sidecar,
    sft_lora,
    verdicts_and_noise,
)
from tests.support.inprocess_sidecar import InProcessSidecar

# torchrun ranks and a CPU hog take both cores: this file runs beside no other
# (tests/support/schedule.py MULTIPROCESS_FILES)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(healthy_ranks_worker.__file__)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    sidecar = corpus_sidecar(tmp_path_factory.mktemp("ranks"))
    yield sidecar
    sidecar.stop()


@pytest.fixture(scope="module")
def launch(live: InProcessSidecar, tiny: tuple[Path, Path],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every loop's rank reports, and the console lines of the launch (both ranks' stderr)."""
    model_dir, _ = tiny
    out = tmp_path_factory.mktemp("loops")
    env = {**os.environ, "DEADWEIGHT_ADDRESS": live.address, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(WORKER.parents[2])}
    env.pop("DEADWEIGHT_RUN_ID", None)
    done = torchrun.run([str(WORKER), str(model_dir), str(out),
                         ",".join(healthy_ranks_worker.LOOPS)], env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = {loop: [json.loads((out / loop / f"rank{r}.json").read_text()) for r in (0, 1)]
               for loop in healthy_ranks_worker.LOOPS}
    # the deadweight logger's lines (Python's last-resort handler prints the message alone)
    lines = [line for line in done.stderr.splitlines() if line.startswith("deadweight")]
    return {"reports": reports, "console": lines}


@pytest.mark.parametrize("loop", healthy_ranks_worker.LOOPS)
def test_multi_rank_loop_ends_without_a_verdict(loop: str, live: InProcessSidecar,
                                                launch: dict[str, Any]) -> None:
    reports = launch["reports"][loop]
    assert [r["steps"] for r in reports] == [healthy_ranks_worker.STEPS] * 2
    run_id = reports[0]["run_id"]
    assert sorted(live.seen(run_id).ranks) == [0, 1]
    # its begin and end lines, and every line that names no run (a verdict line names none)
    own = [line for line in launch["console"] if run_id in line or "corpus-" not in line]
    assert any(BEGIN.match(line) for line in own), own  # the console was read
    problems = verdicts_and_noise(live, [(run_id, healthy_ranks_worker.STEPS)], own, ())
    assert problems == [], "\n".join(problems)


def test_busy_machine_sft_ends_without_a_verdict(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """LoRA SFT while a process spins a core beside it: slower steps, never a stall."""
    model_dir, adapter_dir = tiny
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with console() as shown:
            ran = sft_lora(Kit(live, model_dir, adapter_dir, tmp_path), "corpus-sft-busy")
    finally:
        hog.kill()
        hog.wait()
    problems = verdicts_and_noise(live, ran, shown.lines, ())
    assert problems == [], "\n".join(problems)
