"""``rollout_stale`` on a real GRPO run whose rollout-sampling metrics come from a recorded series.

TRL logs ``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*``
only when vLLM generates (a CUDA GPU; see docs/rollout-staleness.md for that run end to end).
Here the real GRPOTrainer runs on the tiny model with the real callback and the real sidecar;
a callback puts one recorded step of those metrics where TRL's vLLM path puts them (the
trainer's own metric buffer, averaged into the step's log by ``GRPOTrainer.log``): a healthy
engine at about 0.015 nats per token, and an engine whose weights stopped being synchronised,
the difference rising to 0.2 (the shape of a public report of vLLM sleep mode keeping stale
weights). Same run, same seed, only the series differs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from deadweight.demo import runs
from deadweight.sidecar.detectors import Verdict
from deadweight.sidecar.detectors.rollout import LOGP_DIFFERENCE, RolloutStale
from tests.support.inprocess_sidecar import TEST_SETTINGS, InProcessSidecar

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: sampling/sampling_logp_difference/mean per optimizer step.
HEALTHY = (0.0152, 0.0171, 0.0149, 0.0163, 0.0158, 0.0173, 0.0149, 0.0166, 0.0155, 0.0161)
STALE = (0.0151, 0.0168, 0.0160, 0.052, 0.118, 0.164, 0.191, 0.201, 0.199, 0.201)
#: The first step whose value is past the limit (0.1), and the step the verdict needs.
FIRST_STALE_STEP = 5
STEPS = len(STALE)


class RecordedSampling(TrainerCallback):  # type: ignore[misc]
    """One recorded step of TRL's vLLM sampling metrics per optimizer step, in the trainer's
    metric buffer, where ``_generate_and_score_completions`` appends them under vLLM."""

    def __init__(self, trainer: Any, series: tuple[float, ...]) -> None:
        self.trainer = trainer
        self.series = series

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        difference = self.series[state.global_step - 1]
        metrics = self.trainer._metrics["train"]
        metrics[LOGP_DIFFERENCE].append(difference)
        metrics["sampling/sampling_logp_difference/max"].append(15 * difference)
        metrics["sampling/importance_sampling_ratio/min"].append(math.exp(-15 * difference))
        metrics["sampling/importance_sampling_ratio/mean"].append(math.exp(-difference))
        metrics["sampling/importance_sampling_ratio/max"].append(math.exp(15 * difference))


def _run(live: InProcessSidecar, tiny: tuple[Path, Path], out: Path, run_id: str,
         series: tuple[float, ...]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny
    trainer = runs.grpo_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir, out,
                                [live.callback(run_id)], steps=STEPS, save_steps=100,
                                peft_config=runs.lora_config())
    trainer.add_callback(RecordedSampling(trainer, series))
    trainer.train()
    run = live.seen(run_id)
    logged = [v for _, v in run.history(LOGP_DIFFERENCE)]
    assert logged == pytest.approx(series)  # every step's value reached the sidecar
    return live.fired(run_id)


def test_stale_rollouts_fire_and_healthy_twin_is_silent(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    stale = _run(live, tiny, tmp_path / "stale", "rollout-stale", STALE)
    healthy = _run(live, tiny, tmp_path / "healthy", "rollout-healthy", HEALTHY)
    assert set(stale) - set(healthy) == {"rollout_stale"}
    assert "rollout_stale" not in healthy
    finding = stale["rollout_stale"]
    assert finding.severity == "warning" and finding.policy == "page"
    needed = FIRST_STALE_STEP + TEST_SETTINGS.rollout_stale_logs - 1
    assert finding.step == needed
    assert float(finding.evidence["baseline"]) == pytest.approx(0.016, abs=1e-3)
    assert float(finding.evidence["importance_sampling_ratio_mean"]) < 0.9
    assert "stale weights" in finding.summary
    print(f"rollout_stale: fired at step {finding.step}, "
          f"{finding.step - FIRST_STALE_STEP + 1} log reports after the difference first "
          f"crossed {TEST_SETTINGS.rollout_logp_difference}")
    # Judged on the healthy run (not None: the keys were there) and silent.
    run = live.seen("rollout-healthy")
    assert RolloutStale().evaluate(run, TEST_SETTINGS) == Verdict(False, step=STEPS)
