"""The per-rank detectors on real 2-rank jobs (``torchrun --nproc-per-node 2``, gloo on CPU).

Each failure runs for real (see ``rank_worker``) against the real sidecar over its unix socket:
a rank stuck in its loop while rank 0 blocks in the next all-reduce (``rank_stalled`` names
rank 1), a rank slower at every step (``rank_straggler``), replicas that train apart because
the model was never wrapped or rank 1 started from other weights (``replicas_diverged``). The
healthy DDP twin, same loop and steps, leaves none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import free_port
from deadweight.sidecar.detectors import Verdict
from deadweight.sidecar.detectors.ranks import RankStraggler, ReplicasDiverged
from deadweight.sidecar.model.settings import DetectorSettings
from tests.support import ddp_worker, rank_worker
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"
#: Seconds without a step before the stuck rank is named (default 300 s).
STALL_SECONDS = 2.0
SETTINGS = DetectorSettings(rank_stalled_seconds=STALL_SECONDS, straggler_steps=6)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    process = InProcessSidecar(tmp_path_factory.mktemp("ranks") / "sock" / "dw.sock",
                               settings=SETTINGS).start()
    yield process
    process.stop()


def _start(sidecar: InProcessSidecar, mode: str, out: Path, steps: int | str, run_id: str
           ) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "DEADWEIGHT_RUN_ID": run_id,
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(WORKER.parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(WORKER), mode, str(out), str(steps)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _reports(out: Path) -> list[dict[str, Any]]:
    """Both ranks' reports of one run, which lost no event."""
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["dropped"] == 0 for r in reports)
    return reports


def _wait(job: subprocess.Popen[str]) -> None:
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-4000:]


def _finish(job: subprocess.Popen[str], out: Path) -> list[dict[str, Any]]:
    _wait(job)
    return _reports(out)


def _run(sidecar: InProcessSidecar, mode: str, out: Path, steps: int
         ) -> tuple[str, list[dict[str, Any]]]:
    run_id = f"ranks-{mode}-{out.name}"
    return run_id, _finish(_start(sidecar, mode, out, steps, run_id), out)


#: The two replica faults and the healthy twin: timing plays no part in them, so they run one
#: after the other in one launch, each its own run.
REPLICA_RUNS = {"unwrapped": 6, "init": 6, "healthy": 10}


