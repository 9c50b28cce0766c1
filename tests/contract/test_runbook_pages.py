"""Runbook links open: a real ``deadweight serve`` renders every shipped runbook as HTML on its
metrics port, 404s anything else (no path leaves the runbooks), and the wheel ships them."""

from __future__ import annotations

import http.client
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from alerts.rules import MONITORING
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.actions.links import alert_name
from deadweight.sidecar.detectors import ALL

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK_NAMES = [d.id for d in ALL] + [a.runbook for a in MONITORING]


def _get(port: int, path: str) -> tuple[int, str, str]:
    """(status, content type, body) for path sent exactly as given (no client normalising)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read().decode()
    finally:
        conn.close()


def test_every_runbook_is_served_as_html(sidecar: SidecarProcess) -> None:
    for name in RUNBOOK_NAMES:
        for path in (f"/runbooks/{name}", f"/runbooks/{name}.md"):
            status, kind, body = _get(sidecar.metrics_port, path)
            assert (status, kind) == (200, "text/html; charset=utf-8"), path
            assert f"<h1>{alert_name(name)}</h1>" in body, path
            assert "<h2>What it means</h2>" in body and "<h2>How to fix</h2>" in body, path
            assert "](" not in body, f"{path}: Markdown links left unrendered"


def test_the_index_links_every_runbook_relative_to_itself(sidecar: SidecarProcess) -> None:
    status, _, index = _get(sidecar.metrics_port, "/runbooks/")
    assert status == 200 and "<table>" in index
    links = set(re.findall(r'href="([a-z_]+\.md)"', index))
    assert links == {f"{name}.md" for name in RUNBOOK_NAMES}
    for link in sorted(links):
        assert _get(sidecar.metrics_port, f"/runbooks/{link}")[0] == 200, link
    status, _, _ = _get(sidecar.metrics_port, "/runbooks")
    assert status == 301  # so that the relative links above resolve under /runbooks/


@pytest.mark.parametrize("path", [
    "/runbooks/not_a_detector", "/runbooks/../pyproject.toml", "/runbooks/..%2F..%2Fsetup.py",
    "/runbooks/frozen_weights/../../metrics", "/runbooks//etc/passwd", "/runbooks/FROZEN_WEIGHTS",
    "/runbooks/frozen_weights.md.bak", "/runbooks/%2e%2e/README",
])
def test_unknown_names_and_traversal_are_404(sidecar: SidecarProcess, path: str) -> None:
    status, _, body = _get(sidecar.metrics_port, path)
    assert status == 404, path
    assert "<" not in body


@pytest.mark.slow
def test_the_wheel_ships_the_runbooks_and_the_markdown_renderer(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("deadweight", "callbacks", "sidecar", "proto", "demo"):  # as the Dockerfile
        shutil.copytree(ROOT / folder, src / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [wheel] = (tmp_path / "dist").glob("deadweight-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(n).decode() for n in names if n.endswith("/METADATA"))
    for runbook in [*RUNBOOK_NAMES, "README"]:
        assert f"deadweight/sidecar/runbooks/{runbook}.md" in names, runbook
    assert re.search(r"^Requires-Dist: markdown-it-py", metadata, re.M), metadata


def test_every_detector_runbook_states_its_specs_severity() -> None:
    """On-call reads the severity in the runbook: it is the spec's, with the lower one and
    when it applies (a detector whose severity changed cannot keep an old runbook line)."""
    for detector in ALL:
        spec = detector.spec
        line = (ROOT / "alerts" / "runbooks" / spec.runbook).read_text().splitlines()[2]
        if spec.lower_severity is not None:
            assert line.startswith(f"Severity: {spec.severity_words}."), (spec.id, line)
        else:
            assert re.match(rf"Severity: {spec.severity.value}[ .]", line), (spec.id, line)
