"""Policy ``kill`` can only reach the process that registered, never one a message names.

One real sidecar (policy kill) and real client processes that report a frozen run and ignore
STOP. A victim ``sleep`` process is named in every free-form field of hostile clients; a
binding whose recorded start time no longer matches stands for a reused pid.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.model.process import start_time
from deadweight.sidecar.store.files import DB_NAME
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import (
    assert_never_signalled,
    enforcement_outcome,
    journal,
    kill_sidecar,
    start_raw_client,
    stop_all,
    wait_journal,
)
from tests.support.realprocs import wait_for

STOP_GRACE = 2.5


@pytest.fixture(scope="module")
def killer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Path]]:
    folder = tmp_path_factory.mktemp("killer")
    # The operator's opt-out lets the unattested liar register at all: it must still never
    # be signalled (without the opt-out it is refused outright, see test_trust_runs.py).
    with kill_sidecar(folder / "sidecar", folder / "state", STOP_GRACE, 0.5,
                      ["--allow-unattested"]) as sidecar:
        yield sidecar, folder / "state"


@pytest.fixture()
def victim() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "600"])
    yield process
    stop_all(process)


def test_a_pid_claimed_in_messages_is_never_signalled(
    killer: tuple[SidecarProcess, Path], victim: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    sidecar, state = killer
    born = start_time(victim.pid)
    claimed = f"claims-{victim.pid}"
    # Claims the victim's pid everywhere (attestation field included) and cannot attest.
    liar = start_raw_client(sidecar.socket_path, claimed, tmp_path / "liar.log",
                            attest=False, claim_pid=victim.pid)
    # Claims the victim's pid everywhere, but attests: the kernel names the liar itself.
    attested = start_raw_client(sidecar.socket_path, "attested-liar", tmp_path / "al.log",
                                attest=True, claim_pid=victim.pid)
    store = Store(state)
    try:
        wait_journal(store, claimed, ("sigterm", "no_identity"), 120)
        assert attested.wait(120) == -signal.SIGTERM
        wait_journal(store, "attested-liar", ("exit", "exited"), 30)
        wait_for(lambda: enforcement_outcome(store, claimed) not in ("", "open"), 30,
                 what="the liar's escalation to close")
        assert_never_signalled(liar)  # no identity: nobody was signalled for that run
    finally:
        stop_all(liar, attested)

    assert start_time(victim.pid) == born
    assert_never_signalled(victim)
    assert all(a.pid != victim.pid for a in store.actions())
    assert journal(store, claimed) == [("page", "no_pager"), ("stop", "sent"),
                                       ("sigterm", "no_identity")]
    assert enforcement_outcome(store, claimed) == "nothing_signalled"
    (term,) = [a for a in store.actions("attested-liar") if a.action == "sigterm"]
    assert (term.result, term.pid) == ("sent", attested.pid)
    assert store.bindings(claimed) == {}
    assert store.bindings("attested-liar")[0].pid == attested.pid


def test_a_pid_whose_start_time_changed_is_never_signalled(tmp_path: Path) -> None:
    """The escalation's targets are fixed (and journaled) when it begins; a restarted
    sidecar signals only those. A journaled target whose start time no longer matches the
    live process stands for a reused pid: it is observed as gone, never signalled."""
    state = tmp_path / "state"
    sidecar = kill_sidecar(tmp_path / "sidecar", state, STOP_GRACE, 0.5).start()
    client = start_raw_client(sidecar.socket_path, "reused", tmp_path / "client.log",
                              attest=True)
    store = Store(state)
    restarted = None
    try:
        wait_journal(store, "reused", ("stop", "sent"), 120)
        # The sidecar journals STOP, then begins the escalation and fixes its targets: a
        # SIGKILL right after the STOP row can land before the targets are written.
        wait_for(lambda: any(i.targets for i in store.incidents("reused")
                             if i.detector == "frozen_weights"), 30,
                 what="the escalation's targets journaled")
        assert sidecar.process is not None
        sidecar.process.send_signal(signal.SIGKILL)
        sidecar.process.wait(10)
        with sqlite3.connect(state / DB_NAME, timeout=10) as db:
            (targets,) = db.execute("SELECT targets FROM incidents WHERE run_id = 'reused' "
                                    "AND detector = 'frozen_weights'").fetchone()
            fixed = json.loads(targets)
            assert [v[0] for v in fixed.values()] == [client.pid]  # fixed at the start
            for value in fixed.values():
                value[3] += 1  # the recorded process is no longer the one holding the pid
            db.execute("UPDATE incidents SET targets = ? WHERE run_id = 'reused'",
                       (json.dumps(fixed),))
        restarted = kill_sidecar(tmp_path / "sidecar", state, STOP_GRACE, 0.5).start()
        wait_journal(store, "reused", ("exit", "pid_reused"), 30)
        wait_for(lambda: enforcement_outcome(store, "reused") not in ("", "open"), 30,
                 what="the escalation to close")
        assert_never_signalled(client)
    finally:
        stop_all(client)
        if restarted is not None:
            restarted.stop()
        sidecar.stop()
    # The restart re-queues STOP (never sends a second), then sees the process as gone.
    assert journal(store, "reused") == [("page", "no_pager"), ("stop", "sent"),
                                        ("stop", "requeued"), ("exit", "pid_reused")]
    assert enforcement_outcome(store, "reused") == "exited"


def test_every_rank_of_the_run_is_signalled(
    killer: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    sidecar, state = killer
    store = Store(state)
    # Rank 0 registers first, so both ranks are known when the kill starts: this test is
    # about signalling every rank. A lower rank joining after a higher one fired is
    # tests/unit/test_rank_join.py's.
    ranks = [start_raw_client(sidecar.socket_path, "two-ranks", tmp_path / "r0.log",
                              attest=True, rank=0)]
    try:
        wait_for(lambda: 0 in store.bindings("two-ranks"), 60, what="rank 0 registered")
        ranks.append(start_raw_client(sidecar.socket_path, "two-ranks", tmp_path / "r1.log",
                                      attest=True, rank=1))
        assert [p.wait(120) for p in ranks] == [-signal.SIGTERM, -signal.SIGTERM]
        wait_for(lambda: enforcement_outcome(store, "two-ranks") == "terminated", 30,
                 what="the escalation to close")
    finally:
        stop_all(*ranks)
    terms = {(a.rank, a.pid) for a in store.actions("two-ranks") if a.action == "sigterm"}
    assert terms == {(0, ranks[0].pid), (1, ranks[1].pid)}
    assert {p.pid for p in store.bindings("two-ranks").values()} == {p.pid for p in ranks}
