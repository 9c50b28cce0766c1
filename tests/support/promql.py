"""Collect every PromQL expression the on-call kit ships, ready to run on a live Prometheus.

Rule expressions, the evidence queries inside alert annotations, dashboard targets and the
dashboards' query variables, with the Grafana variables and template arguments filled in for one
run. `selectors()` splits an expression into its vector selectors, so a test can demand data
from each one: a typo in a metric or label name returns nothing even inside `... or vector(0)`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "deadweight.rules.yml"
DASHBOARDS = sorted((ROOT / "dashboards").glob("deadweight-*.json"))

_SELECTOR = re.compile(r"\b(deadweight_[a-z_]+|up)\b(\{[^}]*\})?")
_EVIDENCE = re.compile(r'printf "([^"]+)" \$labels\.run_id')
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*[a-zA-Z_]+\)$")


def selectors(expr: str) -> list[str]:
    """Vector selectors (metric plus matchers) in an expression, in order, without repeats."""
    out: list[str] = []
    for match in _SELECTOR.finditer(expr):
        sel = match.group(0)
        if sel not in out:
            out.append(sel)
    return out


def rule_expressions() -> list[tuple[str, str]]:
    """(alert name, expression) for every rule."""
    data = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in data["groups"] for r in g["rules"]]


def evidence_queries(run_id: str) -> list[tuple[str, str]]:
    """(alert name, query) for every evidence query in the annotations, for one run."""
    data = yaml.safe_load(RULES.read_text())
    out = []
    for group in data["groups"]:
        for rule in group["rules"]:
            for text in rule.get("annotations", {}).values():
                for template in _EVIDENCE.findall(text):
                    out.append((rule["alert"], template.replace("%q", json.dumps(run_id))))
    return out


def dashboard_queries(run_id: str) -> list[tuple[str, str]]:
    """(dashboard/panel, query) for every target and query variable, variables filled in."""
    out = []
    for path in DASHBOARDS:
        data = json.loads(path.read_text())
        for panel in data["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']}", fill(target["expr"], run_id)))
        for var in data["templating"]["list"]:
            if var["type"] == "query":
                match = _LABEL_VALUES.match(var["query"])
                assert match, var["query"]
                out.append((f"{path.name}: ${var['name']}", match.group(1)))
    return out


def fill(expr: str, run_id: str, rate_interval: str = "1m") -> str:
    """Replace the Grafana variables these dashboards use."""
    return (expr.replace("$run_id", run_id).replace("$__rate_interval", rate_interval))


def http_rules(prometheus_url: str) -> list[dict[str, object]]:
    """Every loaded rule with its evaluation health, from Prometheus' rules API."""
    from tests.support.realprocs import http_json

    data = http_json(prometheus_url + "/api/v1/rules")
    return [r for g in data["data"]["groups"] for r in g["rules"]]
