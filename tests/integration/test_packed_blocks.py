"""Continued pretraining on packed blocks is not a stop-token failure.

The standard recipe (transformers' run_clm): text tokenized, concatenated and cut into
fixed 32-token blocks (``group_texts``), ``DataCollatorForLanguageModeling(mlm=False)``, a plain
``Trainer`` with LoRA. No block holds an eos and none is padded: nothing to learn to stop on,
so ``stop_token_untrained`` stays silent. The real failures (eos masked by pad == eos, an end
of turn outside the loss) are in ``test_silent_failures.py`` and still fire.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow

BLOCK = 32


def _group_texts(examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """run_clm's group_texts: concatenate, drop the remainder, cut into blocks."""
    joined = {k: list(chain.from_iterable(examples[k])) for k in examples}
    total = len(joined["input_ids"]) // BLOCK * BLOCK
    blocks = {k: [v[i:i + BLOCK] for i in range(0, total, BLOCK)] for k, v in joined.items()}
    blocks["labels"] = [list(b) for b in blocks["input_ids"]]
    return blocks


def test_packed_blocks_of_plain_text_are_not_stop_token_untrained(
        live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    from deadweight.demo.tiny_models import sample_lines

    model_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = Dataset.from_dict({"text": sample_lines(96, seed=11)})
    tokenized = lines.map(lambda rows: tokenizer(rows["text"]), batched=True,
                          remove_columns=["text"])
    blocks = tokenized.map(_group_texts, batched=True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             **runs.common_args(10, 0, 2e-4, 100))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), runs.lora_config())
    Trainer(model=model, args=args, train_dataset=blocks, processing_class=tokenizer,
            callbacks=[live.callback("packed")],
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
    run = live.seen("packed")
    check = run.start.stop_token  # type: ignore[union-attr]
    assert check.sequences == 8 and check.full_rows == 8 and check.in_inputs == 0
    assert "stop_token_untrained" not in live.fired("packed")
    assert len(run.combined_steps()) == 10
