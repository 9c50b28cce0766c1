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
import yaml

from alerts.rules import RANK_STOPPED, rank_stopped_expr
from deadweight.sidecar.baseline.build import build
from deadweight.sidecar.detectors import Verdict
from deadweight.sidecar.detectors.ranks import RankStraggler, ReplicasDiverged
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import RANKS, Store
from tests.support import ddp_worker, rank_worker, torchrun
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import start_prometheus, wait_for

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


def _start(sidecar: InProcessSidecar, mode: str, out: Path, steps: int | str, run_id: str,
           ranks: int = 2, env_more: dict[str, str] | None = None) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "DEADWEIGHT_RUN_ID": run_id,
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(WORKER.parents[2]), **(env_more or {})}
    cmd = torchrun.command([str(WORKER), mode, str(out), str(steps)], ranks)
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
    # A CPU hog beside the job (as on a shared machine): the healthy twin must not get a
    # straggler from a machine that slows its ranks now and then.
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        job = _start(sidecar, ",".join(REPLICA_RUNS), out,
                     ",".join(str(n) for n in REPLICA_RUNS.values()), base,
                     env_more={"DEADWEIGHT_UPDATE_PATH": "device"})
        _wait(job)
    finally:
        hog.kill()
        hog.wait()
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


#: The run's stall limit on each node's sidecar (the per-rank verdict keeps its 300 s default),
#: and the cross-node rule's: what the issue's job was watched with, shortened.
NODE_STALL_SECONDS = 3.0
NODE_SETTINGS = DetectorSettings(stalled_step_seconds=NODE_STALL_SECONDS)


def test_stuck_rank_is_named_on_its_node_and_across_nodes(tmp_path: Path) -> None:
    """A 3-rank DDP job over two nodes' sidecars: node a serves rank 0, node b ranks 1 and 2;
    rank 2 stops stepping after step 3 (alive) while ranks 0 and 1 go on into step 4 and wait
    in its gradient all-reduce. Node b's ``stalled`` names rank 2, its phase and since when;
    node a's says its rank waits and the culprit is elsewhere; a real Prometheus scraping both
    sidecars fires the shipped cross-node rule for rank 2."""
    nodes = [InProcessSidecar(tmp_path / f"node-{n}" / "dw.sock", settings=NODE_SETTINGS).start()
             for n in "ab"]
    run_id = f"ranks-nodes-{tmp_path.name}"
    rule = {"groups": [{"name": "ranks", "rules": [{
        "alert": RANK_STOPPED.name, "expr": rank_stopped_expr(int(NODE_STALL_SECONDS)),
        "labels": {"severity": "critical"}}]}]}
    targets = ", ".join(f"'127.0.0.1:{n.server.metrics_port}'" for n in nodes
                        if n.server is not None)
    config = ("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
              "rule_files: [ranks.rules.yml]\nscrape_configs:\n"
              f"  - job_name: deadweight\n    static_configs: [{{targets: [{targets}]}}]\n")
    out = tmp_path / "job"
    try:
        with start_prometheus(tmp_path / "prom", config,
                              {"ranks.rules.yml": yaml.safe_dump(rule)}) as prom:
            job = _start(nodes[0], "stall", out, 6, run_id, ranks=3, env_more={
                "DEADWEIGHT_ADDRESS_RANK0": nodes[0].address,
                "DEADWEIGHT_ADDRESS_RANK1": nodes[1].address,
                "DEADWEIGHT_ADDRESS_RANK2": nodes[1].address,
                "DEADWEIGHT_TEST_STUCK_RANK": "2"})
            try:
                def stalled(node: InProcessSidecar) -> Any:
                    finding = node.findings(run_id).get("stalled")
                    return finding if finding is not None and finding.firing else None

                on_b = wait_for(lambda: stalled(nodes[1]), 120, what="node b's stalled")
                named_at = time.time()
                on_a = wait_for(lambda: stalled(nodes[0]), 30, what="node a's stalled")

                def rank_alert() -> Any:
                    return [a for a in prom.alerts() if a["labels"].get("run_id") == run_id
                            and a["state"] == "firing"] or None

                alerts = wait_for(rank_alert, 60, what="the cross-node rule firing")
                progress = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(
                    f'deadweight_rank_progress_steps{{run_id="{run_id}"}}')}
            finally:
                (out / "release").touch()
            _wait(job)
    finally:
        for node in nodes:
            node.stop()
    evidence = on_b.fired_evidence
    assert evidence["rank"] == "2" and evidence["stuck_ranks"] == "2", evidence
    assert evidence["phase"] == "optimizer_step" and evidence["phase_step"] == "3"
    assert evidence["waiting_ranks"] == "1"
    assert evidence["waiting_phase_step"] == "4"
    assert evidence["waiting_phase"] in ("backward", "backward_done"), evidence
    assert "rank 2 stopped first, at optimizer step 3" in on_b.summary
    assert "rank" not in on_a.fired_evidence and on_a.fired_evidence["local_ranks"] == "0"
    assert "serves rank 0 only (of 3)" in on_a.summary
    assert [a["labels"]["rank"] for a in alerts] == ["2"]
    assert progress["2"] == 3 and progress["0"] > 3 and progress["1"] > 3, progress
    stuck_since = json.loads((out / "rank2.json").read_text())["step_times"][
        rank_worker.STALL_AFTER - 1]
    print(f"stalled: rank 2 named on its node {named_at - stuck_since:.1f} s after its last "
          f"step (limit {NODE_STALL_SECONDS} s); across nodes: {alerts[0]['labels']}")


