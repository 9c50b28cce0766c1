"""SIGKILL of the sidecar at random points while it writes its journal, then a restart.

A real ``deadweight serve`` (policy stop, a state dir) journals a frozen attested run that
ignores STOP: steps and logs (history), the incident, its page and its STOP. Six times, at a
random moment (seeded, so a failure replays) between 0.2 s and 3 s after the run registered,
the sidecar is SIGKILLed mid-write and started again on the same state dir. What must hold:
every restart opens the journal (never moved aside as corrupt), SQLite's integrity check
passes, and no incident was paged or stopped twice, however the writes were cut.
"""

from __future__ import annotations

import random
import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.files import DB_NAME
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import start_raw_client, stop_all
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

TRIES = 6
SEED = 28


def _sidecar(folder: Path, state: Path) -> SidecarProcess:
    return SidecarProcess(folder, policies={"frozen_weights": "stop"},
                          extra_args=["--state-dir", str(state)])


def test_sigkill_during_journal_writes_loses_nothing_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    state = tmp_path / "state"
    for attempt in range(TRIES):
        sidecar = _sidecar(tmp_path / "sidecar", state).start()
        client = start_raw_client(sidecar.socket_path, f"crash-{attempt}",
                                  tmp_path / f"client-{attempt}.log", attest=True)
        try:
            wait_for(lambda s=sidecar, run=f"crash-{attempt}": s.run_status(run), 60,
                     what="the run registered")
            # The fault's moment, drawn at random: a pause that places the SIGKILL, not a
            # wait on a condition.
            time.sleep(rng.uniform(0.2, 3.0))
            assert sidecar.process is not None
            sidecar.process.send_signal(signal.SIGKILL)
            sidecar.process.wait(10)
        finally:
            stop_all(client)
            sidecar.stop()
    final = _sidecar(tmp_path / "sidecar", state).start()
    try:
        assert final.status() is not None
    finally:
        final.stop()
    assert not list(state.glob(f"{DB_NAME}.corrupt-*"))  # no restart found it damaged
    with sqlite3.connect(state / DB_NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = Store(state)
    try:
        done = Counter((a.run_id, a.detector, a.incident, a.action) for a in store.actions()
                       if (a.action, a.result) in (("page", "no_pager"), ("stop", "sent")))
        assert done and max(done.values()) == 1, done
        runs = {r.run_id for r in store.runs()}
        assert {f"crash-{i}" for i in range(TRIES)} <= runs
        stops = {k[0] for k in done if k[3] == "stop"}
        assert len(stops) >= TRIES // 2  # most tries got as far as their verdict
    finally:
        store.close()
