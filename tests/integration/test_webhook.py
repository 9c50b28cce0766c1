"""``deadweight serve --webhook-url``: one JSON message per incident to a local receiver, with
retries, the pages' dedup (a restart posts nothing again) and per-target paging health; and
links that follow ``--metrics-address``: the runbook link in every page opens."""

from __future__ import annotations

import http.server
import json
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess, free_port
from deadweight.sidecar.actions.links import runbook_pattern_for
from deadweight.sidecar.actions.webhook import first_fix
from tests.support.enforcement_support import journal, start_raw_client, stop_all
from tests.support.realprocs import wait_for

SECRET_PATH = "/hooks/T000/B000/secret-token"


class Hooks(http.server.BaseHTTPRequestHandler):
    """A chat webhook (SECRET_PATH) and an Alertmanager API (/api/v2/alerts) on one port; the
    webhook answers 503 to its first ``fail_first`` posts."""

    messages: list[dict[str, Any]] = []
    alerts: list[dict[str, Any]] = []
    fail_first = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        cls = type(self)
        if self.path == SECRET_PATH:
            if cls.fail_first > 0:
                cls.fail_first -= 1
                self.send_response(503)
                self.end_headers()
                return
            cls.messages.append(body)
        elif self.path == "/api/v2/alerts":
            cls.alerts.extend(body)
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def hooks() -> Iterator[str]:
    Hooks.messages, Hooks.alerts, Hooks.fail_first = [], [], 2
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def metric(metrics: str, name: str, target: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'target="{target}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {target} not on /metrics")


def messages_for(run_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for message in Hooks.messages:
        if message["run_id"] == run_id:
            counts[message["detector"]] = counts.get(message["detector"], 0) + 1
    return counts


def test_webhook_pages_once_per_incident_with_links_that_open(
        tmp_path: Path, hooks: str) -> None:
    dead = free_port()
    port = hooks.rsplit(":", 1)[1]
    args = ["--webhook-url", hooks + SECRET_PATH,
            "--webhook-url", f"http://127.0.0.1:{dead}/nobody",
            "--alertmanager-url", hooks, "--state-dir", str(tmp_path / "state")]
    run_id = "run-webhook"
    sidecar = SidecarProcess(tmp_path / "sc", extra_args=args)
    assert sidecar.metrics_port != 9464  # the metrics port moved off the default
    with sidecar:
        client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log", attest=True)
        try:
            wait_for(lambda: messages_for(run_id).get("frozen_weights"), 30,
                     what="the webhook message after two 503s")
            wait_for(lambda: messages_for(run_id).get("empty_optimizer"), 30,
                     what="the second incident's message")
            metrics = sidecar.metrics()
            good, bad = f"webhook 127.0.0.1:{port}", f"webhook#2 127.0.0.1:{dead}"
            wait_for(lambda: ("page", "failed") in journal(_store(tmp_path), run_id), 30,
                     what="the page failed on the dead webhook")
            # The sidecar counts a POST once it has read the webhook's answer, which can come
            # after the webhook already holds the message (and after the dead one's failure).
            wait_for(lambda: metric(sidecar.metrics(), "deadweight_pager_attempts_total",
                                    good) >= 4, 30, what="the good webhook's answers counted")
            metrics = sidecar.metrics()
        finally:
            stop_all(client)
    assert metric(metrics, "deadweight_pager_failures_total", good) == 2
    assert metric(metrics, "deadweight_pager_attempts_total", good) >= 4
    assert metric(metrics, "deadweight_pager_last_success_timestamp_seconds", good) > 1e9
    assert metric(metrics, "deadweight_pager_failures_total", bad) >= 4
    assert metric(metrics, "deadweight_pager_last_success_timestamp_seconds", bad) == 0
    assert "secret-token" not in metrics and "/nobody" not in metrics

    [message] = [m for m in Hooks.messages if m["detector"] == "frozen_weights"]
    text = message["text"]
    for needed in (run_id, "frozen_weights", "Cause:", "Fix:", "Runbook:",
                   "weights unchanged"):
        assert needed in text, text
    assert message["fix"] == first_fix("frozen_weights") != ""
    assert message["fix"] in text and message["runbook_url"] in text
    # The runbook link follows the moved metrics port, and it opens.
    runbook = message["runbook_url"]
    assert runbook == f"http://127.0.0.1:{sidecar.metrics_port}/runbooks/frozen_weights"
    [pushed] = {a["annotations"]["runbook_url"] for a in Hooks.alerts
                if a["labels"]["detector"] == "frozen_weights"}
    assert pushed == runbook
    # No dashboard was configured: no dashboard link anywhere (never a dead default one).
    assert "dashboard_url" not in message and "Dashboard" not in text
    for alert in Hooks.alerts:
        assert "dashboard_url" not in alert["annotations"] and "generatorURL" not in alert

    # A restart re-asserts the open incidents to Alertmanager and posts nothing again.
    before = len(Hooks.messages)
    with SidecarProcess(tmp_path / "sc2", extra_args=args) as again:
        wait_for(lambda: ("page", "reasserted") in journal(_store(tmp_path), run_id), 30,
                 what="the pages re-asserted after the restart")
        with urllib.request.urlopen(runbook_pattern_for(
                f"127.0.0.1:{again.metrics_port}").format(detector="frozen_weights"),
                timeout=5) as response:
            assert response.status == 200 and b"frozen" in response.read().lower()
        wait_for(lambda: len([a for a in Hooks.alerts
                              if a["labels"]["detector"] == "frozen_weights"]) >= 2, 30,
                 what="the re-asserted alert at Alertmanager")
    assert len(Hooks.messages) == before
    assert messages_for(run_id) == {"frozen_weights": 1, "empty_optimizer": 1}


def test_a_configured_dashboard_pattern_is_the_link_pages_carry(
        tmp_path: Path, hooks: str) -> None:
    Hooks.fail_first = 0
    pattern = "https://grafana.example.com/d/deadweight-run/deadweight-run?var-run_id={run_id}"
    run_id = "run/dashboard"  # query-escaped in the link
    link = "https://grafana.example.com/d/deadweight-run/deadweight-run?var-run_id=run%2Fdashboard"
    with SidecarProcess(tmp_path / "sc", extra_args=[
            "--webhook-url", hooks + SECRET_PATH, "--alertmanager-url", hooks,
            "--dashboard-url-pattern", pattern]) as sidecar:
        client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log", attest=True)
        try:
            wait_for(lambda: messages_for(run_id).get("frozen_weights"), 30,
                     what="the webhook message")
            wait_for(lambda: [a for a in Hooks.alerts
                              if a["labels"]["detector"] == "frozen_weights"], 30,
                     what="the pushed alert")
        finally:
            stop_all(client)
    [message] = [m for m in Hooks.messages if m["detector"] == "frozen_weights"]
    assert message["dashboard_url"] == link
    assert f"Dashboard: {link}" in message["text"]
    pushed = [a for a in Hooks.alerts if a["labels"]["detector"] == "frozen_weights"]
    assert all(a["annotations"]["dashboard_url"] == link == a["generatorURL"] for a in pushed)


def _store(tmp_path: Path) -> Any:
    from deadweight.sidecar.store.journal import Store

    return Store(tmp_path / "state")


def test_link_patterns_follow_the_metrics_address() -> None:
    assert runbook_pattern_for("127.0.0.1:9555") == "http://127.0.0.1:9555/runbooks/{detector}"
    assert runbook_pattern_for("127.0.0.1:0", port=41234) == (
        "http://127.0.0.1:41234/runbooks/{detector}")
    # A wildcard bind is opened by the machine's name; an IPv6 host gets its brackets.
    assert runbook_pattern_for("0.0.0.0:9464") == (
        f"http://{socket.getfqdn()}:9464/runbooks/{{detector}}")
    assert runbook_pattern_for(":9464").startswith(f"http://{socket.getfqdn()}:9464/")
    assert runbook_pattern_for("::1:9464") == "http://[::1]:9464/runbooks/{detector}"
    assert re.fullmatch(r"http://\S+:\d+/runbooks/\{detector\}",
                        runbook_pattern_for("[::]:9464"))


def test_grafana_url_sets_the_dashboard_links() -> None:
    from deadweight.sidecar.commands.cli import build_parser
    from deadweight.sidecar.commands.serve_cli import sidecar_config

    args = build_parser().parse_args(["serve", "--metrics-address", "127.0.0.1:9555",
                                      "--grafana-url", "https://grafana.example.com/"])
    config = sidecar_config(args)
    assert config.dashboard_url_pattern == (
        "https://grafana.example.com/d/deadweight-run/deadweight-run?var-run_id={run_id}")
    assert config.runbook_url_pattern is None  # follows the metrics address once bound
    # Neither flag: no dashboard link at all.
    unset = sidecar_config(build_parser().parse_args(["serve"]))
    assert unset.dashboard_url_pattern == ""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--grafana-url", "https://g", "--dashboard-url-"
                                   "pattern", "https://x/{run_id}"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--webhook-url", "ftp://x/hook"])
