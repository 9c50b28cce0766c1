"""``--dry-run``: the whole escalation is decided, verified and journaled, and nothing is done."""

from __future__ import annotations

from pathlib import Path

from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import (
    assert_never_signalled,
    enforcement_outcome,
    journal,
    kill_sidecar,
    start_raw_client,
    stop_all,
)
from tests.support.realprocs import wait_for


def test_dry_run_journals_every_step_and_signals_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with kill_sidecar(tmp_path / "sidecar", state, 0.5, 0.5,
                      extra_args=["--dry-run"]) as sidecar:
        client = start_raw_client(sidecar.socket_path, "dry", tmp_path / "client.log",
                                  attest=True)
        store = Store(state)
        try:
            wait_for(lambda: enforcement_outcome(store, "dry") == "dry_run", 120,
                     what="the dry-run escalation to close")
            assert_never_signalled(client)
            log = sidecar.log_path.read_text()
        finally:
            stop_all(client)
    assert journal(store, "dry") == [("page", "dry_run"), ("stop", "dry_run"),
                                     ("sigterm", "dry_run"), ("sigkill", "dry_run")]
    assert all(a.dry_run for a in store.actions("dry"))
    assert {a.pid for a in store.actions("dry") if a.action.startswith("sig")} == {client.pid}
    assert "IGNORING" not in (tmp_path / "client.log").read_text()  # no STOP went out
    assert '"action": "sigkill"' in log and '"dry_run": true' in log