def test_stuck_rank_is_named_under_the_trainer(sidecar: InProcessSidecar,
                                               tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """The same fault under a real SFTTrainer with the callback (DDP, gloo): rank 1's data
    loading hangs after step 2; rank 0 waits for it in a collective."""
    model_dir, adapter_dir = tiny
    run_id = f"ranks-trainer-stall-{tmp_path.name}"
    env = {**os.environ, "DEADWEIGHT_ADDRESS": sidecar.address, "DEADWEIGHT_RUN_ID": run_id,
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(WORKER.parents[2])}
    cmd = torchrun.command([str(WORKER.with_name("ddp_worker.py")), str(model_dir),
                            str(adapter_dir), str(tmp_path), "stall", "4"])
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


def test_a_job_s_rank_timings_reach_the_state_database_and_its_baseline(
        tmp_path: Path) -> None:
    """A real 2-rank job against a sidecar with a state database: every step both ranks
    timed is kept as its slowest rank's own seconds over the next one's (from two streams,
    whichever rank's batch completes the step), and a baseline saved from the job carries
    the ratio that calibrates rank_straggler (``test_baseline_calibration`` checks what it
    quiets, on exact timings)."""
    store = Store(tmp_path / "state")
    sidecar = InProcessSidecar(tmp_path / "sock" / "dw.sock", registry=Registry(
        settings=SETTINGS, store=store)).start()
    try:
        run_id, _ = _run(sidecar, "straggler", tmp_path / "job", 10)
    finally:
        sidecar.stop()
    try:
        timed = store.history(run_id, RANKS)
        assert [step for step, _, _ in timed] == list(range(1, 11))
        assert all(f["slowest_over_next"] >= 1 and f["slowest_seconds"] >= f["next_seconds"]
                   for _, _, f in timed)
        assert build(store, [run_id]).rank_time_ratio is not None
    finally:
        store.close()


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
    """The healthy twin ran beside a CPU hog: no verdict, no straggler. It ran the GPU's update
    path and counted the host reads in deadweight's hooks after its first step: none, on
    either DDP rank."""
    run_id, reports = replica_runs["healthy"]
    assert [r["steps"] for r in reports] == [10, 10]
    assert [r["host_reads_in_hooks"] for r in reports] == [0, 0]
    assert all(r["hooks_measured"] == ["_after_step", "_before_step", "log"] for r in reports)
    run = sidecar.seen(run_id)
    for rank in (0, 1):
        assert len(run.ranks[rank].local_seconds) == 10  # timed on both ranks
        assert [s.step for s in run.ranks[rank].replicas] == [4, 8]  # sampled (newest two)
    fired = {k: f.summary for k, f in sidecar.findings(run_id).items() if f.incidents}
    assert fired == {}, fired
    for detector in (RankStraggler(), ReplicasDiverged()):  # judged (not None), and silent
        assert detector.evaluate(run, SETTINGS) == Verdict(False, step=8 if detector.id ==
                                                           "replicas_diverged" else 10)
