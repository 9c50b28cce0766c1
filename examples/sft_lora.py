"""A complete LoRA fine-tune with deadweight watching, runnable as it is on a CPU.

    python examples/sft_lora.py                      # a tiny model built locally, healthy run
    python examples/sft_lora.py --frozen             # the silent failure: adapter not trainable
    python examples/sft_lora.py --model PATH         # your own causal LM folder instead

Start a sidecar first (``deadweight serve --socket /tmp/dw.sock``) and point the callback at it
with ``DEADWEIGHT_ADDRESS=unix:///tmp/dw.sock``; without one, training runs and the callback
says at train begin that the run is NOT monitored. The only deadweight line is
``callbacks=[DeadweightCallback()]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from deadweight.callbacks import DeadweightCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a local causal LM folder")
    parser.add_argument("--frozen", action="store_true",
                        help="reload the adapter without is_trainable=True (the silent failure)")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="deadweight-example-"))

    model_dir = args.model
    if model_dir is None:  # a ~100k-parameter model and tokenizer, built here in seconds
        from deadweight.demo.tiny_models import build_model

        model_dir = build_model(work / "tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    if args.frozen:  # save, then reload the way many scripts do: is_trainable defaults to False
        model.save_pretrained(work / "adapter")
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        model = PeftModel.from_pretrained(base, work / "adapter")

    texts = [f"the number {i} comes after {i - 1} and before {i + 1}." for i in range(1, 65)]
    trainer = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"text": texts}),
        args=SFTConfig(output_dir=str(work / "run"), max_steps=args.steps, learning_rate=2e-4,
                       per_device_train_batch_size=4, logging_steps=1, save_steps=args.steps,
                       report_to="none", use_cpu=True, max_length=32),
        callbacks=[DeadweightCallback()],  # the one line
    )
    trainer.train()
    print(f"done: {work / 'run'}")


if __name__ == "__main__":
    main()
