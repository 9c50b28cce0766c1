"""The Grafana dashboards: generated from code, valid against the dashboard schema, laid out
without overlaps, loss-only panels beside deadweight panels, and every query in the dashboards
and in the alert rules returns data from a real Prometheus scraping every deadweight metric."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from alerts.rules import MONITORING, SPECS
from dashboards import build
from tests.support import promql
from tests.support.realprocs import (
    Prometheus,
    free_port,
    start_prometheus,
    wait_for,
)

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
SCHEMA = json.loads((DASHBOARDS / "schema" / "dashboard.schema.json").read_text())
BUILTINS = {"__rate_interval", "__interval", "__range"}


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASHBOARDS / name).read_text())
    return data


def _all() -> list[tuple[str, dict[str, Any]]]:
    return [(name, _load(name)) for name in build.DASHBOARDS]


def test_committed_json_equals_a_fresh_build() -> None:
    for name, text in build.render().items():
        assert (DASHBOARDS / name).read_text() == text, (
            f"{name} is stale: run python -m dashboards.build")


def test_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name", sorted(build.DASHBOARDS))
def test_dashboard_validates_against_the_schema(name: str) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(_load(name))


def _through_grafana_model(dashboard: dict[str, Any]) -> Any:
    """The dashboard parsed into the SDK's models (generated from Grafana's own dashboard
    schema) and written back: a field the schema does not know is lost on the way."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    return json.loads(json.dumps(Dashboard.from_json(dashboard), cls=JSONEncoder))


@pytest.mark.parametrize("name", sorted(build.DASHBOARDS))
def test_dashboard_survives_grafanas_own_model_unchanged(name: str) -> None:
    dashboard = _load(name)
    assert _through_grafana_model(dashboard) == dashboard


def test_grafanas_model_drops_a_misspelled_field() -> None:
    broken = _load("deadweight-run.json")
    broken["panels"][1]["titel"] = "typo"
    assert _through_grafana_model(broken) != broken


def test_schema_rejects_broken_dashboards() -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    good = _load("deadweight-run.json")
    breakages: list[Callable[[dict[str, Any]], object]] = [
        lambda d: d["panels"][1].pop("gridPos"),
        lambda d: d["panels"][1]["targets"][0].__setitem__("refId", "a1"),
        lambda d: d["panels"][1]["gridPos"].__setitem__("w", 25),
        lambda d: d.pop("uid"),
        lambda d: d["panels"][1].__setitem__("type", "graph-old"),
        lambda d: d["templating"]["list"][1].pop("query"),
        lambda d: d["panels"][1].__setitem__("titel", "typo"),
    ]
    for breakage in breakages:
        broken = json.loads(json.dumps(good))
        breakage(broken)
        assert not validator.is_valid(broken)


@pytest.mark.parametrize("name", sorted(build.DASHBOARDS))
def test_layout_ids_and_variables(name: str) -> None:
    data = _load(name)
    panels = data["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
    defined = {v["name"] for v in data["templating"]["list"]} | BUILTINS
    text = json.dumps(panels)
    used = set(re.findall(r"\$\{?([a-zA-Z_][a-zA-Z0-9_]*)", text))
    assert used <= defined, used - defined
    for panel in panels:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_run_view_filters_every_query_by_run_and_pairs_loss_with_deadweight() -> None:
    data = _load("deadweight-run.json")
    assert any(v["name"] == "run_id" and v["type"] == "query" for v in data["templating"]["list"])
    by_title = {p["title"]: p for p in data["panels"]}
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            assert 'run_id="$run_id"' in target["expr"], panel["title"]
    # A loss-only view's panel sits on the left of the same row as deadweight's answer.
    for left, right in [("Loss", "Update norm and scale-free ratio"),
                        ("Gradient norm", "Optimizer membership"),
                        ("Reward", "Reward spread")]:
        lpos, rpos = by_title[left]["gridPos"], by_title[right]["gridPos"]
        assert lpos["y"] == rpos["y"] and lpos["x"] == 0 and rpos["x"] == 12
    exprs = " ".join(t["expr"] for p in data["panels"] for t in p.get("targets", []))
    for metric in ["loss", "update_norm", "update_ratio", "optimizer_params",
                   "trainable_params", "grad_not_in_optimizer_params", "kl", "reward_std",
                   "frac_reward_zero_std", "entropy", "completion_mean_length",
                   "checkpoint_info", "checkpoint_adapter_bytes", "checkpoints_total",
                   "checkpoint_unchanged_total", "actions_total", "detector_firing"]:
        assert f"deadweight_{metric}{{" in exprs, metric


def test_fleet_view_shows_runs_verdicts_and_firing_detectors() -> None:
    titles = {p["title"] for p in _load("deadweight-fleet.json")["panels"]}
    assert {"Runs", "Firing detectors", "Active runs", "Actions taken"} <= titles


def test_provisioning_files() -> None:
    prov = DASHBOARDS / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "deadweight.yml").read_text())
    [source] = ds["datasources"]
    assert ds["apiVersion"] == 1 and source["type"] == "prometheus" and source["url"]
    boards = yaml.safe_load((prov / "dashboards" / "deadweight.yml").read_text())
    [provider] = boards["providers"]
    assert boards["apiVersion"] == 1 and provider["type"] == "file"
    assert provider["options"]["path"]


