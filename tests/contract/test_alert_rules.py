"""The shipped Prometheus rules: generated from the detectors' specs, valid, unit-tested with
promtool, one runbook per alert, and the same names and links as the sidecar's own push path."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from alerts import generate, rules
from alerts.rules import MONITORING, SPECS, Patterns
from deadweight.sidecar.actions.links import (
    BadPattern,
    alert_name,
    dashboard_url,
    runbook_url,
)
from deadweight.sidecar.detectors import ALL, BY_ID
from deadweight.sidecar.detectors.base import SpecDetector, Verdict
from deadweight.sidecar.detectors.spec import DetectorSpec, Evidence, Severity, Threshold
from deadweight.sidecar.model.settings import DetectorSettings

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
RUNBOOKS = ALERTS / "runbooks"
# The public contract's detector ids (DESIGN.md); severities and the rest come from the specs.
DESIGN_IDS = [
    "empty_optimizer", "grad_not_in_optimizer", "frozen_weights", "decay_only_update",
    "checkpoint_unchanged", "adapter_never_trained", "adapter_bloat", "embedding_resized",
    "partial_target_modules", "inactive_adapter", "no_kl_anchor", "kl_missing", "kl_stuck_zero",
    "zero_reward_variance", "entropy_collapse", "completion_length_collapse", "lora_lr_too_low",
    "nonfinite_loss", "stalled", "pickle_checkpoint", "dpo_likelihood_collapse",
]
DEFAULTS = generate.DEFAULT_PATTERNS


def _rules(text: str | None = None) -> list[dict[str, Any]]:
    data = yaml.safe_load(text or (ALERTS / rules.RULES_FILE).read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_committed_files_equal_a_fresh_generation() -> None:
    stale = generate.stale()
    assert not stale, f"stale generated files {stale}: run {generate.COMMAND}"


def test_the_staleness_check_names_the_command(
        tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """A generated file edited by hand is caught, and the message says what to run."""
    for rel in [*generate.render(), *(f"{generate.RUNBOOKS}/{p.name}"
                                       for p in RUNBOOKS.glob("*.md"))]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert generate.stale(tmp_path) == []
    edited = tmp_path / generate.RUNBOOK_INDEX
    edited.write_text(edited.read_text() + "\nOne more line.\n")
    assert generate.stale(tmp_path) == [generate.RUNBOOK_INDEX]
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.main(["--check"]) == 1
    assert ("stale: alerts/runbooks/README.md (run python -m alerts.generate)"
            in capsys.readouterr().err)
    assert generate.main([]) == 0 and generate.stale(tmp_path) == []


def test_every_contract_detector_exists_with_one_alert() -> None:
    assert set(DESIGN_IDS) <= set(BY_ID)  # new ids may join; none of these may go
    names = [str(r["alert"]) for r in _rules()]
    assert sorted(names) == sorted({alert_name(i) for i in BY_ID} | {a.name for a in MONITORING})


def test_alert_severities_are_the_detectors_own() -> None:
    by_name = {str(r["alert"]): r for r in _rules()}
    for detector in ALL:
        rule = by_name[alert_name(detector.id)]
        # The rule keeps the exported label: the series carries the detector's severity.
        assert f'detector="{detector.id}"' in str(rule["expr"])
        assert detector.severity is detector.spec.severity
        assert detector.scope == detector.spec.scope
        # No rule needs the run live: a run that ended with its verdict firing pages too.
        assert "deadweight_run_active" not in str(rule["expr"])


def test_alert_names_and_links_match_the_push_path() -> None:
    rules_by_name = {r["alert"]: r for r in _rules()}
    for d in SPECS:
        rule = rules_by_name[alert_name(d.id)]
        notes = rule["annotations"]
        assert notes["runbook_url"] == runbook_url(DEFAULTS.runbook, d.id)
        # No dashboard pattern by default: no dashboard link (never a dead one).
        assert set(notes) == {"summary", "description", "runbook_url"}
        # Exactly run_id, detector, severity survive (alertname is added by Prometheus) and
        # no static label could add or override one.
        assert str(rule["expr"]).startswith("max by (run_id, detector, severity) (")
        assert "labels" not in rule


def test_rules_rendered_with_patterns_carry_them_on_every_alert() -> None:
    patterns = Patterns("https://wiki.example.com/ml/{alertname}?id={detector}",
                        "https://grafana.example.com/d/deadweight-run/x?var-run_id={run_id}")
    rendered = _rules(rules.render(rules.DEFAULT_JOB_SELECTOR, rules.DEFAULT_STALE_SECONDS,
                                   patterns)[rules.RULES_FILE])
    assert len(rendered) == len(SPECS) + len(MONITORING)
    for rule in rendered:
        notes = rule["annotations"]
        name = str(rule["alert"])
        runbook = {a.name: a.runbook for a in MONITORING}.get(name) or next(
            d.id for d in SPECS if alert_name(d.id) == name)
        assert notes["runbook_url"] == f"https://wiki.example.com/ml/{name}?id={runbook}"
        if name in {a.name for a in MONITORING if not a.per_run}:
            assert "dashboard_url" not in notes  # about a target, not a run
        else:
            assert notes["dashboard_url"] == ("https://grafana.example.com/d/deadweight-run/x"
                                              "?var-run_id={{ $labels.run_id | urlquery }}")


def test_promtool_renders_the_dashboard_link_as_the_push_path_does(tmp_path: Path) -> None:
    """Go's urlquery and the pusher's quote_plus agree on a run id that needs escaping."""
    patterns = Patterns("https://wiki.example.com/{detector}",
                        "https://grafana.example.com/d/x?var-run_id={run_id}")
    files = rules.render(rules.DEFAULT_JOB_SELECTOR, rules.DEFAULT_STALE_SECONDS, patterns)
    (tmp_path / rules.RULES_FILE).write_text(files[rules.RULES_FILE])
    tests = yaml.safe_load(files[rules.TESTS_FILE])
    [case] = [t for t in tests["tests"] if t["name"].startswith("DeadweightFrozenWeights fires")]
    odd = "run a/b&c=d"
    text = yaml.safe_dump(case).replace("run-bad", odd)
    case = yaml.safe_load(text)
    expected = case["alert_rule_test"][1]["exp_alerts"][0]["exp_annotations"]
    # What the pusher sends for this run; promtool checks Prometheus renders the same.
    expected["dashboard_url"] = dashboard_url(patterns.dashboard, odd)
    assert expected["dashboard_url"].endswith("var-run_id=run+a%2Fb%26c%3Dd")
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": [rules.RULES_FILE], "evaluation_interval": "1m", "tests": [case]}))
    out = subprocess.run(["promtool", "test", "rules", "t.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_pattern_with_an_unknown_placeholder_is_refused() -> None:
    for bad in ("https://wiki/{detecter}", "https://wiki/{detector"):
        try:
            runbook_url(bad, "stalled")
        except BadPattern as err:
            assert bad in str(err)
        else:
            raise AssertionError(f"{bad} accepted")
    out = subprocess.run([sys.executable, "-m", "alerts.generate", "--check",
                          "--dashboard-url-pattern", "https://g/{run}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown placeholder" in out.stderr


def test_settings_fields_are_each_documented_by_a_detector() -> None:
    documented = {t.name: t for d in SPECS for t in d.thresholds}
    fields = {f.name for f in dataclasses.fields(DetectorSettings)}
    assert set(documented) == fields
    for threshold in documented.values():
        assert threshold.unit and threshold.doc


class _Throwaway(SpecDetector):
    """A detector that exists only in this test: what adding detector #22 takes."""

    spec = DetectorSpec(
        id="throwaway_probe", severity=Severity.WARNING,
        summary="Run {run_id} trips the throwaway probe",
        meaning="the throwaway probe saw its own reflection",
        fix="look away from the mirror",
        fires_when="never in production", cadence="at once",
        thresholds=(Threshold("frozen_steps", "optimizer steps", "borrowed"),),
        evidence=(Evidence("update_norm", 0), Evidence("loss")),
        symptom_of=("frozen_weights",),
    )

    def evaluate(self, run: Any, settings: DetectorSettings) -> Verdict | None:
        return Verdict(False)


