"""The on-call path end to end, with the real programs on 127.0.0.1.

A real GRPO run trains a LoRA adapter loaded with ``PeftModel.from_pretrained`` (is_trainable
left False) and reports to a real ``deadweight serve --alertmanager-url``. A real Prometheus
scrapes the sidecar every second with the shipped rules and sends to a real Alertmanager that
runs the shipped example config, routed to a webhook receiver inside this test. The sidecar's
own pushes go through a recording pass-through so the test can show that both paths delivered.

Shown: both paths send frozen_weights with the same labels and links; on-call is paged by
its root cause, ``empty_optimizer`` (the causal graph: ``frozen_weights`` and
``grad_not_in_optimizer`` are its symptoms, inhibited), with run_id, evidence, a runbook_url
that opens (the sidecar serves it) and the run's dashboard_url, once, though both paths sent
it; it stays firing after the run ended and resolves when the sidecar forgets
the ended run (``--run-ttl-seconds``), never at the end itself; a healthy run pages nothing;
every PromQL expression in alerts/ and dashboards/ runs against this Prometheus and returns
data.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts import rules
from alerts.rules import Patterns
from deadweight.callbacks import DeadweightCallback
from deadweight.demo import runs
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.actions.links import dashboard_url, runbook_url
from deadweight.sidecar.detectors import BY_ID
from tests.support import promql
from tests.support.realprocs import (
    Alertmanager,
    Prometheus,
    start_alertmanager,
    start_prometheus,
    wait_for,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: How long the sidecar keeps an ended run here (15 minutes by default).
RUN_TTL_SECONDS = 15
FROZEN_RUN = "oncall-frozen"
HEALTHY_RUN = "oncall-healthy"
LABELS = {"alertname", "run_id", "detector", "severity"}
# Alerts whose whole expression must return data while the frozen run is held at step 6.
FIRING_WHILE_HELD = {"frozen_weights", "empty_optimizer"}
#: The page on-call gets for the frozen run: the root cause (its symptoms are inhibited).
PAGED = "empty_optimizer"


class _Recorder(http.server.ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 that keeps every JSON body it was POSTed, in order."""

    def __init__(self, forward_to: str | None = None) -> None:
        self.posts: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.forward_to = forward_to
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def bodies(self, path: str | None = None) -> list[Any]:
        with self.lock:
            return [body for p, body in self.posts if path is None or p == path]

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=5)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Recorder

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.server.lock:
            self.server.posts.append((self.path, json.loads(raw)))
        status, answer = 200, b""
        if self.server.forward_to is not None:
            request = urllib.request.Request(
                self.server.forward_to + self.path, data=raw, method="POST",
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                status, answer = response.status, response.read()
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)  # Alertmanager's answer (a silence's id), relayed

    def do_DELETE(self) -> None:
        """A mute the sidecar ends (an Alertmanager silence), relayed."""
        status = 200
        if self.server.forward_to is not None:
            request = urllib.request.Request(self.server.forward_to + self.path,
                                             method="DELETE")
            with urllib.request.urlopen(request, timeout=5) as response:
                status = response.status
        self.send_response(status)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _alertmanager_config(webhook: str) -> str:
    """The shipped example with the test's webhook and notification timings of seconds."""
    config = yaml.safe_load((ROOT / "alerts" / rules.ALERTMANAGER_FILE).read_text())
    config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook}/{receiver['name']}"
    return str(yaml.safe_dump(config))


def _prometheus_config(sidecar_port: int, alertmanager: str) -> str:
    return f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [{rules.RULES_FILE}]
alerting:
  alertmanagers:
    - static_configs: [{{targets: ["{alertmanager.removeprefix('http://')}"]}}]
scrape_configs:
  - job_name: deadweight
    static_configs: [{{targets: ["127.0.0.1:{sidecar_port}"]}}]
