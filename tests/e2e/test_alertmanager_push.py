"""The sidecar's own page path against a real Alertmanager: labels, annotations, resolve, and
that a dead Alertmanager never blocks the caller."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.sidecar.actions.alertmanager import (
    AlertmanagerPusher,
    alert_name,
    runbook_url,
)
from deadweight.sidecar.actions.links import DEFAULT_RUNBOOK_URL_PATTERN
from tests.support.realprocs import (
    Alertmanager,
    free_port,
    http_json,
    start_alertmanager,
    wait_for,
)

pytestmark = pytest.mark.slow

MINIMAL_CONFIG = """
route:
  receiver: blackhole
  group_by: [run_id]
receivers:
  - name: blackhole
"""


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    with start_alertmanager(tmp_path / "am", MINIMAL_CONFIG) as am:
        yield am


def test_alert_name_is_camel_case() -> None:
    assert alert_name("frozen_weights") == "DeadweightFrozenWeights"
    assert alert_name("kl_stuck_zero") == "DeadweightKlStuckZero"
    assert runbook_url(DEFAULT_RUNBOOK_URL_PATTERN, "frozen_weights").endswith(
        "/runbooks/frozen_weights")
    assert runbook_url("https://wiki/{alertname}", "kl_stuck_zero") == (
        "https://wiki/DeadweightKlStuckZero")


def test_fire_then_resolve_reaches_real_alertmanager(alertmanager: Alertmanager) -> None:
    pusher = AlertmanagerPusher(alertmanager.url, "https://example.invalid/runbooks/{detector}.md",
                                "https://grafana.invalid/d/deadweight-run/r?var-run_id={run_id}")
    try:
        pusher.fire("run-7", "frozen_weights", "critical", "Run run-7 is not learning",
                    "Weights did not move for 12 optimizer steps.",
                    {"update_norm": "0", "grad_norm": "0.41"}, starts_at=time.time() - 30)
        alerts = wait_for(lambda: alertmanager.alerts(run_id="run-7"), 10, what="alert")
        assert len(alerts) == 1
        alert = alerts[0]
        assert alert["labels"] == {"alertname": "DeadweightFrozenWeights", "run_id": "run-7",
                                   "detector": "frozen_weights", "severity": "critical"}
        assert alert["status"]["state"] == "active"
        notes = alert["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url", "dashboard_url"}
        assert notes["runbook_url"] == "https://example.invalid/runbooks/frozen_weights.md"
        assert notes["dashboard_url"] == (
            "https://grafana.invalid/d/deadweight-run/r?var-run_id=run-7")
        assert alert["generatorURL"] == notes["dashboard_url"]
        assert "update_norm=0" in notes["description"]
        assert "grad_norm=0.41" in notes["description"]

        pusher.resolve("run-7", "frozen_weights", "critical")

        def resolved() -> bool:
            # Resolved alerts leave the active list (API v2 lists only unresolved ones).
            return not alertmanager.alerts(run_id="run-7")

        wait_for(resolved, 10, what="resolution")
        assert pusher.firing() == []
    finally:
        pusher.close()


def test_firing_alerts_are_resent(alertmanager: Alertmanager) -> None:
    """A firing alert is re-posted with a fresh endsAt, so it does not time out."""
    pusher = AlertmanagerPusher(alertmanager.url, resend_interval=0.3, validity_factor=2)
    try:
        pusher.fire("run-8", "empty_optimizer", "critical", "s", "d")
        first = wait_for(lambda: alertmanager.alerts(run_id="run-8"), 10, what="alert")
        ends0 = first[0]["endsAt"]
        wait_for(lambda: alertmanager.alerts(run_id="run-8")[0]["endsAt"] != ends0, 10,
                 what="re-send with a later endsAt")
        # The pusher counts a POST once it has read Alertmanager's answer, which can
        # come after Alertmanager already shows the new endsAt.
        wait_for(lambda: pusher.sent_batches >= 2, 10, what="the re-send acknowledged")
    finally:
        pusher.close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    bodies: list[Any] = []
    fail_first = 0

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length))
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        type(self).bodies.append(body)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_retries_with_backoff_until_delivered() -> None:
    """Two 503s, then success: the alert arrives, and the failures are counted."""
    _Recorder.bodies = []
    _Recorder.fail_first = 2
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    pusher = AlertmanagerPusher(url, backoff_initial=0.05, backoff_max=0.2)
    try:
        pusher.fire("run-9", "nonfinite_loss", "critical", "s", "d")
        wait_for(lambda: _Recorder.bodies, 10, what="delivery after retries")
        assert pusher.failed_posts == 2
        [[alert]] = _Recorder.bodies
        assert alert["labels"]["alertname"] == "DeadweightNonfiniteLoss"
        assert alert["startsAt"].endswith("Z") and alert["endsAt"] > alert["startsAt"]
    finally:
        pusher.close()
        server.shutdown()
        server.server_close()


def test_dead_alertmanager_never_blocks_fire() -> None:
    """Nothing listens on the port: fire/resolve return at once, failures are counted."""
    dead = f"http://127.0.0.1:{free_port()}"
    pusher = AlertmanagerPusher(dead, backoff_initial=0.05, backoff_max=0.1, max_pending=50)
    try:
        started = time.monotonic()
        for i in range(200):
            pusher.fire(f"run-{i}", "frozen_weights", "critical", "s", "d", {"k": "v"})
            pusher.resolve(f"run-{i}", "frozen_weights", "critical")
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, elapsed
        wait_for(lambda: pusher.failed_posts >= 2, 10, what="retries against a dead URL")
        # The backlog stays bounded: 200 distinct alerts, at most 50 pending plus one batch
        # in flight, so at least 100 must have been dropped (never delivered: nothing listens).
        wait_for(lambda: pusher.dropped >= 100, 10, what="bounded backlog")
        assert pusher.pending_count() <= 50
    finally:
        close_started = time.monotonic()
        pusher.close(flush_timeout=0.5)
        assert time.monotonic() - close_started < 5.0


def test_evidence_is_quoted_once() -> None:
    from deadweight.sidecar.actions.alertmanager import format_description

    assert format_description("Frozen.", {"a": "1", "b": "2"}) == "Frozen. Evidence: a=1, b=2."
    quoted = "Frozen. Evidence: a=1"
    assert format_description(quoted, {"a": "1"}) == quoted
    assert format_description("Frozen.", {}) == "Frozen."


def test_a_silence_never_reads_resolved_on_the_pager(tmp_path: Path) -> None:
    """On-call silences a paged root cause: its alert is taken back on both paths (resolved),
    but muted first, so the pager never hears "resolved" for a fault that still stands.

    A real registry, store, action sink and on-call handler judge a frozen run (an optimizer
    built empty) and page through a real pusher to a real Alertmanager running the shipped
    example config, whose receivers post to a recorder. The control, in the same notification
    group, is an alert resolved with no silence: its "resolved" notification shows the group
    was notified after the silenced cause's resolution reached Alertmanager."""
    from deadweight.sidecar.actions.pagers import PagerSet
    from tests.e2e.test_e2e_oncall import _alertmanager_config, _Recorder
    from tests.unit.test_silenced_cause import Run

    receiver = _Recorder()
    with start_alertmanager(tmp_path / "am", _alertmanager_config(receiver.url)) as am:
        pusher = AlertmanagerPusher(am.url)
        try:
            run = Run()
            run.actions.pager = PagerSet([pusher])

            def told(detector: str, status: str) -> bool:
                return any(a["labels"].get("run_id") == "r" and a["status"] == status
                           and a["labels"]["detector"] == detector
                           for n in receiver.bodies() for a in n["alerts"])

            def in_alertmanager(detector: str) -> bool:
                return any(a["labels"]["detector"] == detector for a in am.alerts(run_id="r"))

            run.frozen()
            pusher.fire("r", "nonfinite_loss", "critical", "control", "a control page")
            wait_for(lambda: told("empty_optimizer", "firing")
                     and told("nonfinite_loss", "firing"), 30, what="the pages notified")
            run.silence("empty_optimizer", 600)
            wait_for(lambda: not in_alertmanager("empty_optimizer"), 30,
                     what="the silenced cause's alert taken back")
            pusher.resolve("r", "nonfinite_loss", "critical")
            wait_for(lambda: told("nonfinite_loss", "resolved"), 30,
                     what="the control's resolution notified")
            assert not told("empty_optimizer", "resolved")
            # The mute is an Alertmanager silence of the cause and the symptoms it inhibits.
            [muted] = [s for s in http_json(am.url + "/api/v2/silences")
                       if s["status"]["state"] == "active"]
            matchers = {m["name"]: m["value"] for m in muted["matchers"]}
            assert matchers["run_id"] == "r"
            assert {"empty_optimizer", "frozen_weights", "checkpoint_unchanged"} <= set(
                matchers["detector"].split("|"))
            for symptom in ("frozen_weights", "checkpoint_unchanged"):
                assert not told(symptom, "resolved") and not told(symptom, "firing")
        finally:
            pusher.close()
            receiver.close()
