"""A LoRA run at lr 1e-9: flagged at every step and in the summary beside its adapter.

The real SFT run moves bytes (not frozen) and its scale-free ratio looks healthy (it divides
by the tiny learning rate), yet each step moves the adapter by ~1e-9 of itself. Its twin at
lr 2e-4 stays silent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from deadweight.demo import runs
from deadweight.proto import run_summary
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow


def _run(live: InProcessSidecar, run_id: str, model_dir: Path, out: Path, lr: float) -> None:
    runs.sft_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir, out,
                     [live.callback(run_id)], steps=6, lr=lr, save_steps=3,
                     peft_config=runs.lora_config()).train()


def test_negligible_updates_stand_for_the_whole_run_and_in_the_summary(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = tiny
    _run(live, "lr-1e-9", model_dir, tmp_path / "tiny", 1e-9)
    steps = live.seen("lr-1e-9").combined_steps()
    assert all(p.update_sq_sum > 0 for p in steps)  # bytes move: not frozen_weights
    assert "frozen_weights" not in live.fired("lr-1e-9")
    finding = live.findings("lr-1e-9")["negligible_updates"]
    assert finding.firing and finding.incidents == 1  # still firing after the run ended
    assert finding.step == live.registry.settings.negligible_update_steps
    assert float(finding.evidence["relative_update"]) < 1e-7
    summary = run_summary.read(tmp_path / "tiny" / run_summary.FILE_NAME)
    (verdict,) = [v for v in summary.summary.verdicts if v.detector == "negligible_updates"]
    assert verdict.firing

    _run(live, "lr-2e-4", model_dir, tmp_path / "healthy", 2e-4)
    assert "negligible_updates" not in live.fired("lr-2e-4")
