"""Capacity cannot be hoarded, against a real ``deadweight serve`` (and the registry itself
for the per-uid cap).

One same-uid process used to hold every slot of the run table (1000 live runs) and lock out
every later run, restarts included. Now each process holds at most ``--max-runs-per-process``
live runs; when the table is full, a newcomer from another process still gets in: the
process holding the most live runs gives up its least recently heard one (not the newcomer);
a hoarder that is itself the newcomer is refused; every refusal is counted by uid.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.registry import Peer, Registry
from deadweight.sidecar.store.journal import Store
from tests.support.faults import Pipe, metric_value
from tests.support.raw_client import frozen_events
from tests.support.realprocs import wait_for

ROOT = Path(__file__).resolve().parents[2]
#: A second process of the same uid that registers runs prefix-0..N-1 over its own stream.
HOARD = """
import json, sys
from deadweight.proto import pb
from tests.support.faults import Pipe
pipe = Pipe(sys.argv[1])
errors = [pipe.send(pb.StreamRequest(run_id=f"{sys.argv[2]}-{i}", events=[pb.Event(
    run_start=pb.RunStart(trainer="SFTTrainer"))])).error for i in range(int(sys.argv[3]))]
print(json.dumps(errors), flush=True)
sys.stdin.read()
"""


def _start(run_id: str) -> pb.StreamRequest:
    return pb.StreamRequest(run_id=run_id, events=[pb.Event(
        run_start=pb.RunStart(trainer="SFTTrainer"))])


@pytest.fixture()
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    with SidecarProcess(tmp_path, extra_args=["--max-runs", "20", "--max-runs-per-process",
                                              "12"]) as process:
        yield process


def _hoarder(process: SidecarProcess, prefix: str, count: int) -> tuple[
        subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, "-c", HOARD, process.address, prefix,
                              str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                       "PATH": "/usr/bin:/bin"})
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


def test_a_hoarding_process_cannot_lock_out_another(sidecar: SidecarProcess) -> None:
    pipe = Pipe(sidecar.address)  # this test's process: the hoarder
    other = None
    try:
        answers = [pipe.send(_start(f"hoard-{i}")).error for i in range(13)]
        assert answers[:12] == [""] * 12
        assert "already holds 12 live runs" in answers[12]  # the per-process cap
        other, errors = _hoarder(sidecar, "other", 8)  # another process fills the table
        assert errors == [""] * 8
        status = sidecar.status()
        assert len([r for r in status.runs if not r.ended]) == 20
        # A newcomer from a third process still gets in: the hoarder gives up one run.
        newcomer, errors = _hoarder(sidecar, "newcomer", 1)
        try:
            assert errors == [""]
        finally:
            assert newcomer.stdin is not None
            newcomer.stdin.close()
            newcomer.wait(30)
        ids = {r.run_id for r in sidecar.status().runs if not r.ended}
        assert "newcomer-0" in ids
        assert all(f"other-{i}" in ids for i in range(8))  # not the smaller holder's
        assert len([i for i in range(12) if f"hoard-{i}" in ids]) == 11
        # The hoarder itself, now the largest holder, cannot take a slot back.
        assert "tracks 20 live runs" in pipe.send(_start("hoard-again")).error
        text = sidecar.metrics()
        assert metric_value(text, "deadweight_runs_refused_total", uid="0",
                            reason="process") == 1
        assert metric_value(text, "deadweight_runs_refused_total", uid="0",
                            reason="table") == 1
        assert "deadweight_runs_evicted_total 1.0" in text
    finally:
        pipe.close()
        if other is not None and other.stdin is not None:
            other.stdin.close()
            other.wait(30)


def test_the_processes_of_one_uid_share_a_cap() -> None:
    """Per uid: many processes of one uid together stop at --max-runs-per-uid; another uid
    still registers (the registry itself, each peer as the unix transport names it)."""
    registry = Registry(max_runs=100, max_runs_per_process=3, max_runs_per_uid=5)
    answers = [registry.ingest(_start(f"u-{i}"), Peer(pid=1000 + i, uid=7, address="unix:"))
               .error for i in range(6)]
    assert answers[:5] == [""] * 5 and "uid 7 already holds 5 live runs" in answers[5]
    assert not registry.ingest(_start("v-0"), Peer(pid=2000, uid=8, address="unix:")).error
    assert registry.capacity_refusals == {("7", "uid"): 1}
    # Ended runs free their slots.
    end = pb.StreamRequest(run_id="u-0", events=[pb.Event(seq=5, run_end=pb.RunEnd())])
    assert not registry.ingest(end, Peer(pid=1000, uid=7, address="unix:")).error
    assert not registry.ingest(_start("u-6"), Peer(pid=1006, uid=7, address="unix:")).error


def test_runs_that_never_step_give_up_the_uid_cap_to_a_real_job() -> None:
    """Five processes of one uid used to fill its cap with runs that never step, and a real
    (frozen) job of that uid was refused: never known, never stopped. Runs that registered
    longer ago than --reclaim-unstepped-seconds without one step now give up their slots,
    oldest first; a run that steps is never reclaimed."""
    store = Store()
    registry = Registry(max_runs=100, max_runs_per_process=3, max_runs_per_uid=5,
                        reclaim_unstepped_seconds=0.0, store=store)
    stepping = Peer(pid=900, uid=7, address="unix:")
    assert not registry.ingest(_start("stepping"), stepping).error
    assert not registry.ingest(pb.StreamRequest(run_id="stepping", events=frozen_events(1, 1)),
                               stepping).error
    for i in range(4):  # the hoarders: one uid, several processes, runs that never step
        assert not registry.ingest(_start(f"idle-{i}"),
                                   Peer(pid=1000 + i, uid=7, address="unix:")).error
    job = Peer(pid=2000, uid=7, address="unix:")
    assert not registry.ingest(_start("real-job"), job).error
    live = {run.run_id for run, _ in registry.runs() if not run.ended}
    assert "real-job" in live and "stepping" in live and "idle-0" not in live
    assert registry.evicted_live_runs == 1
    reclaimed = store.run("idle-0")  # its end is in the journal, as every eviction's is
    assert reclaimed is not None and reclaimed.ended and reclaimed.end_reason == "evicted"
    for step in range(1, 8):  # the real job is judged: it is frozen
        registry.ingest(pb.StreamRequest(run_id="real-job",
                                         events=frozen_events(step, 2 * step)), job)
    registry.tick()
    finding = registry.findings("real-job").get("frozen_weights")
    assert finding is not None and finding.firing


def test_young_runs_keep_their_slots_and_the_newcomer_is_refused() -> None:
    """The control: runs registered less than --reclaim-unstepped-seconds ago (a job still
    loading its model) are not reclaimed; the cap holds as before."""
    registry = Registry(max_runs=100, max_runs_per_process=3, max_runs_per_uid=2,
                        reclaim_unstepped_seconds=3600.0)
    for i in range(2):
        assert not registry.ingest(_start(f"young-{i}"),
                                   Peer(pid=1000 + i, uid=7, address="unix:")).error
    refused = registry.ingest(_start("late"), Peer(pid=2000, uid=7, address="unix:")).error
    assert "uid 7 already holds 2 live runs" in refused
    assert registry.evicted_live_runs == 0


def test_one_run_processes_that_never_step_do_not_lock_a_full_table(tmp_path: Path) -> None:
    """With the manifest's --max-runs 8, eight one-run processes that never step used to lock
    the pod's real job out (no process held more than the newcomer would). Once they are older
    than --reclaim-unstepped-seconds, the oldest gives up its slot to the real job."""
    with SidecarProcess(tmp_path, extra_args=["--max-runs", "8",
                                              "--reclaim-unstepped-seconds", "1"]) as process:
        squatters = [_hoarder(process, f"squat{i}", 1) for i in range(8)]
        try:
            assert all(errors == [""] for _, errors in squatters)
            started = min(r.started_at for r in process.status().runs)
            pipe = Pipe(process.address)
            try:
                refusals: list[str] = []

                def admitted() -> bool:
                    error = pipe.send(_start("real-job")).error
                    if error:
                        refusals.append(error)
                    return not error

                # Refused until the squatters' runs grow older than the reclaim age.
                wait_for(admitted, 30, interval=0.1, what="the real job admitted")
                assert all("tracks 8 live runs" in error for error in refusals), refusals
                assert time.time() - started >= 1.0
                seq = 1
                for step in range(1, 8):
                    pipe.send(pb.StreamRequest(run_id="real-job",
                                               events=frozen_events(step, seq)))
                    seq += 2
                status = process.run_status("real-job")
                assert status is not None and status.step == 7
                assert any(f.detector == "frozen_weights" and f.firing
                           for f in status.findings)
                live = {r.run_id for r in process.status().runs if not r.ended}
                assert len(live) == 8 and "squat0-0" not in live
            finally:
                pipe.close()
        finally:
            for child, _ in squatters:
                assert child.stdin is not None
                child.stdin.close()
                child.wait(30)
