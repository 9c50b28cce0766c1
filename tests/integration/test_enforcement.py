"""Policy ``kill`` on real frozen training jobs: STOP, then SIGTERM, then SIGKILL, journaled.

Three real SFT jobs on a frozen adapter (F1), each its own process, report to one real sidecar
whose frozen_weights policy is kill with one-second graces: one obeys STOP, one ignores it
(a callback that drops directives), one also ignores SIGTERM. Each ends exactly as far up the
escalation as it forces, and every step of it is in the SQLite journal; the job that obeys
says on its console why it stopped and that the policy would have terminated it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from deadweight.sidecar.actions.enforcer import STEPS_IN_FLIGHT
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import (
    enforcement_outcome,
    journal,
    kill_sidecar,
    start_job,
    stop_all,
)
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

MODES = ("obey", "ignore_stop", "ignore_term")


def test_kill_policy_escalates_only_as_far_as_each_job_forces(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    with kill_sidecar(tmp_path / "sidecar", state, stop_grace=1.0, kill_grace=1.0) as sidecar:
        jobs = {mode: start_job(tiny, tmp_path / "jobs", sidecar.address, f"kill-{mode}", mode)
                for mode in MODES}
        try:
            codes = {mode: job.wait(timeout=300) for mode, job in jobs.items()}
        finally:
            stop_all(*jobs.values())
        store = Store(state)
        wait_for(lambda: not store.open_enforcements(), 30, what="escalations to close")
        metrics = sidecar.metrics()

    logs = {mode: (tmp_path / "jobs" / f"kill-{mode}.log").read_text() for mode in MODES}
    assert codes == {"obey": 0, "ignore_stop": -signal.SIGTERM,
                     "ignore_term": -signal.SIGKILL}, logs
    assert "TRAINING_ENDED" in logs["obey"]
    # the console of the job that obeyed: the root cause (the adapter loaded without
    # is_trainable) before the trigger, its fix, and the termination a kill policy holds ready
    stop = next(line for line in logs["obey"].splitlines()
                if "deadweight STOPPED run kill-obey (stopping training)" in line)
    assert "root cause empty_optimizer: The optimizer was built with zero parameters" in stop
    assert "(stop triggered by frozen_weights). Fix: Load the adapter with " in stop, stop
    assert "this process is about to be terminated (SIGTERM, then SIGKILL)." in stop
    assert "IGNORING directive" in logs["ignore_stop"]

    assert journal(store, "kill-obey") == [
        ("page", "no_pager"), ("stop", "sent"), ("exit", "exited")]
    assert journal(store, "kill-ignore_stop") == [
        ("page", "no_pager"), ("stop", "sent"), ("sigterm", "sent"), ("exit", "exited")]
    assert journal(store, "kill-ignore_term") == [
        ("page", "no_pager"), ("stop", "sent"), ("sigterm", "sent"), ("sigkill", "sent"),
        ("exit", "exited")]
    for mode, job in jobs.items():
        rows = store.actions(f"kill-{mode}", "frozen_weights")
        signals = [r for r in rows if r.action in ("sigterm", "sigkill", "exit")]
        assert {(r.rank, r.pid) for r in signals} == {(0, job.pid)}
        stop = next(r for r in rows if r.action == "stop")
        assert all(r.time >= stop.time for r in signals)
        assert signals[-1].detail["after"] == {"obey": "stop", "ignore_stop": "sigterm",
                                               "ignore_term": "sigkill"}[mode]
        assert stop.detail["step"] >= 3  # fired after K frozen optimizer steps
    obey_stop = next(r for r in store.actions("kill-obey") if r.action == "stop")
    ended_at = int(logs["obey"].split("TRAINING_ENDED step=")[1].split()[0])
    assert ended_at <= obey_stop.detail["step"] + STEPS_IN_FLIGHT  # STOP obeyed promptly
    assert enforcement_outcome(store, "kill-obey") == "exited"
    assert enforcement_outcome(store, "kill-ignore_stop") == "terminated"
    assert enforcement_outcome(store, "kill-ignore_term") == "killed"
    for action in ("stop", "sigterm", "sigkill"):
        assert (f'deadweight_actions_total{{action="{action}",detector="frozen_weights",'
                f'result="sent",run_id="kill-ignore_term",trainer="SFTTrainer"}} 1.0'
                in metrics), metrics
