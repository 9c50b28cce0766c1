"""Multi-rank runs: a real ``torchrun --nproc-per-node 2`` DDP job (gloo, CPU) with the callback.

Every rank reports under rank 0's run id to one sidecar; the sidecar keeps per-rank figures
and one combined figure per step. Under DDP the parameters are replicated, so the combined
update norm must equal rank 0's (not sqrt(2) times it); for sharded runs (FSDP, ZeRO-3) the
squares add up. A frozen job is seen frozen on both ranks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import free_port
from deadweight.proto import pb
from deadweight.sidecar.registry import Registry
from tests.faults import InProcessSidecar, metric_value

WORKER = Path(__file__).with_name("ddp_worker.py")
STEPS = 4  # ddp_worker.STEPS


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    process = InProcessSidecar(tmp_path_factory.mktemp("ddp") / "sock" / "dw.sock").start()
    yield process
    process.stop()


def _torchrun(sidecar: InProcessSidecar, tiny: tuple[Path, Path], out: Path,
              mode: str) -> list[dict[str, Any]]:
    model_dir, adapter_dir = tiny
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    env.pop("DEADWEIGHT_RUN_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(WORKER), str(model_dir), str(adapter_dir), str(out), mode]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _run_of(sidecar: InProcessSidecar, reports: list[dict[str, Any]]) -> Any:
    run_ids = {r["run_id"] for r in reports}
    assert len(run_ids) == 1, f"ranks reported under different ids: {run_ids}"
    run = sidecar.run(run_ids.pop())
    assert run is not None
    assert sorted(run.ranks) == [0, 1]
    return run


@pytest.mark.slow
def test_ddp_run_per_rank_and_combined(sidecar: InProcessSidecar, tiny: tuple[Path, Path],
                                       tmp_path: Path) -> None:
    reports = _torchrun(sidecar, tiny, tmp_path, "healthy")
    assert [r["global_step"] for r in reports] == [STEPS, STEPS]
    assert [r["process_index"] for r in reports] == [0, 1]
    run = _run_of(sidecar, reports)
    assert not run.start.sharded and run.start.world_size == 2
    rank0, rank1 = (list(run.ranks[r].steps) for r in (0, 1))
    assert [p.step for p in rank0] == [p.step for p in rank1] == list(range(1, STEPS + 1))
    for a, b in zip(rank0, rank1, strict=True):
        assert a.update_sq_sum > 0
        assert math.isclose(a.update_sq_sum, b.update_sq_sum, rel_tol=1e-9)  # replicas agree
    combined = run.combined_steps()
    assert [p.update_norm for p in combined] == [p.update_norm for p in rank0]  # no double count
    for r, report in enumerate(reports):  # nothing lost on either rank
        rank = run.ranks[r]
        assert report["dropped"] == 0 and rank.dropped_events == 0
        assert rank.membership.optimizer_params == run.ranks[0].membership.optimizer_params > 0
    text = sidecar.metrics()
    run_id = run.run_id
    for label in ("0", "1"):
        assert metric_value(text, "deadweight_step", run_id=run_id, rank=label) == STEPS
        assert metric_value(text, "deadweight_optimizer_params", run_id=run_id,
                            rank=label) == run.ranks[0].membership.optimizer_params
    exported = metric_value(text, "deadweight_update_norm", run_id=run_id)
    assert exported is not None and math.isclose(exported, rank0[-1].update_norm, rel_tol=1e-9)
    assert not any(f.incidents for f in sidecar.registry.findings(run_id).values()), \
        {k: f.summary for k, f in sidecar.registry.findings(run_id).items() if f.incidents}


@pytest.mark.slow
def test_frozen_ddp_run_is_caught_on_both_ranks(
    sidecar: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    reports = _torchrun(sidecar, tiny, tmp_path, "frozen")
    assert [r["global_step"] for r in reports] == [STEPS, STEPS]  # trained "normally"
    run = _run_of(sidecar, reports)
    for r in (0, 1):
        steps = list(run.ranks[r].steps)
        assert [p.step for p in steps] == list(range(1, STEPS + 1))
        assert all(p.update_sq_sum == 0 and p.grad_not_in_optimizer_params > 0 for p in steps)
    findings = sidecar.registry.findings(run.run_id)
    frozen = findings["frozen_weights"]
    assert frozen.incidents == 1 and frozen.step <= STEPS
    assert frozen.evidence["update_norm"] == "0"
    text = sidecar.metrics()
    for label in ("0", "1"):
        assert (metric_value(text, "deadweight_grad_not_in_optimizer_params",
                             run_id=run.run_id, rank=label) or 0) > 0


def _step(rank: int, step: int, sq: float) -> pb.StreamRequest:
    report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=sq, watched_params=10,
                           optimizer_params=10)
    return pb.StreamRequest(run_id="combine", rank=rank,
                            events=[pb.Event(seq=step, step=report)])


@pytest.mark.parametrize("sharded", [False, True])
def test_combined_norm_sums_squares_only_for_shards(sharded: bool) -> None:
    registry = Registry()
    start = pb.RunStart(trainer="SFTTrainer", world_size=2, sharded=sharded)
    for rank in (0, 1):
        registry.ingest(pb.StreamRequest(run_id="combine", rank=rank,
                                         events=[pb.Event(run_start=start)]))
    for request in (_step(0, 1, 9.0), _step(1, 1, 16.0), _step(0, 2, 4.0)):
        assert not registry.ingest(request).error
    run = registry.run("combine")
    assert run is not None
    combined = run.combined_steps()
    if sharded:  # squares add up; step 2 waits until every rank has reported its shard
        assert [(p.step, p.update_norm, p.optimizer_params) for p in combined] == [(1, 5.0, 20)]
    else:  # replicas: rank 0 stands for all, nothing counted twice
        assert [(p.step, p.update_norm, p.optimizer_params) for p in combined] == [
            (1, 3.0, 10), (2, 2.0, 10)]
