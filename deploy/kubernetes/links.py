"""The link patterns of the Kubernetes deployment, from ``links.env`` (the one place).

The sidecar reads them as environment variables from the ConfigMap that ``kustomization.yaml``
generates from the same file; ``python -m alerts.generate`` renders ``prometheusrule.yaml``
with them, so Prometheus and the sidecar always send the same links.
"""

from __future__ import annotations

from pathlib import Path

from alerts.rules import Patterns
from deadweight.sidecar.actions import links as alert_links

LINKS_FILE = Path(__file__).resolve().parent / "links.env"
#: The ConfigMap kustomization.yaml generates from LINKS_FILE (no hash suffix: the Job names it).
CONFIG_MAP = "deadweight-links"
KEYS = ("RUNBOOK_URL_PATTERN", "DASHBOARD_URL_PATTERN", "DOCS_URL_PATTERN")
#: Keys that may be left empty: no dashboard configured means no dashboard link.
OPTIONAL = frozenset({"DASHBOARD_URL_PATTERN"})


def read(path: Path = LINKS_FILE) -> dict[str, str]:
    """KEY=VALUE lines (``#`` comments and blank lines skipped), as kustomize reads them."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    missing = [k for k in KEYS if k not in values or (not values[k] and k not in OPTIONAL)]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    return values


def patterns(path: Path = LINKS_FILE) -> Patterns:
    """The patterns in path, each checked for its placeholders."""
    values = read(path)
    return Patterns(
        alert_links.check_pattern(values["RUNBOOK_URL_PATTERN"], alert_links.RUNBOOK_PLACEHOLDERS),
        alert_links.check_pattern(values["DASHBOARD_URL_PATTERN"],
                                  alert_links.DASHBOARD_PLACEHOLDERS),
        alert_links.check_pattern(values["DOCS_URL_PATTERN"], alert_links.RUNBOOK_PLACEHOLDERS))
