"""``deadweight report``: a frozen and a healthy run's pages, rendered by a real browser.

Both runs are real GRPO trainings watched by a real sidecar with a state dir; the sidecar is
gone before the report is made (it reads the state database only). Headless Chromium renders
each page to PNG, and the picture must hold a drawing, not a blank page. With
``DEADWEIGHT_WRITE_DOCS=1`` the two PNGs are written to ``docs/`` for the README.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess

DOCS = Path(__file__).resolve().parents[2] / "docs"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
)


def _train(tiny: tuple[Path, Path], sidecar: SidecarProcess, run_id: str, out: Path,
           trainable: bool) -> None:
    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=trainable)
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id)
    # Biased toward its stop token, the tiny policy ends some completions, as a healthy one
    # does (otherwise completions_truncated is right to warn).
    runs.grpo_trainer(model, model_dir, out, [callback], steps=8, save_steps=4,
                      **runs.terminating(model_dir)).train()


def _report(state: Path, run_id: str, out: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.cli", "report", run_id, "--state-dir",
         str(state), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out.read_text()


def _screenshot(page: Path, png: Path, profile: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium is not None, "chromium is not installed (bash .ci/run installs it)"
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                    "--window-size=1280,2000", f"--screenshot={png}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)


def _drawn_colors(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None
    return len(colors)


@pytest.mark.slow
def test_report_pages_for_a_frozen_and_a_healthy_run(tiny: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "sidecar", extra_args=["--state-dir", str(state)]) as sc:
        _train(tiny, sc, "report-frozen", tmp_path / "frozen", trainable=False)
        _train(tiny, sc, "report-healthy", tmp_path / "healthy", trainable=True)

    frozen = _report(state, "report-frozen", tmp_path / "frozen.html")
    healthy = _report(state, "report-healthy", tmp_path / "healthy.html")
    for page in (frozen, healthy):
        assert page.count("<svg") >= 2  # movement and RL panels at least
        # Self-contained: nothing is fetched when the page is viewed.
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
        assert "<script" not in page
    assert "NOT LEARNING" in frozen and "frozen_weights" in frozen
    assert "identical bytes" in frozen  # the hash chain shows the checkpoint never changed
    assert "healthy: no critical or warning verdict" in healthy
    assert "identical bytes" not in healthy
    assert "fraction of element-steps unchanged" in frozen

    # The per-module panel: the frozen adapter never moved, element for element; the healthy
    # one moved everywhere (GRPO's frozen "ref" copy of the adapter is not counted).
    from deadweight.sidecar import report
    from deadweight.sidecar.store.journal import Store

    store = Store(state)
    stood = report.module_movement(report.load(store, "report-frozen"))
    moved = report.module_movement(report.load(store, "report-healthy"))
    store.close()
    assert stood and moved.keys() == stood.keys()
    assert all(m.unchanged_tensors == 1.0 and m.unchanged_elements == 1.0
               for m in stood.values()), stood
    assert all(m.unchanged_tensors == 0.0 and m.unchanged_elements is not None
               and m.unchanged_elements < 0.1 for m in moved.values()), moved

    shots = {}
    for name in ("frozen", "healthy"):
        png = tmp_path / f"report-{name}.png"
        _screenshot(tmp_path / f"{name}.html", png, tmp_path / f"profile-{name}")
        assert _drawn_colors(png) > 200, f"{name}: the screenshot looks blank"
        shots[name] = png
    assert shots["frozen"].read_bytes() != shots["healthy"].read_bytes()
    if os.environ.get("DEADWEIGHT_WRITE_DOCS") == "1":
        for png in shots.values():
            shutil.copy(png, DOCS / png.name)
