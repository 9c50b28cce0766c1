"""DeadweightSidecarDown fires when no sidecar answers, so its runbook link must open without
one: by default the repository's runbook file, never a sidecar's /runbooks/."""

from __future__ import annotations

from pathlib import Path

import yaml

from alerts import generate, rules
from deadweight.sidecar.actions import links

ROOT = Path(__file__).resolve().parents[2]


def _notes(text: str) -> dict[str, dict[str, str]]:
    return {r["alert"]: r["annotations"] for g in yaml.safe_load(text)["groups"]
            for r in g["rules"] if "alert" in r}


def test_the_committed_rules_link_sidecar_down_to_the_repository_not_to_a_sidecar() -> None:
    notes = _notes((ROOT / "alerts" / rules.RULES_FILE).read_text())
    link = notes[rules.SIDECAR_DOWN.name]["runbook_url"]
    assert link == links.DEFAULT_DOCS_URL_PATTERN.format(detector="sidecar_down")
    sidecar_link = links.runbook_url(links.DEFAULT_RUNBOOK_URL_PATTERN, "sidecar_down")
    assert link != sidecar_link and "127.0.0.1" not in link
    # The link names a runbook the repository really holds.
    path = link.split("/blob/main/", 1)[1]
    assert (ROOT / path).read_text().startswith("# DeadweightSidecarDown")
    # Every other alert keeps the runbook pattern (a sidecar answers when they fire).
    others = {name: n["runbook_url"] for name, n in notes.items()
              if name != rules.SIDECAR_DOWN.name}
    assert others and all(u.startswith("http://127.0.0.1:9464/runbooks/")
                          for u in others.values())


def test_a_docs_pattern_given_to_the_generator_wins(tmp_path: Path) -> None:
    assert generate.main(["--out", str(tmp_path), "--docs-url-pattern",
                          "https://wiki.example.com/ml/{alertname}"]) == 0
    notes = _notes((tmp_path / "alerts" / rules.RULES_FILE).read_text())
    assert notes[rules.SIDECAR_DOWN.name]["runbook_url"] == (
        "https://wiki.example.com/ml/DeadweightSidecarDown")
