"""A run that ends with a critical verdict pages once, however short it was.

Real programs on 127.0.0.1: ``deadweight serve`` (with ``--alertmanager-url``, a state dir and
a short ``--run-ttl-seconds``), a real Prometheus scraping it and evaluating the shipped rules
every second, a real Alertmanager on the shipped example config, and a webhook receiver for
the pager. Alertmanager runs the shipped routes and timings untouched (only the webhook
URLs change): its 30 s ``group_wait`` is longer than these few-second runs, so the verdict must
outlive the run to page at all (a run's end used to resolve it inside group_wait, and the
rules needed ``run_active == 1``: nothing paged). Prometheus scrapes and evaluates every
second, the sidecar forgets ended runs after a minute (15 minutes by default).

Shown: the frozen run pages exactly once (both paths sent the alert, Alertmanager merged them),
its runbook link answers 200; after the run ended, status, the run summary's source and the
report read "firing at end", root cause first; the page resolves when the run expires from
the sidecar, never at its end. A healthy 5-second control sends no alert on either path.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
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
from deadweight.sidecar.commands import report
from deadweight.sidecar.store.journal import Store
from tests.e2e.test_e2e_oncall import _prometheus_config, _Recorder, _spread_reward, _status
from tests.support.realprocs import (
    Alertmanager,
    Prometheus,
    start_alertmanager,
    start_prometheus,
    wait_for,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FROZEN_RUN = "short-frozen"
HEALTHY_RUN = "short-healthy"
#: How long the sidecar keeps an ended run (15 minutes by default): longer than the shipped
#: group_wait (30 s) after the run's first alert, so the page goes out before it resolves.
RUN_TTL_SECONDS = 60
STEPS = 20  # 0.1-0.3 s a step on a shared CPU: a run of a few seconds
ROOT_CAUSE_ORDER = ["empty_optimizer", "frozen_weights", "checkpoint_unchanged"]


@dataclass
class Stack:
    prometheus: Prometheus
    alertmanager: Alertmanager
    sidecar: SidecarProcess
    state_dir: Path
    webhook: _Recorder
    sidecar_pushes: _Recorder
    prometheus_pushes: _Recorder
    patterns: Patterns

    def pages(self, run_id: str) -> list[dict[str, Any]]:
        """Notifications to the pager receiver for run_id, in arrival order."""
        return [b for b in self.webhook.bodies("/pager")
                if b.get("groupLabels", {}).get("run_id") == run_id]

    def pushed(self, run_id: str) -> list[dict[str, Any]]:
        """Alerts for run_id that either path posted to Alertmanager."""
        return [a for recorder in (self.sidecar_pushes, self.prometheus_pushes)
                for body in recorder.bodies() for a in body
                if a["labels"].get("run_id") == run_id]


def _alertmanager_config(webhook: str) -> str:
    """The shipped example, timings included, with the test's webhook."""
    config = yaml.safe_load((ROOT / "alerts" / rules.ALERTMANAGER_FILE).read_text())
    assert config["route"]["group_wait"] == "30s"
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook}/{receiver['name']}"
    return str(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("short")
    webhook = _Recorder()
    am = start_alertmanager(work / "am", _alertmanager_config(webhook.url))
    proxy = _Recorder(forward_to=am.url)
    prom_proxy = _Recorder(forward_to=am.url)
    sidecar = SidecarProcess(work / "sidecar")
    state_dir = work / "state"
    patterns = Patterns(f"http://127.0.0.1:{sidecar.metrics_port}/runbooks/{{detector}}",
                        "http://127.0.0.1:3000/d/deadweight-run/run?var-run_id={run_id}")
    sidecar.extra_args = ["--alertmanager-url", proxy.url, "--state-dir", str(state_dir),
                          "--run-ttl-seconds", str(RUN_TTL_SECONDS),
                          "--runbook-url-pattern", patterns.runbook,
                          "--dashboard-url-pattern", patterns.dashboard]
    sidecar.start()
    rule_text = rules.render(rules.DEFAULT_JOB_SELECTOR, rules.DEFAULT_STALE_SECONDS,
                             patterns)[rules.RULES_FILE]
    prom = start_prometheus(work / "prom", _prometheus_config(sidecar.metrics_port,
                                                              prom_proxy.url),
                            {rules.RULES_FILE: rule_text})
    try:
        wait_for(prom.targets_up, 30, what="Prometheus scraping the sidecar")
        yield Stack(prom, am, sidecar, state_dir, webhook, proxy, prom_proxy, patterns)
    finally:
        prom.stop()
        sidecar.stop()
        am.stop()
        for recorder in (proxy, prom_proxy, webhook):
            recorder.close()


def _evaluated_after_the_end(prom: Prometheus, run_id: str) -> bool:
    """Prometheus scraped the run as ended and evaluated every rule after that scrape."""
    from tests.e2e.test_e2e_oncall import _rules_evaluated_after

    selector = f'deadweight_run_active{{run_id="{run_id}"}}'
    active = prom.query(selector)
    if not active or float(active[0]["value"][1]) != 0.0:
        return False
    scraped = prom.query(f"timestamp({selector})")  # of a plain selector: the scrape time
    return bool(scraped) and _rules_evaluated_after(prom, float(scraped[0]["value"][1]))


def test_healthy_short_run_sends_no_alert(stack: Stack, tiny: tuple[Path, Path],
                                          tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    callback = DeadweightCallback(address=stack.sidecar.address, run_id=HEALTHY_RUN)
    trainer = runs.grpo_trainer(model, model_dir, tmp_path, [callback], steps=STEPS, warmup=2,
                                save_steps=1000, peft_config=runs.lora_config(),
                                reward_funcs=_spread_reward, **runs.terminating(model_dir))
    started = time.monotonic()
    trainer.train()
    print(f"healthy run trained for {time.monotonic() - started:.1f} s")
    wait_for(lambda: _evaluated_after_the_end(stack.prometheus, HEALTHY_RUN), 30,
             what="Prometheus to evaluate the rules on the ended healthy run")
    run = stack.sidecar.run_status(HEALTHY_RUN)
    assert run is not None and run.ended
    assert [f.detector for f in run.findings if f.severity == "critical"] == []
    # No alert on either path (so Alertmanager has nothing that could page), none in ALERTS.
    assert stack.pushed(HEALTHY_RUN) == []
    assert stack.prometheus.query(f'ALERTS{{run_id="{HEALTHY_RUN}"}}[10m]') == []
    assert stack.alertmanager.alerts(run_id=HEALTHY_RUN) == []


def test_frozen_short_run_pages_once_and_resolves_when_it_expires(
        stack: Stack, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    callback = DeadweightCallback(address=stack.sidecar.address, run_id=FROZEN_RUN)
    trainer = runs.grpo_trainer(model, model_dir, tmp_path, [callback], steps=STEPS,
                                save_steps=STEPS // 2)
    started = time.monotonic()
    trainer.train()
    ended = time.monotonic()
    print(f"frozen run trained for {ended - started:.1f} s")

    # After the end: status reads "firing at end", root cause first, nothing "resolved".
    def ended_with_verdicts() -> Any:
        run = stack.sidecar.run_status(FROZEN_RUN)
        found = {f.detector for f in run.findings} if run is not None else set()
        return run if run is not None and run.ended and set(ROOT_CAUSE_ORDER) <= found else None

    run = wait_for(ended_with_verdicts, 30, what="the ended run with its verdicts")
    states = {f.detector: f.state for f in run.findings}
    assert all(states[d] == "firing at end" for d in ROOT_CAUSE_ORDER), states
    listed = [f.detector for f in run.findings if f.detector in ROOT_CAUSE_ORDER]
    assert listed == ROOT_CAUSE_ORDER
    shown = subprocess.run(
        [sys.executable, "-m", "deadweight.cli", "status", "--address", stack.sidecar.address],
        capture_output=True, text=True, timeout=60, check=True).stdout
    firing_at_end = shown.split("FIRING AT END ", 1)[1].split()[0].split(",")
    assert [d for d in firing_at_end if d in ROOT_CAUSE_ORDER] == ROOT_CAUSE_ORDER, shown
    assert "resolved empty_optimizer" not in shown and "resolved frozen_weights" not in shown
    # What the run summary beside the adapter is built from says the same.
    from deadweight.callbacks import summary_writer as promotion
    from deadweight.callbacks.digest import AdapterDigest

    answer, how = promotion.fetch_verdicts(stack.sidecar.address, FROZEN_RUN, None, None, 5.0)
    summary = promotion.unsigned_summary(FROZEN_RUN, STEPS, AdapterDigest("d", {"t": "d"}),
                                         answer, how)
    assert {v.detector for v in summary.verdicts if v.firing} >= set(ROOT_CAUSE_ORDER)
    assert summary.end_reason == "completed"

    # The rules see the verdict after the end: ALERTS firing while run_active is 0.
    wait_for(lambda: stack.prometheus.query(
        f'ALERTS{{run_id="{FROZEN_RUN}", alertname="DeadweightFrozenWeights", '
        'alertstate="firing"} and on (run_id) max by (run_id) (deadweight_run_active == 0)'),
        30, what="the rule firing on the ended run")

    # Exactly one page, after the run ended, from the alert both paths sent.
    wait_for(lambda: stack.pages(FROZEN_RUN), RUN_TTL_SECONDS, what="the page")
    paged_after = time.monotonic() - ended
    print(f"paged {paged_after:.1f} s after the run ended")
    [page] = stack.pages(FROZEN_RUN)
    firing = {a["labels"]["detector"]: a for a in page["alerts"] if a["status"] == "firing"}
    assert "empty_optimizer" in firing, sorted(firing)
    # Its symptoms (the causal graph: frozen weights, then the unchanged checkpoint) are
    # inhibited by the root cause: one page names the fault and its fix.
    assert not {"frozen_weights", "checkpoint_unchanged"} & set(firing), sorted(firing)
    for path in (stack.sidecar_pushes, stack.prometheus_pushes):
        assert any(a["labels"]["run_id"] == FROZEN_RUN and
                   a["labels"]["detector"] == "frozen_weights"
                   for body in path.bodies() for a in body), "one path did not send it"
    alert = firing["empty_optimizer"]
    assert alert["labels"] == {"alertname": "DeadweightEmptyOptimizer", "run_id": FROZEN_RUN,
                               "detector": "empty_optimizer", "severity": "critical"}
    with urllib.request.urlopen(alert["annotations"]["runbook_url"], timeout=10) as response:
        assert response.status == 200
        assert "<h1>DeadweightEmptyOptimizer</h1>" in response.read().decode()

    # The report reads the same states and order from the journal.
    record = report.load(Store(stack.state_dir), FROZEN_RUN)
    assert [report.incident_state(record, i) for i in report.verdicts_of(record)
            if i.detector in ROOT_CAUSE_ORDER] == ["firing at end"] * 3
    top = report.headline(record)
    sentence = " ".join(i.detector for i in [top.root, *top.others] if i is not None)
    assert sentence.index("empty_optimizer") < sentence.index("frozen_weights") < \
        sentence.index("checkpoint_unchanged"), sentence

    # Resolution: the run expires from the sidecar; both paths resolve; still one page.
    wait_for(lambda: stack.sidecar.run_status(FROZEN_RUN) is None, RUN_TTL_SECONDS + 30,
             what="the sidecar to expire the ended run")
    wait_for(lambda: not stack.alertmanager.alerts(run_id=FROZEN_RUN), 60,
             what="Alertmanager to resolve the run's alerts")
    assert sum("firing" in _status(n, "empty_optimizer") for n in stack.pages(FROZEN_RUN)) == 1
    assert stack.pages(HEALTHY_RUN) == []  # the control's group_wait passed long ago