@pytest.fixture(scope="module")
def replica_runs(sidecar: InProcessSidecar, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """Per mode of REPLICA_RUNS: (run id, rank reports)."""
    out = tmp_path_factory.mktemp("replicas")
    base = f"ranks-{out.name}"
    job = _start(sidecar, ",".join(REPLICA_RUNS), out,
                 ",".join(str(n) for n in REPLICA_RUNS.values()), base)
    _wait(job)
    found = {mode: (f"{base}-{mode}", _reports(out / mode)) for mode in REPLICA_RUNS}
    for run_id, reports in found.values():
        assert {r["run_id"] for r in reports} == {run_id}
    return found


def test_stuck_rank_is_named_while_rank_0_waits(sidecar: InProcessSidecar,
                                                tmp_path: Path) -> None:
    run_id = f"ranks-stall-{tmp_path.name}"
    job = _start(sidecar, "stall", tmp_path, 6, run_id)
    try:
        def named() -> Any:
            finding = sidecar.findings(run_id).get("rank_stalled")
            return finding if finding is not None and finding.firing else None

        finding = wait_for(named, 120, what="rank_stalled naming the stuck rank")
        seen_at = time.time()
        run = sidecar.seen(run_id)
        # Both ranks stopped at the same optimizer step: only the step begun tells them apart.
        assert run.ranks[0].step == run.ranks[1].step == rank_worker.STALL_AFTER
        assert run.ranks[0].began_step == rank_worker.STALL_AFTER + 1
        assert run.ranks[1].began_step == rank_worker.STALL_AFTER
    finally:
        (tmp_path / "release").touch()
    reports = _finish(job, tmp_path)
    assert finding.evidence["rank"] == "1" and finding.evidence["stuck_ranks"] == "1"
    assert finding.evidence["last_step"] == str(rank_worker.STALL_AFTER)
    assert finding.evidence["waiting_ranks"] == "0"
    assert finding.evidence["waiting_in_step"] == str(rank_worker.STALL_AFTER + 1)
    assert float(finding.evidence["seconds"]) >= STALL_SECONDS
    assert "rank 1 stopped after step 3" in finding.summary
    stuck_since = reports[1]["step_times"][rank_worker.STALL_AFTER - 1]
    print(f"rank_stalled: named {seen_at - stuck_since:.1f} s after rank 1's last step "
          f"(limit {STALL_SECONDS} s)")
    final = sidecar.findings(run_id)
    assert not final["rank_stalled"].firing  # released: the run went on and ended
    assert "stalled" not in final or final["stalled"].incidents == 0


def test_stuck_rank_is_named_under_the_trainer(sidecar: InProcessSidecar,
                                               tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """The same fault under a real SFTTrainer with the callback (DDP, gloo): rank 1's data
    loading hangs after step 2; rank 0 waits for it in a collective."""
    model_dir, adapter_dir = tiny
    run_id = f"ranks-trainer-stall-{tmp_path.name}"
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "DEADWEIGHT_RUN_ID": run_id,
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(WORKER.parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(WORKER.with_name("ddp_worker.py")), str(model_dir), str(adapter_dir),
           str(tmp_path), "stall", "4"]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        def named() -> Any:
            finding = sidecar.findings(run_id).get("rank_stalled")
            return finding if finding is not None and finding.firing else None

        finding = wait_for(named, 180, what="rank_stalled under the trainer")
        run = sidecar.seen(run_id)
        assert run.ranks[0].step == run.ranks[1].step == ddp_worker.STALL_AFTER
    finally:
        (tmp_path / "release").touch()
    _wait(job)
    assert finding.evidence["rank"] == "1" and finding.evidence["waiting_ranks"] == "0"
    assert finding.evidence["last_step"] == str(ddp_worker.STALL_AFTER)
    # Rank 0 waits in the trainer's token-count gather, before step 3 begins: the training
    # threads' places tell the ranks apart, and the stuck one's is quoted.
    assert finding.evidence["where"].startswith("ddp_worker.py:"), finding.evidence
    assert "collator" in finding.evidence["where"]
    assert not sidecar.findings(run_id)["rank_stalled"].firing


def test_straggler_is_reported(sidecar: InProcessSidecar, tmp_path: Path) -> None:
    run_id, _ = _run(sidecar, "straggler", tmp_path, 10)
    finding = sidecar.findings(run_id)["rank_straggler"]
    assert finding.incidents >= 1 and finding.policy == "observe"
    assert finding.evidence["rank"] == "1"
    assert float(finding.evidence["local_seconds"]) >= rank_worker.STRAGGLE_SECONDS
    first = finding.step
    print(f"rank_straggler: reported at step {first} (window {SETTINGS.straggler_steps})")
    assert first <= SETTINGS.straggler_steps + 1
    assert not {k for k, f in sidecar.findings(run_id).items()
                if f.incidents and k != "rank_straggler"}


@pytest.mark.parametrize("mode", ["unwrapped", "init"])
def test_replicas_apart_are_critical(
        mode: str, sidecar: InProcessSidecar,
        replica_runs: dict[str, tuple[str, list[dict[str, Any]]]]) -> None:
    run_id, _ = replica_runs[mode]
    finding = sidecar.findings(run_id)["replicas_diverged"]
    assert finding.incidents == 1 and finding.severity == "critical"
    assert finding.evidence["rank"] == "1" and finding.evidence["reference_rank"] == "0"
    assert finding.step == 1  # the first sample, after the first optimizer step
    tensors_apart, sampled = finding.evidence["tensors_apart"].split("/")
    assert sampled == "4" and int(tensors_apart) >= (4 if mode == "init" else 1)
    assert float(finding.evidence["largest_relative_difference"]) > 1e-3
    print(f"replicas_diverged ({mode}): step {finding.step}, {finding.summary}")


def test_healthy_ddp_twin_is_silent(
        sidecar: InProcessSidecar,
        replica_runs: dict[str, tuple[str, list[dict[str, Any]]]]) -> None:
    run_id, reports = replica_runs["healthy"]
    assert [r["steps"] for r in reports] == [10, 10]
    run = sidecar.seen(run_id)
    for rank in (0, 1):
        assert len(run.ranks[rank].local_seconds) == 10  # timed on both ranks
        assert [s.step for s in run.ranks[rank].replicas] == [4, 8]  # sampled (newest two)
    fired = {k: f.summary for k, f in sidecar.findings(run_id).items() if f.incidents}
    assert fired == {}, fired
    for detector in (RankStraggler(), ReplicasDiverged()):  # judged (not None), and silent
        assert detector.evaluate(run, SETTINGS) == Verdict(False, step=8 if detector.id ==
                                                           "replicas_diverged" else 10)
