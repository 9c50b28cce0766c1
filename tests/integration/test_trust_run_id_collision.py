"""Two real jobs, one ``DEADWEIGHT_RUN_ID``: the frozen one is caught, the learning one is
never touched, and both users are told of the collision.

A real sidecar (policy kill) and two real SFT trainings started with the same run id, as a
job template with a fixed id does: job A (frozen adapter, ignores STOP) registers first; job
B (a trainable adapter that learns) starts while A lives. B is refused and its console says
why (the run id is in use by A's pid; B is not monitored), B trains to its last step and exits
0, never signalled or stopped; A's run gets ``run_id_in_use`` (in A's own trainer logs and
in ``deadweight status``) and A, still frozen, is SIGTERMed: every signal went to A's pid.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import journal, kill_sidecar, start_job, stop_all
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

RUN = "templated-run-id"
STEPS_B = 25
#: Seconds from A's STOP to its SIGTERM: far beyond B's 25 steps once B is ready.
STOP_GRACE = 30.0


def test_two_jobs_with_one_run_id(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    state = tmp_path / "state"
    sidecar = kill_sidecar(tmp_path / "sidecar", state, stop_grace=STOP_GRACE, kill_grace=2.0)
    # B starts beside A and imports meanwhile, then begins training (its RunStart) only on the
    # go file, once A is registered: B meets A alive, the collision this test is about. STOP's
    # grace outlasts B's whole training life, so A is still alive when B ends.
    go = tmp_path / "go"
    with sidecar:
        store = Store(state)
        frozen = start_job(tiny, tmp_path / "a", sidecar.address, RUN, "ignore_stop")
        learning = start_job(tiny, tmp_path / "b", sidecar.address, RUN, "obey", trainable=1,
                             steps=STEPS_B, step_pause=0.05, go_file=go)
        try:
            wait_for(lambda: 0 in store.bindings(RUN), 120, what="job A to register")
            assert store.bindings(RUN)[0].pid == frozen.pid
            b_ready = tmp_path / "b" / f"{RUN}.log"
            wait_for(lambda: "READY" in b_ready.read_text(), 120, what="job B to be ready")
            assert frozen.poll() is None
            go.touch()
            assert learning.wait(300) == 0  # trained to the end, never signalled
            assert frozen.wait(240) == -signal.SIGTERM  # the frozen job was caught
        finally:
            stop_all(frozen, learning)
        b_log = (tmp_path / "b" / f"{RUN}.log").read_text()
        a_log = (tmp_path / "a" / f"{RUN}.log").read_text()
        status = sidecar.run_status(RUN)
    assert f"TRAINING_ENDED step={STEPS_B}" in b_log  # never stopped
    # B's user is told, in its own console: whose run id it is and that B is not monitored.
    assert "in use by another live process" in b_log
    assert f"pid {frozen.pid}" in b_log and "not monitored" in b_log
    # A's user is told in A's trainer logs and in the sidecar's status.
    assert "'deadweight/firing/run_id_in_use': '1'" in a_log
    assert status is not None
    in_use = next(f for f in status.findings if f.detector == "run_id_in_use")
    assert f"pid {learning.pid}" in in_use.evidence["newcomer"]
    # Nothing of the journal names B: every signal went to A's registered process.
    actions = store.actions(RUN)
    assert all(a.pid in (None, frozen.pid) for a in actions)
    assert ("sigterm", "sent") in journal(store, RUN)
    assert [a.pid for a in actions if a.action == "sigterm"] == [frozen.pid]
    assert store.bindings(RUN) == {0: store.bindings(RUN)[0]}
    assert store.bindings(RUN)[0].pid == frozen.pid
    store.close()
