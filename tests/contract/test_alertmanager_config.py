"""The Alertmanager example: valid, routes by severity, groups by run, and a root cause
silences its symptoms for the same run only (checked on a real Alertmanager)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts import rules
from alerts.rules import SPECS
from deadweight.sidecar.actions.alertmanager import AlertmanagerPusher, alert_name
from tests.support.realprocs import start_alertmanager, wait_for

CONFIG = Path(__file__).resolve().parents[2] / "alerts" / rules.ALERTMANAGER_FILE
RECEIVER = {"critical": "pager", "warning": "ticket", "info": "null"}


def _routes(*labels: str) -> str:
    out = subprocess.run(
        ["amtool", "config", "routes", "test", f"--config.file={CONFIG}", *labels],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def test_check_config_is_clean() -> None:
    out = subprocess.run(["amtool", "check-config", str(CONFIG)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.parametrize("severity,receiver", sorted(RECEIVER.items()))
def test_routes_by_severity(severity: str, receiver: str) -> None:
    assert _routes(f"severity={severity}", "run_id=r1") == receiver


def test_every_detector_alert_reaches_the_receiver_of_its_severity() -> None:
    for d in SPECS:
        got = _routes(f"alertname={alert_name(d.id)}", f"detector={d.id}",
                      f"severity={d.severity.value}", "run_id=r1")
        assert got == RECEIVER[d.severity.value], d.id


def test_unlabelled_alerts_fall_back_to_tickets() -> None:
    assert _routes("alertname=Other") == "ticket"


def test_verify_receivers_can_fail() -> None:
    out = subprocess.run(
        ["amtool", "config", "routes", "test", f"--config.file={CONFIG}",
         "--verify.receivers=ticket", "severity=critical"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode != 0


def test_groups_one_notification_per_run() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config["route"]["group_by"] == ["run_id"]
    symptoms = [d for d in SPECS if rules.inhibitors(d)]
    assert symptoms, "no detector names a cause"
    for d in symptoms:  # one rule per set of causes inhibits each symptom
        causes = rules.inhibitors(d)
        [rule] = [r for r in config["inhibit_rules"] if r["equal"] == ["run_id"]
                  and alert_name(d.id) in r["target_matchers"][0]
                  and alert_name(causes[0]) in r["source_matchers"][0]]
        for cause in causes:  # every cause, however far up: inhibition is not transitive
            assert alert_name(cause) in rule["source_matchers"][0]


@pytest.mark.slow
def test_root_cause_inhibits_symptoms_of_the_same_run_only(tmp_path: Path) -> None:
    with start_alertmanager(tmp_path / "am", CONFIG.read_text()) as am:
        pusher = AlertmanagerPusher(am.url)
        try:
            pusher.fire("r1", "frozen_weights", "critical", "s", "d")
            pusher.fire("r1", "checkpoint_unchanged", "critical", "s", "d")
            pusher.fire("r1", "kl_stuck_zero", "warning", "s", "d")
            pusher.fire("r2", "checkpoint_unchanged", "critical", "s", "d")
            pusher.fire("r1", "empty_optimizer", "critical", "s", "d")

            def states() -> dict[tuple[str, str], dict[str, Any]]:
                return {(a["labels"]["run_id"], a["labels"]["detector"]): a["status"]
                        for a in am.alerts()}

            def settled() -> dict[tuple[str, str], dict[str, Any]] | None:
                # The inhibitor learns of the root cause asynchronously: poll until applied.
                s = states()
                if len(s) == 5 and s[("r1", "checkpoint_unchanged")]["state"] == "suppressed" \
                        and s[("r1", "frozen_weights")]["state"] == "suppressed" \
                        and s[("r1", "kl_stuck_zero")]["state"] == "suppressed":
                    return s
                return None

            got = wait_for(settled, 10, what="5 alerts, the symptoms suppressed")
            assert got[("r1", "checkpoint_unchanged")]["inhibitedBy"]
            # frozen_weights is a symptom of the empty optimizer too: only the root pages.
            assert got[("r1", "frozen_weights")]["inhibitedBy"]
            # Another run's symptom, with no cause firing there, and the root cause page.
            assert got[("r2", "checkpoint_unchanged")]["state"] == "active"
            assert got[("r1", "empty_optimizer")]["state"] == "active"
        finally:
            pusher.close()