"""


@dataclass
class Stack:
    prometheus: Prometheus
    alertmanager: Alertmanager
    sidecar: SidecarProcess
    webhook: _Recorder
    sidecar_pushes: _Recorder  # what the sidecar sent, forwarded to Alertmanager
    prometheus_pushes: _Recorder  # what Prometheus sent, forwarded to Alertmanager
    patterns: Patterns  # the links both paths were configured with
    live_query_failures: list[str] | None = None  # filled while the frozen run is held

    def pages(self, run_id: str) -> list[dict[str, Any]]:
        """Webhook notifications (any receiver) that mention run_id, in arrival order."""
        return [b for b in self.webhook.bodies()
                if b.get("groupLabels", {}).get("run_id") == run_id]

    def prometheus_alerts(self, run_id: str) -> list[dict[str, Any]]:
        return [a for a in self.prometheus.alerts() if a["labels"].get("run_id") == run_id]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("oncall")
    webhook = _Recorder()
    am = start_alertmanager(work / "am", _alertmanager_config(webhook.url))
    proxy = _Recorder(forward_to=am.url)
    prom_proxy = _Recorder(forward_to=am.url)
    sidecar = SidecarProcess(work / "sidecar")
    # Runbook links point at this sidecar's own /runbooks/, on both paths.
    patterns = Patterns(f"http://127.0.0.1:{sidecar.metrics_port}/runbooks/{{detector}}",
                        "http://127.0.0.1:3000/d/deadweight-run/run?var-run_id={run_id}")
    sidecar.extra_args = ["--alertmanager-url", proxy.url,
                          "--run-ttl-seconds", str(RUN_TTL_SECONDS),
                          "--runbook-url-pattern", patterns.runbook,
                          "--dashboard-url-pattern", patterns.dashboard]
    sidecar.start()
    # On-call silenced one detector of another run (deadweight silence): the rules' silence
    # clause then meets a live series, as every shipped query must.
    silenced = subprocess.run(
        [sys.executable, "-m", "deadweight.cli", "silence", "run-on-hold", "entropy_collapse",
         "--for", "1h", "--address", sidecar.address], capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert silenced.returncode == 0, silenced.stderr
    rule_text = rules.render(rules.DEFAULT_JOB_SELECTOR, rules.DEFAULT_STALE_SECONDS,
                             patterns)[rules.RULES_FILE]
    config = _prometheus_config(sidecar.metrics_port, prom_proxy.url)
    prom = start_prometheus(work / "prom", config, {rules.RULES_FILE: rule_text})
    try:
        wait_for(prom.targets_up, 30, what="Prometheus scraping the sidecar")
        yield Stack(prom, am, sidecar, webhook, proxy, prom_proxy, patterns)
    finally:
        prom.stop()
        sidecar.stop()
        am.stop()
        proxy.close()
        prom_proxy.close()
        webhook.close()


def _gate(at_step: int, condition: Callable[[], object], what: str) -> Any:
    """A TrainerCallback that holds the run at one step until `condition()` holds.

    The run stays alive (and so does its series on /metrics) while the outside world catches
    up: Prometheus scrapes, evaluates and sends; Alertmanager groups and notifies.
    """
    from transformers import TrainerCallback

    def on_step_end(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == at_step:
            wait_for(condition, 40, interval=0.1, what=what)

    return type("Gate", (TrainerCallback,), {"on_step_end": on_step_end})()


def _status(notification: dict[str, Any], detector: str) -> list[str]:
    return [a["status"] for a in notification["alerts"] if a["labels"]["detector"] == detector]


def test_frozen_run_pages_once_with_evidence_and_resolves(
    stack: Stack, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, adapter_dir = tiny

    def paged_by_both_paths() -> bool:
        from_sidecar = _sent(stack.sidecar_pushes, "frozen_weights")
        from_prometheus = _sent(stack.prometheus_pushes, "frozen_weights")
        notified = any("firing" in _status(n, PAGED) for n in stack.pages(FROZEN_RUN))
        return bool(from_sidecar) and bool(from_prometheus) and notified

    deadline: list[float] = []

    def queries_checked() -> bool:
        # Rates need two scrapes of a fresh series: poll until every query has data, for at
        # most 20 s; test_every_shipped_query_... reports what still had none.
        if not deadline:
            deadline.append(time.monotonic() + 20)
        stack.live_query_failures = _queries_without_data(stack.prometheus)
        return not stack.live_query_failures or time.monotonic() > deadline[0]

    gate = _gate(5, paged_by_both_paths, "the page through both paths")
    check = _gate(6, queries_checked, "the shipped queries to return data")
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    callback = DeadweightCallback(address=stack.sidecar.address, run_id=FROZEN_RUN)
    trainer = runs.grpo_trainer(model, model_dir, tmp_path, [callback, gate, check], steps=8,
                                save_steps=2)
    trainer.train()

    # Both paths sent the alert with exactly the same label set and the same links ...
    from_sidecar = _sent(stack.sidecar_pushes, "frozen_weights")
    from_prometheus = _sent(stack.prometheus_pushes, "frozen_weights")
    assert set(from_sidecar[0]["labels"]) == LABELS
    assert from_prometheus[0]["labels"] == from_sidecar[0]["labels"]
    pushed, ruled = from_sidecar[0]["annotations"], from_prometheus[0]["annotations"]
    assert set(pushed) == set(ruled) == {"summary", "description", "runbook_url",
                                         "dashboard_url"}
    for key in ("summary", "runbook_url", "dashboard_url"):
        assert pushed[key] == ruled[key], key
    assert from_sidecar[0]["generatorURL"] == pushed["dashboard_url"]
    # ... it stays firing after the run ended (the adapter it wrote is bad) ...
    wait_for(lambda: getattr(stack.sidecar.run_status(FROZEN_RUN), "ended", False), 30,
             what="the sidecar to end the run")
    assert [a for a in stack.alertmanager.alerts(run_id=FROZEN_RUN)
            if a["labels"]["detector"] == PAGED]
    assert not any("resolved" in _status(n, PAGED) for n in stack.pages(FROZEN_RUN))
    # ... and resolves once the sidecar forgot the ended run: a resolved notification.
    wait_for(lambda: any("resolved" in _status(n, PAGED)
                         for n in stack.pages(FROZEN_RUN)), RUN_TTL_SECONDS + 45,
             what="the resolved page")
    wait_for(lambda: not [a for a in stack.alertmanager.alerts(run_id=FROZEN_RUN)
                          if a["labels"]["detector"] == PAGED], 30,
             what="Alertmanager to drop the alert")

    pages = [n for n in stack.pages(FROZEN_RUN) if n["receiver"] == "pager"]
    assert pages, "no page on the pager receiver"
    # Once: each notification lists the alert at most once, and it turns firing only once.
    transitions = 0
    previous = "none"
    for notification in pages:
        states = _status(notification, PAGED)
        assert len(states) <= 1, "two copies of one alert: the two paths did not merge"
        state = states[0] if states else "none"
        if state == "firing" and previous != "firing":
            transitions += 1
        previous = state
    assert transitions == 1
    assert previous == "resolved"

    first = next(n for n in pages if "firing" in _status(n, PAGED))
    [alert] = [a for a in first["alerts"] if a["labels"]["detector"] == PAGED]
    assert alert["labels"] == {"alertname": "DeadweightEmptyOptimizer", "run_id": FROZEN_RUN,
                               "detector": PAGED, "severity": "critical"}
    notes = alert["annotations"]
    assert notes["runbook_url"] == runbook_url(stack.patterns.runbook, PAGED)
    assert notes["dashboard_url"] == dashboard_url(stack.patterns.dashboard, FROZEN_RUN)
    # The delivered link opens: the sidecar renders the runbook.
    with urllib.request.urlopen(notes["runbook_url"], timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/html")
        assert "<h1>DeadweightEmptyOptimizer</h1>" in response.read().decode()
    assert FROZEN_RUN in notes["summary"] + notes["description"]
    assert "optimizer_params=0" in notes["description"], notes["description"]
    assert "trainable_params=0" in notes["description"]
    # Its symptoms are inhibited by the root cause: no page for them in this run.
    assert all(a["labels"]["detector"] not in ("grad_not_in_optimizer", "frozen_weights")
               for n in pages for a in n["alerts"] if a["status"] == "firing")


def _sent(recorder: _Recorder, detector: str, run_id: str = FROZEN_RUN) -> list[dict[str, Any]]:
    """Alerts for (run_id, detector) that one path posted to Alertmanager, in order."""
    return [a for body in recorder.bodies() for a in body
            if a["labels"].get("detector") == detector and a["labels"].get("run_id") == run_id]


def test_healthy_run_pages_nothing(
    stack: Stack, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny

    def evaluated_while_live() -> bool:
        # Prometheus scraped this run, active, at step >= 3, and evaluated every rule after.
        selector = f'deadweight_step{{run_id="{HEALTHY_RUN}"}}'
        if not stack.prometheus.query(f"{selector} >= 3"):
            return False
        # timestamp() of a plain selector is the scrape time of the sample.
        scraped = stack.prometheus.query(f"timestamp({selector})")
        return bool(scraped) and _rules_evaluated_after(stack.prometheus,
                                                        float(scraped[0]["value"][1]))

    gate = _gate(4, evaluated_while_live, "Prometheus evaluating the healthy run")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    callback = DeadweightCallback(address=stack.sidecar.address, run_id=HEALTHY_RUN)
    trainer = runs.grpo_trainer(model, model_dir, tmp_path, [callback, gate], steps=6,
                                warmup=2, peft_config=runs.lora_config(),
                                reward_funcs=_spread_reward,
                                **runs.terminating(model_dir))  # a healthy policy ends answers
    trainer.train()

    # Not a single pending or firing sample for this run in Prometheus' ALERTS series, no
    # push from the sidecar, nothing in Alertmanager, no notification.
    assert stack.prometheus.query(f'ALERTS{{run_id="{HEALTHY_RUN}"}}[10m]') == []
    assert stack.prometheus.query(f'ALERTS{{run_id="{FROZEN_RUN}"}}[10m]') != []
    assert stack.alertmanager.alerts(run_id=HEALTHY_RUN) == []
    assert stack.pages(HEALTHY_RUN) == []
    for recorder in (stack.sidecar_pushes, stack.prometheus_pushes):
        assert not [a for body in recorder.bodies() for a in body
                    if a["labels"].get("run_id") == HEALTHY_RUN]


def _spread_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that always differs within a group of two, so GRPO always has a signal.

    (A length-based reward on a tiny model can give both completions the same score for
    several steps in a row: that is zero reward variance for real, not a healthy run.)
    """
    return [float(i % 2) + len(str(c)) / 100.0 for i, c in enumerate(completions)]