def test_a_new_detector_needs_only_its_spec_for_every_generated_file(
        monkeypatch: Any, tmp_path: Path) -> None:
    spec = _Throwaway.spec
    monkeypatch.setattr(rules, "SPECS", (*SPECS, spec))
    monkeypatch.setattr(generate, "SPECS", (*SPECS, spec))
    files = rules.render(rules.DEFAULT_JOB_SELECTOR, rules.DEFAULT_STALE_SECONDS, DEFAULTS)
    [rule] = [r for r in _rules(files[rules.RULES_FILE])
              if r["alert"] == "DeadweightThrowawayProbe"]
    assert 'detector="throwaway_probe"' in rule["expr"]
    assert rule["annotations"]["runbook_url"] == runbook_url(DEFAULTS.runbook, spec.id)
    cases = yaml.safe_load(files[rules.TESTS_FILE])["tests"]
    mine = [c for c in cases if c["name"].startswith("DeadweightThrowawayProbe")]
    assert [bool(c["alert_rule_test"][-1]["exp_alerts"]) for c in mine] == [True, False]
    # Its promtool cases pass against its generated rule.
    (tmp_path / rules.RULES_FILE).write_text(files[rules.RULES_FILE])
    (tmp_path / rules.TESTS_FILE).write_text(yaml.safe_dump(
        {"rule_files": [rules.RULES_FILE], "evaluation_interval": "1m", "tests": mine}))
    out = subprocess.run(["promtool", "test", "rules", rules.TESTS_FILE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    inhibit = yaml.safe_load(files[rules.ALERTMANAGER_FILE])["inhibit_rules"]
    assert any("DeadweightThrowawayProbe" in r["target_matchers"][0] for r in inhibit)
    assert "| DeadweightThrowawayProbe | warning |" in generate.runbook_index()
    assert "[throwaway_probe.md](throwaway_probe.md)" in generate.runbook_index()
    assert "| `throwaway_probe` | warning | page | never in production | `frozen_steps=3` " \
        in generate.detector_table()
    prometheus_rule = yaml.safe_load(generate.deployable(
        DEFAULTS, rules.DEFAULT_JOB_SELECTOR, rules.DEFAULT_STALE_SECONDS)[
        generate.PROMETHEUS_RULE])
    assert "DeadweightThrowawayProbe" in {r["alert"] for g in prometheus_rule["spec"]["groups"]
                                          for r in g["rules"]}


def test_one_runbook_per_alert_with_the_three_sections() -> None:
    expected = {d.id for d in SPECS} | {a.runbook for a in MONITORING}
    found = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README"}
    assert found == expected
    for name in expected:
        text = (RUNBOOKS / f"{name}.md").read_text()
        for section in ("## What it means", "## How to confirm", "## How to fix"):
            assert section in text, f"{name}.md lacks {section!r}"
        for link in re.findall(r"\]\(([a-z_]+\.md)\)", text):
            assert (RUNBOOKS / link).exists(), f"{name}.md links to missing {link}"
    index = (RUNBOOKS / "README.md").read_text()
    for name in expected:
        assert f"({name}.md)" in index


def test_runbooks_spell_out_the_fixes() -> None:
    def text(name: str) -> str:
        return (RUNBOOKS / f"{name}.md").read_text()

    assert "is_trainable=True" in text("frozen_weights")
    assert "is_trainable=True" in text("empty_optimizer")
    assert "beta=" in text("no_kl_anchor") and "beta=" in text("completion_length_collapse")
    assert "target_modules" in text("partial_target_modules")
    assert "1e-4" in text("lora_lr_too_low") and "2e-4" in text("lora_lr_too_low")
    assert "pad_token = tokenizer.eos_token" in text("embedding_resized")


def test_inhibitions_name_existing_detectors() -> None:
    names = {d.id for d in SPECS}
    for causes, symptoms in rules.inhibitions().items():
        assert set(causes) <= names and set(symptoms) <= names
        assert not set(causes) & set(symptoms)
    # A root cause's page is never inhibited; a symptom only by causes as severe as itself,
    # so an inhibition never turns a page into a ticket.
    assert not rules.inhibitors(BY_ID["empty_optimizer"].spec)
    order = {"critical": 0, "warning": 1, "info": 2}
    for causes, symptoms in rules.inhibitions().items():
        for symptom in symptoms:
            assert all(order[BY_ID[c].spec.severity.value]
                       <= order[BY_ID[symptom].spec.severity.value] for c in causes)


def test_custom_job_selector_reaches_the_sidecar_down_rule() -> None:
    text = rules.render('job="dw"', rules.DEFAULT_STALE_SECONDS, DEFAULTS)[rules.RULES_FILE]
    assert 'up{job="dw"} == 0 or absent(up{job="dw"})' in text


def test_promtool_check_rules_is_clean() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS / rules.RULES_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run(["promtool", "test", "rules", rules.TESTS_FILE], cwd=ALERTS,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    data = yaml.safe_load((ALERTS / rules.TESTS_FILE).read_text())
    fires: set[str] = set()
    silent: set[str] = set()
    for case in data["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    names = {str(r["alert"]) for r in _rules()}
    assert fires == names
    assert silent == names


def test_promtool_cases_catch_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests can fail: a typo in one evidence metric breaks the expected text."""
    shipped = (ALERTS / rules.RULES_FILE).read_text()
    broken = shipped.replace("deadweight_update_ratio{run_id=%q}",
                             "deadweight_update_ratoi{run_id=%q}")
    assert broken != shipped
    (tmp_path / rules.RULES_FILE).write_text(broken)
    shutil.copy(ALERTS / rules.TESTS_FILE, tmp_path / rules.TESTS_FILE)
    out = subprocess.run(["promtool", "test", "rules", rules.TESTS_FILE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "DeadweightFrozenWeights" in out.stdout + out.stderr


def test_the_grafana_dashboard_link_opens_the_shipped_run_dashboard_on_its_run() -> None:
    import json

    from deadweight.sidecar.actions.links import dashboard_pattern_for

    assert DEFAULTS.dashboard == "" and dashboard_url(DEFAULTS.dashboard, "run-1") == ""
    board = json.loads((ROOT / "dashboards" / "deadweight-run.json").read_text())
    variables = {v["name"] for v in board["templating"]["list"]}
    link = dashboard_url(dashboard_pattern_for("https://grafana.example.com"), "run-1")
    assert f"/d/{board['uid']}/" in link
    assert "run_id" in variables and link.endswith("?var-run_id=run-1")
