"""Issue 12, item 5: a thousand never-ending unattested runs must not lock new runs out,
neither while the sidecar runs nor after it restarts on the same ``--state-dir``.

A real ``deadweight serve`` with ``--allow-unattested`` (the only way unattested streams
register on the unix socket) is filled to ``--max-runs`` by one unattested client whose
thousand runs never end, so a new run is refused for capacity. The sidecar is then restarted
on the same state folder with the squatter gone and its runs past ``--silent-run-seconds``:
the thousand runs come back from the store as ended (``silent``), not live, and a new run is
accepted at once.

The first sidecar's silence bound is far longer than any machine takes to fill the table
(a loaded machine once took longer than the restarted one's bound, so early squats ended
silent and made room before the table was full); the restarted one's is short, and the test
waits for it to pass since the last squat was written, not for a fixed time.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.store.journal import Store
from tests.support.faults import Pipe
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

RUNS = 1000
#: While the table fills: nothing may end silent, however slow the machine.
FILLING_SILENT_SECONDS = 3600.0
#: After the restart: the squats are past it once the test waited this long.
SILENT_SECONDS = 5.0


def _sidecar(folder: Path, silent_seconds: float) -> SidecarProcess:
    return SidecarProcess(folder, extra_args=[
        "--state-dir", str(folder / "state"), "--allow-unattested",
        "--silent-run-seconds", str(silent_seconds), "--max-runs", str(RUNS),
        # one client fills the table on purpose here: the per-process caps stand aside
        "--max-runs-per-process", str(RUNS), "--max-runs-per-uid", str(RUNS)])


def _start(pipe: Pipe, run_id: str) -> pb.StreamResponse:
    response: pb.StreamResponse = pipe.send(pb.StreamRequest(run_id=run_id, events=[
        pb.Event(seq=1, run_start=pb.RunStart(trainer="SFTTrainer", world_size=1)),
        pb.Event(time_seconds=time.time(), heartbeat=pb.Heartbeat())]))
    return response


def _heartbeat(pipe: Pipe, run_id: str) -> pb.StreamResponse:
    response: pb.StreamResponse = pipe.send(pb.StreamRequest(run_id=run_id, events=[
        pb.Event(time_seconds=time.time(), heartbeat=pb.Heartbeat())]))
    return response


def test_never_ending_unattested_runs_do_not_lock_out_new_runs_after_a_restart(
    tmp_path: Path,
) -> None:
    sidecar = _sidecar(tmp_path, FILLING_SILENT_SECONDS).start()
    try:
        squatter = Pipe(sidecar.address, attest=False)
        for i in range(RUNS):
            assert not _start(squatter, f"squat-{i}").error
        refused = Pipe(sidecar.address, attest=False)
        assert "live runs" in _start(refused, "new-before-restart").error  # the table is full
        refused.close()
        squatter.close()
    finally:
        sidecar.stop()
    # The squatter is gone; its runs are stale once the silence bound has passed since the
    # last of them was written (read from the journal the restarted sidecar reads).
    store = Store(tmp_path / "state")
    squatted_until = max(r.created for r in store.runs() if r.run_id.startswith("squat-"))
    store.close()
    wait_for(lambda: time.time() > squatted_until + SILENT_SECONDS, timeout=60,
             what="the silence bound to pass")

    restarted = _sidecar(tmp_path, SILENT_SECONDS).start()  # the same state folder
    try:
        newcomer = Pipe(restarted.address, attest=False)
        answer = _start(newcomer, "new-after-restart")
        assert not answer.error, answer.error  # accepted at once, not after a wait
        assert not _heartbeat(newcomer, "new-after-restart").error
        status = restarted.run_status("new-after-restart")
        assert status is not None and not status.ended
        statuses = {r.run_id: r for r in restarted.status().runs}
        squats = [r for r in statuses.values() if r.run_id.startswith("squat-")]
        assert len(squats) >= RUNS - 1  # read back (one may have made room for the newcomer)
        # The stale runs are not live: they ended as silent.
        assert all(r.ended and r.end_reason == "silent" for r in squats), \
            Counter((r.ended, r.end_reason) for r in squats)
        more = Pipe(restarted.address, attest=False)
        for i in range(5):  # further runs are admitted too (the ended stale ones make room)
            assert not _start(more, f"more-{i}").error
        more.close()
        newcomer.close()
    finally:
        restarted.stop()


def test_runs_whose_processes_exited_while_the_sidecar_was_down_make_room_at_once(
    tmp_path: Path,
) -> None:
    """The attested kind of stale run: its processes are gone by the restart, so the
    restored run ends (``process_exited``) before the first stream is served."""
    from tests.integration.test_trust_runs import Client

    folder = tmp_path / "attested"
    sidecar = SidecarProcess(folder, extra_args=["--state-dir", str(folder / "state"),
                                                 "--max-runs", "3"]).start()
    clients = [Client(sidecar, f"gone-{i}") for i in range(3)]
    try:
        for client in clients:
            assert not client.do(start={"seq": 1})["error"]
        refused = Pipe(sidecar.address)
        assert "live runs" in _start(refused, "new-before-restart").error
        refused.close()
    finally:
        sidecar.stop()  # down first, so it never sees the processes go
        for client in clients:
            client.close()  # the processes exit while no sidecar watches

    restarted = SidecarProcess(folder, extra_args=["--state-dir", str(folder / "state"),
                                                   "--max-runs", "3"]).start()
    try:
        newcomer = Pipe(restarted.address)
        answer = _start(newcomer, "new-after-restart")
        assert not answer.error, answer.error  # accepted at once
        gone = [r for r in restarted.status().runs if r.run_id.startswith("gone-")]
        assert gone and all(r.ended and r.end_reason == "process_exited" for r in gone)
        newcomer.close()
    finally:
        restarted.stop()