def _rules_evaluated_after(prom: Prometheus, ts: float) -> bool:
    from datetime import datetime

    for rule in promql.http_rules(prom.url):
        stamp = str(rule["lastEvaluation"])
        # RFC 3339 with nanoseconds: keep microseconds for fromisoformat.
        head, _, frac = stamp.partition(".")
        frac = frac.rstrip("Z")[:6] if frac else "0"
        when = datetime.fromisoformat(f"{head}.{frac}+00:00").timestamp()
        if when < ts:
            return False
    return True


def test_every_shipped_query_returns_data_from_the_live_stack(stack: Stack) -> None:
    """Checked while the frozen run was held live at step 6 (firing, with checkpoints)."""
    assert stack.live_query_failures is not None, "the frozen run never reached the check"
    assert not stack.live_query_failures, (
        "queries without data:\n" + "\n".join(stack.live_query_failures))


#: Metrics a CPU run cannot have: TRL logs sampling/* only when vLLM generates (a GPU).
#: tests/e2e/test_dashboards.py runs their queries against an exposition that has them.
ONLY_WITH_VLLM = ("deadweight_sampling_logp_difference",)


def _queries_without_data(prom: Prometheus) -> list[str]:
    """Run every rule, evidence and dashboard query; list those that return nothing."""
    implemented = set(BY_ID)
    missing: list[str] = []
    for where, expr in promql.rule_expressions():
        result = prom.query(expr)  # raises on a PromQL error
        if _detector_matcher(expr) in FIRING_WHILE_HELD and not result:
            missing.append(f"{where} (firing now): {expr}")
        for sel in promql.selectors(expr):
            sel_detector = _detector_matcher(sel)
            if sel_detector is not None and sel_detector not in implemented:
                continue  # the sidecar does not export this detector yet
            if not prom.query(sel):
                missing.append(f"{where}: {sel}")
    for where, expr in promql.evidence_queries(FROZEN_RUN):
        if any(metric in expr for metric in ONLY_WITH_VLLM):
            continue
        if not prom.query(expr):
            missing.append(f"{where} evidence: {expr}")
    for where, expr in promql.dashboard_queries(FROZEN_RUN):
        if not prom.query(expr):
            missing.append(f"{where}: {expr}")
        missing += [f"{where}: {sel}" for sel in promql.selectors(expr) if not prom.query(sel)]
    return missing


def _detector_matcher(selector: str) -> str | None:
    marker = 'detector="'
    if marker not in selector:
        return None
    return selector.split(marker, 1)[1].split('"', 1)[0]
