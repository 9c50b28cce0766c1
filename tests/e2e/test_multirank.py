"""Multi-rank runs: a real ``torchrun --nproc-per-node 2`` DDP job (gloo, CPU) with the callback.

Every rank reports under rank 0's run id to one sidecar; the sidecar keeps per-rank figures
and one combined figure per step. Under DDP the parameters are replicated, so the combined
update norm must equal rank 0's (not sqrt(2) times it); for sharded runs (FSDP, ZeRO-3) the
squares add up. A frozen job is seen frozen on both ranks (it runs after its healthy twin, in
the same launch).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.registry import Registry
from tests.support import torchrun
from tests.support.faults import Pipe, metric_value
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import start_prometheus, wait_for

# torchrun ranks take both cores: these files run one after another, never beside each other
# (tests/support/schedule.py MULTIPROCESS_FILES)
pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parents[1] / "support" / "ddp_worker.py"
STEPS = 4  # ddp_worker.STEPS


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    process = InProcessSidecar(tmp_path_factory.mktemp("ddp") / "sock" / "dw.sock").start()
    yield process
    process.stop()


def _torchrun(sidecar: InProcessSidecar | SidecarProcess, tiny: tuple[Path, Path], out: Path,
              mode: str, steps: int = STEPS, overrides: str = "{}", read: bool = True
              ) -> list[dict[str, Any]]:
    model_dir, adapter_dir = tiny
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(WORKER.parents[2])}
    env.pop("DEADWEIGHT_RUN_ID", None)
    done = torchrun.run([str(WORKER), str(model_dir), str(adapter_dir), str(out), mode,
                         str(steps), overrides], env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)] if read else []


def _torchrun_runs(sidecar: InProcessSidecar | SidecarProcess, tiny: tuple[Path, Path],
                   out: Path, runs: list[tuple[str, dict[str, Any]]], steps: int = STEPS
                   ) -> list[list[dict[str, Any]]]:
    """Each run's rank reports: (mode, training-argument overrides) runs one after the other
    in one launch (one import of the trainer stack per rank), each its own run."""
    _torchrun(sidecar, tiny, out, ",".join(mode for mode, _ in runs), steps,
              json.dumps([overrides for _, overrides in runs]), read=False)
    found = [[json.loads((out / f"{i}-{mode}" / f"rank{r}.json").read_text()) for r in (0, 1)]
             for i, (mode, _) in enumerate(runs)]
    run_ids = [reports[0]["run_id"] for reports in found]
    assert len(set(run_ids)) == len(run_ids), f"two runs of one launch shared an id: {run_ids}"
    return found


@pytest.fixture(scope="module")
def twins(sidecar: InProcessSidecar, tiny: tuple[Path, Path],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The healthy and the frozen job's rank reports, the two run in one launch."""
    healthy, frozen = _torchrun_runs(sidecar, tiny, tmp_path_factory.mktemp("twins"),
                                     [("healthy", {}), ("frozen", {})])
    return {"healthy": healthy, "frozen": frozen}


def _run_of(sidecar: InProcessSidecar, reports: list[dict[str, Any]]) -> Any:
    run_ids = {r["run_id"] for r in reports}
    assert len(run_ids) == 1, f"ranks reported under different ids: {run_ids}"
    run = sidecar.run(run_ids.pop())
    assert run is not None
    assert sorted(run.ranks) == [0, 1]
    return run


@pytest.mark.slow
def test_ddp_run_per_rank_and_combined(sidecar: InProcessSidecar,
                                       twins: dict[str, list[dict[str, Any]]]) -> None:
    reports = twins["healthy"]
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
    sidecar: InProcessSidecar, twins: dict[str, list[dict[str, Any]]]
) -> None:
    reports = twins["frozen"]
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


