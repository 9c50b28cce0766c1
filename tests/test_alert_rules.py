"""The shipped Prometheus rules: generated from one table, valid, unit-tested with promtool,
one runbook per alert, and the same names and links as the sidecar's own push path."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from alerts import generate
from alerts.catalogue import DETECTORS, ROOT_CAUSES, RUN_STALE, SIDECAR_DOWN, SYMPTOMS
from deadweight.sidecar.alertmanager import DEFAULT_RUNBOOK_BASE_URL, alert_name, runbook_url

ALERTS = Path(__file__).resolve().parent.parent / "alerts"
RUNBOOKS = ALERTS / "runbooks"

# Severities of the public contract (the design's detector catalogue).
CONTRACT_SEVERITY = {
    **dict.fromkeys(
        ["frozen_weights", "empty_optimizer", "grad_not_in_optimizer", "checkpoint_unchanged",
         "adapter_never_trained", "nonfinite_loss", "stalled", "zero_reward_variance",
         "inactive_adapter"], "critical"),
    **dict.fromkeys(
        ["decay_only_update", "adapter_bloat", "embedding_resized", "partial_target_modules",
         "kl_missing", "kl_stuck_zero", "entropy_collapse", "completion_length_collapse",
         "lora_lr_too_low", "pickle_checkpoint", "dpo_likelihood_collapse"], "warning"),
    "no_kl_anchor": "info",
}


def _rules() -> list[dict[str, object]]:
    data = yaml.safe_load((ALERTS / generate.RULES_FILE).read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_committed_files_equal_a_fresh_generation() -> None:
    for rel, text in generate.render().items():
        assert (ALERTS / rel).read_text() == text, f"{rel} is stale: run python -m alerts.generate"


def test_every_contract_detector_has_an_alert_with_its_severity() -> None:
    table = {d.detector: d.severity for d in DETECTORS}
    assert table == CONTRACT_SEVERITY


def test_alert_names_and_runbook_links_match_the_push_path() -> None:
    rules = {r["alert"]: r for r in _rules()}
    for d in DETECTORS:
        rule = rules[alert_name(d.detector)]
        notes = rule["annotations"]
        assert isinstance(notes, dict)
        assert notes["runbook_url"] == runbook_url(DEFAULT_RUNBOOK_BASE_URL, d.detector)
        assert set(notes) == {"summary", "description", "runbook_url"}
        # Exactly run_id, detector, severity survive (alertname is added by Prometheus) and
        # no static label could add or override one.
        assert str(rule["expr"]).startswith("max by (run_id, detector, severity) (")
        assert "labels" not in rule
    assert set(rules) == {alert_name(d.detector) for d in DETECTORS} | {SIDECAR_DOWN, RUN_STALE}


def test_one_runbook_per_alert_with_the_three_sections() -> None:
    expected = {d.detector for d in DETECTORS} | {generate.SIDECAR_DOWN_RUNBOOK,
                                                   generate.RUN_STALE_RUNBOOK}
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


def test_inhibition_lists_name_existing_detectors() -> None:
    names = {d.detector for d in DETECTORS}
    assert set(ROOT_CAUSES) <= names and set(SYMPTOMS) <= names
    assert not set(ROOT_CAUSES) & set(SYMPTOMS)
    # The headline page must never be inhibited by its sibling root cause.
    assert "frozen_weights" not in SYMPTOMS


def test_custom_job_selector_reaches_the_sidecar_down_rule() -> None:
    text = generate.render(job_selector='job="dw"')[generate.RULES_FILE]
    assert 'up{job="dw"} == 0 or absent(up{job="dw"})' in text


def test_promtool_check_rules_is_clean() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS / generate.RULES_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run(["promtool", "test", "rules", generate.TESTS_FILE], cwd=ALERTS,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    data = yaml.safe_load((ALERTS / generate.TESTS_FILE).read_text())
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
    rules = (ALERTS / generate.RULES_FILE).read_text()
    broken = rules.replace("deadweight_update_ratio{run_id=%q}",
                           "deadweight_update_ratoi{run_id=%q}")
    assert broken != rules
    (tmp_path / generate.RULES_FILE).write_text(broken)
    shutil.copy(ALERTS / generate.TESTS_FILE, tmp_path / generate.TESTS_FILE)
    out = subprocess.run(["promtool", "test", "rules", generate.TESTS_FILE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "DeadweightFrozenWeights" in out.stdout + out.stderr


def test_sidecar_detectors_match_the_table() -> None:
    """The sidecar's detectors carry the severities the rules and routes assume."""
    from deadweight.sidecar.detectors import BY_ID

    table = {d.detector: d.severity for d in DETECTORS}
    for detector_id, detector in BY_ID.items():
        assert detector_id in table, f"sidecar detector {detector_id} has no alert"
        assert detector.severity.value == table[detector_id], detector_id
