"""Silencing a run's root cause keeps its symptoms quiet too, with the real programs.

A real Prometheus (the shipped rules, scraping every second) and a real Alertmanager (the
shipped example config: causes inhibit their symptoms) on 127.0.0.1; the sidecar pushes to
Alertmanager (through a recorder) and posts to a webhook (``--webhook-url``). Two frozen SFT
runs (``PeftModel.from_pretrained`` with is_trainable left False): on one, on-call silenced
its root cause alone (``deadweight silence`` of ``empty_optimizer``) before it started. A
silenced cause keeps inhibiting its symptoms while it fires, down the causal graph
(``frozen_weights``, then the unchanged checkpoint), so that run pages nothing on any path:
no alert in Prometheus, no push, nothing in Alertmanager, no webhook message, and the
sidecar journals each symptom's page as held by the cause. The other run (the control) pages
its cause and Alertmanager inhibits its symptoms. When the silence ends the cause pages, and
the symptoms are inhibited as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from alerts import rules
from deadweight.callbacks import DeadweightCallback
from deadweight.demo import runs
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.detectors import root_causes_of
from deadweight.sidecar.store.journal import Store
from tests.e2e.test_e2e_oncall import (
    _alertmanager_config,
    _prometheus_config,
    _Recorder,
    _rules_evaluated_after,
)
from tests.support.realprocs import (
    Alertmanager,
    Prometheus,
    start_alertmanager,
    start_prometheus,
    wait_for,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SILENCED = "cause-silenced"
CONTROL = "cause-paged"
#: The one detector on-call silences: the root of the frozen run's chain.
CAUSE = "empty_optimizer"


@dataclass
class Stack:
    prometheus: Prometheus
    alertmanager: Alertmanager
    sidecar: SidecarProcess
    notifications: _Recorder  # Alertmanager's receivers (pager, ticket)
    pushes: _Recorder  # what the sidecar pushed, forwarded to Alertmanager
    webhook: _Recorder  # the sidecar's --webhook-url
    state: Path

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deadweight.cli", *argv, "--address", self.sidecar.address],
            capture_output=True, text=True, timeout=60, cwd="/",
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def firing_notified(self, run_id: str) -> set[str]:
        """Detectors Alertmanager notified as firing for the run."""
        return {a["labels"]["detector"] for n in self.notifications.bodies()
                for a in n["alerts"]
                if a["labels"].get("run_id") == run_id and a["status"] == "firing"}

    def pushed(self, run_id: str) -> list[dict[str, Any]]:
        return [a for body in self.pushes.bodies("/api/v2/alerts") for a in body
                if a["labels"].get("run_id") == run_id]

    def messages(self, run_id: str) -> list[dict[str, Any]]:
        return [b for b in self.webhook.bodies() if b.get("run_id") == run_id]

    def in_alertmanager(self, run_id: str) -> dict[str, dict[str, Any]]:
        """detector -> the alert's status (state, inhibitedBy) in Alertmanager."""
        return {a["labels"]["detector"]: a["status"]
                for a in self.alertmanager.alerts(run_id=run_id)}


@pytest.fixture()
def stack(tmp_path: Path) -> Iterator[Stack]:
    notifications = _Recorder()
    am = start_alertmanager(tmp_path / "am", _alertmanager_config(notifications.url))
    pushes = _Recorder(forward_to=am.url)
    webhook = _Recorder()
    sidecar = SidecarProcess(tmp_path / "sidecar")
    state = tmp_path / "state"
    sidecar.extra_args = ["--alertmanager-url", pushes.url, "--webhook-url",
                          f"{webhook.url}/hook", "--state-dir", str(state)]
    sidecar.start()
    rule_text = (ROOT / "alerts" / rules.RULES_FILE).read_text()  # the shipped rules
    prom = start_prometheus(tmp_path / "prom",
                            _prometheus_config(sidecar.metrics_port, am.url),
                            {rules.RULES_FILE: rule_text})
    try:
        wait_for(prom.targets_up, 30, what="Prometheus scraping the sidecar")
        yield Stack(prom, am, sidecar, notifications, pushes, webhook, state)
    finally:
        prom.stop()
        sidecar.stop()
        am.stop()
        for recorder in (notifications, pushes, webhook):
            recorder.close()