# -- every query against a live Prometheus ---------------------------------------------------

RUN = "run-live"


class _FailingPager:
    """A pager target that fails at every scrape and last delivered an hour ago: what
    ``DeadweightPagerFailing`` watches (its ``increase`` needs a counter that moves)."""

    def __init__(self) -> None:
        self.failures = 0

    def collect(self) -> Iterator[Metric]:
        self.failures += 1
        labels = ["target", "kind"]
        failures = CounterMetricFamily("deadweight_pager_failures", "f", labels=labels)
        failures.add_metric(["alertmanager:127.0.0.1:9093", "alertmanager"], self.failures)
        attempts = CounterMetricFamily("deadweight_pager_attempts", "a", labels=labels)
        attempts.add_metric(["alertmanager:127.0.0.1:9093", "alertmanager"], self.failures)
        success = GaugeMetricFamily("deadweight_pager_last_success_timestamp_seconds", "s",
                                    labels=labels)
        success.add_metric(["alertmanager:127.0.0.1:9093", "alertmanager"], time.time() - 3600)
        yield from (failures, attempts, success)


def _exporter_registry() -> CollectorRegistry:
    """Every metric of the contract, for one run, with the sidecar's label names."""
    reg = CollectorRegistry()
    run = ["run_id", "trainer"]
    ranked = [*run, "rank"]
    now = time.time()
    values = {"step": 40, "update_norm": 0.0, "update_ratio": 0.0, "frozen_steps": 12,
              "optimizer_params": 0, "trainable_params": 8, "grad_not_in_optimizer_params": 8,
              "loss": 1.25, "grad_norm": 0.41, "learning_rate": 2e-4, "kl": 0.0, "reward": 0.5,
              "reward_std": 0.2, "frac_reward_zero_std": 1.0, "entropy": 1.9,
              "completion_mean_length": 12.0, "checkpoint_adapter_bytes": 41280.0,
              "sampling_logp_difference": 0.2}
    for name, value in values.items():
        g = Gauge(f"deadweight_{name}", name, ranked, registry=reg)
        g.labels(RUN, "GRPOTrainer", "0").set(value)
    Gauge("deadweight_last_step_timestamp_seconds", "t", ranked, registry=reg).labels(
        RUN, "GRPOTrainer", "0").set(now - 3600)
    Gauge("deadweight_run_active", "a", run, registry=reg).labels(RUN, "GRPOTrainer").set(1)
    # Two ranks an hour after the last move: rank 1 behind rank 0 (DeadweightRankStopped).
    progress = Gauge("deadweight_rank_progress_steps", "p", ranked, registry=reg)
    phases = Gauge("deadweight_rank_phase_timestamp_seconds", "t", [*ranked, "phase"],
                   registry=reg)
    for rank, at, phase in (("0", 39.75, "backward_done"), ("1", 39.0, "optimizer_step")):
        progress.labels(RUN, "GRPOTrainer", rank).set(at)
        phases.labels(RUN, "GRPOTrainer", rank, phase).set(now - 3600)
    firing = Gauge("deadweight_detector_firing", "f", [*run, "detector", "severity"],
                   registry=reg)
    for d in SPECS:
        firing.labels(RUN, "GRPOTrainer", d.id, d.severity.value).set(1)
    # One silenced detector of another run (``deadweight silence``): the rules' silence clause
    # meets a live series, as every shipped query must.
    Gauge("deadweight_detector_silenced", "s", ["run_id", "detector"], registry=reg).labels(
        "run-on-hold", "entropy_collapse").set(1)
    for name in ("checkpoints", "checkpoint_unchanged"):
        Counter(f"deadweight_{name}", name, run, registry=reg).labels(RUN, "GRPOTrainer").inc(2)
    Gauge("deadweight_checkpoint_info", "i", [*run, "digest"], registry=reg).labels(
        RUN, "GRPOTrainer", "ab12").set(1)
    Counter("deadweight_actions", "a", [*run, "detector", "action", "result"],
            registry=reg).labels(RUN, "GRPOTrainer", "frozen_weights", "page", "ok").inc()
    Counter("deadweight_client_dropped_events", "d", ranked, registry=reg).labels(
        RUN, "GRPOTrainer", "0").inc(0)
    Gauge("deadweight_sidecar_info", "v", ["version"], registry=reg).labels("0.1.0").set(1)
    reg.register(_FailingPager())  # type: ignore[arg-type]
    return reg


