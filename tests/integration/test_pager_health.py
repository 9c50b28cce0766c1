"""Paging health: an unreachable pager shows on /metrics, in the journal and in JSON logs, and
the shipped DeadweightPagerFailing alert fires on what the sidecar exports (promtool); a pager
that answers is journaled as delivered and the alert stays silent."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts import rules
from deadweight.demo.sidecar_process import SidecarProcess, free_port
from deadweight.proto import pb
from tests.support.enforcement_support import start_raw_client, stop_all
from tests.support.realprocs import wait_for

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = re.compile(r"^(?P<name>deadweight_pager_\w+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$",
                    re.MULTILINE)


def pager_samples(metrics: str) -> dict[tuple[str, str], float]:
    """(metric name, target) -> value of every deadweight_pager_* sample."""
    out = {}
    for match in SAMPLE.finditer(metrics):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        out[match["name"], labels["target"]] = float(match["value"])
    return out


def page_results(sidecar: SidecarProcess, run_id: str) -> list[str]:
    run = sidecar.run_status(run_id)
    return [] if run is None else [a.result for a in run.actions
                                   if a.action == "page" and a.detector == "frozen_weights"]


class _Answering(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def answering_pager() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def frozen_run(sidecar: SidecarProcess, run_id: str, log: Path) -> subprocess.Popen[bytes]:
    client = start_raw_client(sidecar.socket_path, run_id, log, attest=True)
    wait_for(lambda: any(f.detector == "frozen_weights" and f.firing for f in
                         (sidecar.run_status(run_id) or pb.RunStatus()).findings),
             30, what=f"frozen_weights firing on {run_id}")
    return client


def promtool(tmp_path: Path, series: list[dict[str, str]], expected: list[dict[str, Any]],
             eval_time: str = "10m") -> subprocess.CompletedProcess[str]:
    (tmp_path / rules.RULES_FILE).write_text((ROOT / "alerts" / rules.RULES_FILE).read_text())
    case = {"name": "scraped", "interval": "1m", "input_series": series,
            "alert_rule_test": [{"eval_time": eval_time, "alertname": "DeadweightPagerFailing",
                                 "exp_alerts": expected}]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": [rules.RULES_FILE], "evaluation_interval": "1m", "tests": [case]}))
    return subprocess.run(["promtool", "test", "rules", "t.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def scraped_series(samples: list[dict[tuple[str, str], float]], target: str, instance: str,
                   minutes: int = 16) -> list[dict[str, str]]:
    """The target's three series as Prometheus would have stored them, one scrape a minute:
    the scraped values in order, the counters then growing at their last observed pace."""
    out = []
    for name in ("deadweight_pager_attempts_total", "deadweight_pager_failures_total",
                 "deadweight_pager_last_success_timestamp_seconds"):
        values = [s[name, target] for s in samples]
        pace = values[-1] - values[-2] if name.endswith("_total") else 0.0
        while len(values) < minutes:
            values.append(values[-1] + pace)
        labels = (f'job="deadweight", instance="{instance}", target="{target}", '
                  'kind="alertmanager"')
        out.append({"series": f"{name}{{{labels}}}", "values": " ".join(f"{v:g}"
                                                                         for v in values)})
    return out


def test_an_unreachable_pager_is_visible_and_alerts(tmp_path: Path) -> None:
    dead_port = free_port()  # nothing listens there
    target = f"alertmanager 127.0.0.1:{dead_port}"
    counted_failed = ('deadweight_actions_total{action="page",detector="frozen_weights",'
                      'result="failed",run_id="run-pager-down",trainer="SFTTrainer"}')
    log = tmp_path / "sidecar.log"
    with SidecarProcess(tmp_path / "sc", extra_args=[
            "--alertmanager-url", f"http://127.0.0.1:{dead_port}"], log_path=log) as sidecar:
        client = frozen_run(sidecar, "run-pager-down", tmp_path / "client.log")
        try:
            first = pager_samples(sidecar.metrics())
            # After the retry budget the journal says what happened, not "queued".
            wait_for(lambda: page_results(sidecar, "run-pager-down") == ["failed"], 30,
                     what="the page journaled as failed")
            wait_for(lambda: pager_samples(sidecar.metrics())[
                "deadweight_pager_failures_total", target] >
                first.get(("deadweight_pager_failures_total", target), 0) + 1, 30,
                what="failures counted on /metrics")
            second = pager_samples(sidecar.metrics())
            # The pager's thread journals the page's result, then counts it: the row can
            # read "failed" before /metrics does.
            wait_for(lambda: counted_failed in sidecar.metrics(), 30,
                     what="the failed page counted on /metrics")
            metrics = sidecar.metrics()
        finally:
            stop_all(client)
    assert second["deadweight_pager_last_success_timestamp_seconds", target] == 0
    assert (second["deadweight_pager_attempts_total", target]
            >= second["deadweight_pager_failures_total", target] >= 4)
    assert f"{counted_failed} 1.0" in metrics
    # The failure is a JSON line naming the target and the error.
    lines = [json.loads(line) for line in log.read_text().splitlines()
             if line.startswith("{") and "alertmanager_push_failed" in line]
    assert lines and lines[0]["target"] == target and "refused" in lines[0]["error"].lower()
    assert not [line for line in log.read_text().splitlines() if "push failed:" in line]

    # The shipped rule fires on exactly what was exported (names, labels, values).
    instance = f"127.0.0.1:{sidecar.metrics_port}"
    series = scraped_series([{k: 0.0 for k in second}, first, second], target, instance)
    notes = {"summary": f"The deadweight sidecar cannot deliver pages to {target}",
             "description": rules.pager_failing_description(instance, target, "10m 0s"),
             "runbook_url": f"http://127.0.0.1:9464/runbooks/{rules.PAGER_FAILING.runbook}"}
    fired = promtool(tmp_path, series, [{
        "exp_labels": {"severity": "critical", "instance": instance, "target": target,
                       "kind": "alertmanager"}, "exp_annotations": notes}])
    assert fired.returncode == 0, fired.stdout + fired.stderr


def test_a_pager_that_answers_is_journaled_delivered_and_stays_silent(
        tmp_path: Path, answering_pager: str) -> None:
    port = answering_pager.rsplit(":", 1)[1]
    target = f"alertmanager 127.0.0.1:{port}"
    with SidecarProcess(tmp_path / "sc", extra_args=[
            "--alertmanager-url", answering_pager]) as sidecar:
        client = frozen_run(sidecar, "run-pager-up", tmp_path / "client.log")
        try:
            wait_for(lambda: page_results(sidecar, "run-pager-up") == ["delivered"], 30,
                     what="the page journaled as delivered")
            first = pager_samples(sidecar.metrics())
            second = pager_samples(sidecar.metrics())
        finally:
            stop_all(client)
    assert second["deadweight_pager_failures_total", target] == 0
    assert second["deadweight_pager_attempts_total", target] >= 1
    assert second["deadweight_pager_last_success_timestamp_seconds", target] > 1e9
    instance = f"127.0.0.1:{sidecar.metrics_port}"
    # As stored, the last success moves with the clock of the promtool case (0 is its epoch).
    series = scraped_series([first, second], target, instance)
    series[2]["values"] = " ".join(str(60 * i) for i in range(16))
    silent = promtool(tmp_path, series, [], eval_time="12m")
    assert silent.returncode == 0, silent.stdout + silent.stderr
