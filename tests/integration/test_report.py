"""``deadweight report``: frozen and healthy runs' pages, rendered by a real browser.

The runs are real GRPO, SFT and DPO trainings watched by a real sidecar with a state dir; the
sidecar is gone before the reports are made (they read the state database only). Headless
Chromium renders each page to PNG, and the picture must hold a drawing, not a blank page. The
page's top must tell, in this order, the root cause, its fix and the runbook link (one that
answered while the sidecar ran). With ``DEADWEIGHT_WRITE_DOCS=1`` the frozen GRPO and healthy
SFT screenshots are written to ``docs/images/`` for the README.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
)
#: The runs of the test: (run id, trainer, adapter loaded trainable).
RUNS = (("grpo-frozen", "grpo", False), ("grpo-healthy", "grpo", True),
        ("sft-frozen", "sft", False), ("sft-healthy", "sft", True),
        ("dpo-healthy", "dpo", True))
#: The screenshots the README shows: file name under docs/images -> run id.
DOC_SHOTS = {"report-frozen.png": "grpo-frozen", "report-healthy.png": "sft-healthy"}


def _train(tiny: tuple[Path, Path], sidecar: SidecarProcess, run_id: str, out: Path,
           trainer: str, trainable: bool) -> None:
    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=trainable)
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id)
    if trainer == "grpo":
        # Biased toward its stop token, the tiny policy ends some completions, as a healthy
        # one does (otherwise completions_truncated is right to warn).
        runs.grpo_trainer(model, model_dir, out, [callback], steps=8, save_steps=4,
                          **runs.terminating(model_dir)).train()
    elif trainer == "dpo":
        runs.dpo_trainer(model, model_dir, out, [callback], steps=8, save_steps=4).train()
    else:
        runs.sft_trainer(model, model_dir, out, [callback], steps=8, save_steps=4).train()


def _report(state: Path, run_id: str, out: Path, pattern: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", "report", run_id, "--state-dir",
         str(state), "--out", str(out), "--runbook-url-pattern", pattern],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out.read_text()


def _screenshot(page: Path, png: Path, profile: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium is not None, "chromium is not installed (bash .ci/run installs it)"
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                    "--window-size=1280,2400", f"--screenshot={png}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)


def _drawn_colors(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None
    return len(colors)


def _top(page: str) -> str:
    """The part of the page before the first plot: what a reader sees first."""
    return page[:page.index("<svg")]


def _positions(text: str, *needles: str) -> list[int]:
    found = [text.find(n) for n in needles]
    assert -1 not in found, [n for n, at in zip(needles, found, strict=True) if at < 0]
    return found


@pytest.mark.slow
def test_report_pages_for_frozen_and_healthy_runs(tiny: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "sidecar", extra_args=["--state-dir", str(state)]) as sc:
        for run_id, trainer, trainable in RUNS:
            _train(tiny, sc, run_id, tmp_path / run_id, trainer, trainable)
        pattern = f"http://127.0.0.1:{sc.metrics_port}/runbooks/{{detector}}"
        link = pattern.format(detector="empty_optimizer")
        with urllib.request.urlopen(link, timeout=5) as answer:  # the link opens
            assert answer.status == 200 and b"is_trainable=True" in answer.read()

    pages = {run_id: _report(state, run_id, tmp_path / f"{run_id}.html", pattern)
             for run_id, _, _ in RUNS}
    for page in pages.values():
        assert page.count("<svg") >= 2  # movement and per-module panels at least
        # Self-contained: nothing is fetched when the page is viewed (a link is not fetched).
        assert not re.search(r"""\ssrc\s*=|<link\b|@import|url\(\s*['"]?(?!#)""", page)
        assert "<script" not in page

    for run_id in ("grpo-frozen", "sft-frozen"):
        top = _top(pages[run_id])
        # Root cause, its fix (the runbook's first step) and the runbook link, in that order.
        cause, fix, runbook = _positions(
            top, "NOT LEARNING: root cause empty_optimizer", "<p class=fix>",
            f'<p class=runbook><b>Runbook:</b> <a href="{link}">')
        assert cause < fix < runbook
        assert "is_trainable=True" in top[fix:runbook]
        # The runbook itself is in the page too, for where the link does not open.
        assert '<a href="#runbook">' in top[runbook:]
        embedded = pages[run_id][pages[run_id].index("<h2 id=runbook>"):]
        assert "empty_optimizer" in embedded and "<h2>How to fix</h2>" in embedded
        # The symptoms come after their cause, in the banner and in the verdict table.
        _, frozen, unchanged = _positions(top[runbook:], "<p class=others>", "frozen_weights",
                                          "checkpoint_unchanged")
        assert frozen < unchanged
        table = pages[run_id][pages[run_id].index("Verdicts (root causes first)"):]
        first, frozen, unchanged = _positions(table, "<td>empty_optimizer</td>",
                                              "<td>frozen_weights</td>",
                                              "<td>checkpoint_unchanged</td>")
        assert first < frozen < unchanged
        # The run ended with its verdicts standing: never "resolved".
        assert "firing at end" in table and "resolved" not in table
        assert "identical bytes" in pages[run_id]  # the checkpoint never changed
        # Per module: the panels say the modules did not move, not "precision".
        assert "Not moving: every module kind stayed byte-identical" in pages[run_id]
        assert "precision" not in pages[run_id]
        assert "0 at every step: not moving" in pages[run_id]
    for run_id in ("grpo-healthy", "sft-healthy", "dpo-healthy"):
        top = _top(pages[run_id])
        assert "HEALTHY: the weights moved at 8 of 8 optimizer steps" in top
        assert "class=fix" not in top and "identical bytes" not in pages[run_id]
        assert "Every module kind moved" in pages[run_id]
        assert "id=runbook>" not in pages[run_id]
    # Sections only for the signals a run has: RL for GRPO, none for SFT.
    assert "id=rl>" in pages["grpo-frozen"] and "id=rl>" in pages["grpo-healthy"]
    assert "id=rl>" not in pages["sft-frozen"] and "id=rl>" not in pages["sft-healthy"]
    assert "Reinforcement learning" not in pages["sft-healthy"]
    # DPO's implicit rewards get their own section, and only DPO gets it.
    assert "id=preference>" in pages["dpo-healthy"] and "id=rl>" not in pages["dpo-healthy"]
    assert not any("id=preference>" in pages[r] for r, _, _ in RUNS if r != "dpo-healthy")

    # The per-module figures: the frozen adapter never moved, element for element; the
    # healthy one moved everywhere (GRPO's frozen "ref" copy of the adapter is not counted).
    from deadweight.sidecar.commands import report
    from deadweight.sidecar.store.journal import Store

    store = Store(state)
    stood = report.module_movement(report.load(store, "grpo-frozen"))
    moved = report.module_movement(report.load(store, "grpo-healthy"))
    store.close()
    assert stood and moved.keys() == stood.keys()
    assert all(m.not_moving and m.unchanged_elements == 1.0 for m in stood.values()), stood
    assert all(not m.not_moving and m.unchanged_elements is not None
               and m.unchanged_elements < 0.1 for m in moved.values()), moved

    shots = {}
    for run_id in pages:
        png = tmp_path / f"{run_id}.png"
        _screenshot(tmp_path / f"{run_id}.html", png, tmp_path / f"profile-{run_id}")
        assert _drawn_colors(png) > 200, f"{run_id}: the screenshot looks blank"
        shots[run_id] = png
    assert len({png.read_bytes() for png in shots.values()}) == len(shots)
    if os.environ.get("DEADWEIGHT_WRITE_DOCS") == "1":
        IMAGES.mkdir(exist_ok=True)
        for name, run_id in DOC_SHOTS.items():
            _trimmed(shots[run_id], IMAGES / name)


def _trimmed(png: Path, out: Path, margin: int = 24) -> None:
    """The screenshot without the blank window below the page's end (for the README)."""
    from PIL import Image, ImageChops

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, "white")).getbbox()
        bottom = rgb.height if box is None else min(rgb.height, box[3] + margin)
        rgb.crop((0, 0, rgb.width, bottom)).save(out, optimize=True)