@pytest.fixture(scope="module")
def live_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server, thread = start_http_server(0, addr="127.0.0.1", registry=_exporter_registry())
    port = server.server_address[1]
    rules = (promql.RULES).read_text()
    config = f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [deadweight.rules.yml]
scrape_configs:
  - job_name: deadweight
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
  - job_name: deadweight-gone
    static_configs: [{{targets: ["127.0.0.1:{free_port()}"]}}]
"""
    workdir = tmp_path_factory.mktemp("prom")
    try:
        with start_prometheus(workdir, config, {"deadweight.rules.yml": rules}) as prom:
            wait_for(lambda: prom.query('count_over_time(up{job="deadweight"}[1m]) >= 3'),
                     30, what="three scrapes")
            yield prom
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _assert_data(prom: Prometheus, where: str, expr: str) -> None:
    assert prom.query(expr), f"{where}: no data for {expr}"
    for sel in promql.selectors(expr):
        assert prom.query(sel), f"{where}: selector {sel} returns nothing (in {expr})"


@pytest.mark.slow
def test_every_dashboard_query_returns_data(live_prometheus: Prometheus) -> None:
    queries = promql.dashboard_queries(RUN)
    assert len(queries) > 30
    for where, expr in queries:
        _assert_data(live_prometheus, where, expr)


@pytest.mark.slow
def test_every_rule_and_evidence_query_returns_data(live_prometheus: Prometheus) -> None:
    for where, expr in promql.rule_expressions():
        _assert_data(live_prometheus, where, expr)
    evidence = promql.evidence_queries(RUN)
    assert len(evidence) > 50
    for where, expr in evidence:
        if "count(deadweight_kl" in expr:
            continue  # kl_series counts a series that is absent when the detector fires
        _assert_data(live_prometheus, where, expr)


@pytest.mark.slow
def test_rules_evaluate_cleanly_and_fire_in_prometheus(live_prometheus: Prometheus) -> None:
    def all_active() -> list[dict[str, Any]] | None:
        alerts = live_prometheus.alerts()
        names = {a["labels"]["alertname"] for a in alerts}
        return alerts if len(names) == len(SPECS) + len(MONITORING) else None

    alerts = wait_for(all_active, 20, what="every alert pending or firing")
    detector_alerts = [a for a in alerts if "detector" in a["labels"]]
    for alert in detector_alerts:
        assert set(alert["labels"]) == {"alertname", "run_id", "detector", "severity"}
    frozen = next(a for a in detector_alerts if a["labels"]["detector"] == "frozen_weights")
    assert "frozen_steps=12" in frozen["annotations"]["description"]
    assert "grad_norm=0.41" in frozen["annotations"]["description"]
    groups = promql.http_rules(live_prometheus.url)
    for rule in groups:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