@pytest.mark.slow
def test_stop_policy_stops_every_rank_after_the_same_step(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """Ranks get STOP one step apart; a rank leaving early would strand its peer in the next
    all-reduce (the job crashed in about half the runs before the ranks agreed on a step)."""
    with SidecarProcess(tmp_path / "sidecar", policies={"frozen_weights": "stop"}) as sidecar:
        reports = _torchrun(sidecar, tiny, tmp_path / "job", "frozen", steps=40)
        steps = {r["global_step"] for r in reports}
        assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
        assert steps.pop() < 40
        run = sidecar.run_status(reports[0]["run_id"])
        assert run is not None and sorted(run.ranks) == [0, 1]
        frozen = {f.detector: f for f in run.findings}["frozen_weights"]
        assert frozen.policy == "stop"


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


def _send_rank(sidecar: InProcessSidecar, rank: int, steps: list[float], dropped: int) -> None:
    """One rank of a sharded 4-rank job reporting to its node's sidecar."""
    pipe = Pipe(sidecar.address)
    start = pb.RunStart(trainer="SFTTrainer", world_size=4, sharded=True)
    try:
        assert not pipe.send(pb.StreamRequest(run_id="two-nodes", rank=rank, events=[
            pb.Event(run_start=start),
            pb.Event(heartbeat=pb.Heartbeat(dropped_events=dropped))])).error
        for step, sq in enumerate(steps, start=1):
            report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=sq,
                                   watched_params=100, optimizer_params=100)
            assert not pipe.send(pb.StreamRequest(run_id="two-nodes", rank=rank, events=[
                pb.Event(seq=step, step=report)])).error
    finally:
        pipe.close()


@pytest.mark.slow
def test_prometheus_combines_two_nodes(tmp_path: Path) -> None:
    """The queries of docs/multinode.md, on a real Prometheus scraping two node sidecars."""
    nodes = [InProcessSidecar(tmp_path / f"node-{n}" / "dw.sock").start() for n in "ab"]
    try:
        # Node a holds ranks 0-1, node b ranks 2-3; step 2 of the sharded job: squares 1,4,9,16.
        for rank, (index, dropped) in enumerate([(0, 0), (0, 0), (1, 3), (1, 0)]):
            _send_rank(nodes[index], rank, [0.5, float((rank + 1) ** 2)], dropped)
        targets = ", ".join(f"'127.0.0.1:{n.server.metrics_port}'" for n in nodes
                            if n.server is not None)
        config = ("global: {scrape_interval: 1s}\nscrape_configs:\n"
                  f"  - job_name: deadweight\n    static_configs: [{{targets: [{targets}]}}]\n")
        with start_prometheus(tmp_path / "prom", config) as prom:
            def value(expr: str) -> float | None:
                result = prom.query(expr)
                return float(result[0]["value"][1]) if result else None

            wait_for(lambda: value('count(up{job="deadweight"} == 1)') == 2, 30,
                     what="both node sidecars scraped")
            whole = value("sqrt(sum by (run_id) (deadweight_update_norm ^ 2))")
            assert whole is not None and math.isclose(whole, math.sqrt(1 + 4 + 9 + 16))
            per_node = sorted(float(r["value"][1]) for r in
                              prom.query("deadweight_update_norm"))
            assert per_node == pytest.approx([math.sqrt(5), 5.0])
            assert value("min by (run_id) (deadweight_step)") == 2
            assert value("sum by (run_id) (deadweight_client_dropped_events_total)") == 3
            lag = value("time() - min by (run_id) (deadweight_last_step_timestamp_seconds)")
            assert lag is not None and 0 <= lag < 120
            assert value('count(count by (rank) (deadweight_step{run_id="two-nodes"}))') == 4
            assert value("max by (run_id) (deadweight_update_norm)") == 5.0  # replicated form
            assert prom.query('absent_over_time(deadweight_sidecar_info{job="deadweight"}[5m])'
                              ) == []  # parses; empty while the sidecars report
            nodes[1].stop()  # a blind node shows up as down, not as healthy silence
            wait_for(lambda: value('count(up{job="deadweight"} == 0)') == 1, 30,
                     what="the dead node's sidecar to be down")
    finally:
        for node in nodes:
            node.stop()