def _train_frozen(stack: Stack, tiny: tuple[Path, Path], out: Path, run_id: str) -> None:
    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    callback = DeadweightCallback(address=stack.sidecar.address, run_id=run_id)
    runs.sft_trainer(model, model_dir, out / run_id, [callback], steps=8,
                     save_steps=2).train()


def _firing(stack: Stack, run_id: str) -> set[str]:
    run = stack.sidecar.run_status(run_id)
    return {f.detector for f in run.findings if f.firing} if run is not None else set()


def test_a_silenced_root_cause_keeps_its_symptoms_quiet(
        stack: Stack, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    # On-call knows this run's optimizer is empty: quiet for a while.
    answer = stack.cli("silence", SILENCED, CAUSE, "--for", "10m", "--reason", "known")
    assert answer.returncode == 0, answer.stderr
    _train_frozen(stack, tiny, tmp_path, SILENCED)
    _train_frozen(stack, tiny, tmp_path, CONTROL)

    firing = wait_for(lambda: _firing(stack, SILENCED) >= {CAUSE, "frozen_weights"}
                      and _firing(stack, SILENCED), 30, what="the silenced run's verdicts")
    symptoms = {d for d in firing if CAUSE in root_causes_of(d)}
    assert "frozen_weights" in symptoms, f"frozen_weights is no symptom of {CAUSE}: {firing}"

    # The control run: its causes page, its symptoms are inhibited by them in Alertmanager.
    wait_for(lambda: CAUSE in stack.firing_notified(CONTROL), 60,
             what="the control run's cause paged")
    wait_for(lambda: all(
        stack.in_alertmanager(CONTROL).get(s, {}).get("inhibitedBy") for s in symptoms),
        60, what="the control run's symptoms inhibited in Alertmanager")
    assert not stack.firing_notified(CONTROL) & symptoms
    # The sidecar's webhook has a delivery thread of its own: nothing orders its message
    # before Alertmanager's notification.
    wait_for(lambda: CAUSE in {m["detector"] for m in stack.messages(CONTROL)}, 30,
             what="the control run's cause at the sidecar's webhook")

    # The silenced run: Prometheus scraped its symptoms firing and evaluated every rule
    # since, and no alert of the run ever existed there ...
    for symptom in symptoms:
        selector = f'deadweight_detector_firing{{run_id="{SILENCED}",detector="{symptom}"}}'
        scraped = wait_for(lambda s=selector: stack.prometheus.query(f"timestamp({s} == 1)"),
                           30, what=f"{symptom} of {SILENCED} scraped firing")
        at = float(scraped[0]["value"][1])
        wait_for(lambda t=at: _rules_evaluated_after(stack.prometheus, t), 30,
                 what="the rules evaluated after the scrape")
    assert stack.prometheus.query(f'ALERTS{{run_id="{SILENCED}"}}[10m]') == []
    # ... the sidecar held every page back (journaled, the symptoms' by their cause) ...
    journal = Store(stack.state)
    for detector in symptoms | {CAUSE}:
        held = [a for a in journal.actions(SILENCED, detector) if a.action == "page"]
        assert [a.result for a in held] == ["silenced"], (detector, held)
        if detector in symptoms:
            assert held[0].detail.get("by") == CAUSE
    assert stack.pushed(SILENCED) == []
    assert stack.messages(SILENCED) == []
    # ... so Alertmanager never heard of it, and nobody was notified.
    assert stack.in_alertmanager(SILENCED) == {}
    assert stack.firing_notified(SILENCED) == set()

    # The silence ends: the causes page now; their symptoms are inhibited by them as before.
    answer = stack.cli("silence", SILENCED, CAUSE, "--for", "1s")
    assert answer.returncode == 0, answer.stderr
    wait_for(lambda: CAUSE in stack.firing_notified(SILENCED), 60,
             what="the cause paged once the silence ended")
    wait_for(lambda: all(
        stack.in_alertmanager(SILENCED).get(s, {}).get("inhibitedBy") for s in symptoms),
        60, what="the symptoms inhibited by their causes again")
    assert not stack.firing_notified(SILENCED) & symptoms
