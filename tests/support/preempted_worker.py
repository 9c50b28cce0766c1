"""A LoRA SFT job that a scheduler may preempt: it saves every 2 steps and, given ``resume``,
goes on from its last checkpoint, as a restarted job does.

Usage: ``python tests/support/preempted_worker.py MODEL_DIR OUT_DIR fresh|resume`` with
``DEADWEIGHT_ADDRESS`` and ``DEADWEIGHT_RUN_ID`` set (the scheduler keeps the job's name across
the restart). After each step it writes the step to ``OUT_DIR/progress`` and pauses
``PAUSE_SECONDS``, so a test can kill it mid-run. stderr is the trainer's console.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 10
PAUSE_SECONDS = 0.3


def main(model_dir: Path, out: Path, mode: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    torch.set_num_threads(1)

    class Progress(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            (out / "progress").write_text(str(state.global_step))
            time.sleep(PAUSE_SECONDS)

    trainer = runs.sft_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir, out,
                               [DeadweightCallback(), Progress()], steps=STEPS, save_steps=2,
                               peft_config=runs.lora_config())
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
