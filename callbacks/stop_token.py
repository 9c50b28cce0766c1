"""Does the loss ever train the stop token? One collated batch of the first rows tells.

With ``pad_token == eos_token`` transformers' language-modelling collator masks every label
equal to the pad id, eos included; a chat template or completion mask can leave the end-of-turn
token outside the loss. Either way the loss looks healthy and the model never learns to stop.
The check runs the trainer's own collator on the first rows (indexing, not the sampler, so the
run's data order is untouched) and counts the stop token in the inputs and in the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Rows collated for the check.
ROWS = 8


@dataclass(frozen=True)
class StopTokenFacts:
    token: str
    token_id: int
    sequences: int
    in_inputs: int
    in_labels: int


def check(train_dataloader: Any, processing_class: Any, rows: int = ROWS) -> StopTokenFacts | None:
    """The counts for the run's data, or None when the batch has no labels (DPO, GRPO, ...)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    token_id = getattr(tokenizer, "eos_token_id", None)
    dataset = getattr(train_dataloader, "dataset", None)
    collate = getattr(train_dataloader, "collate_fn", None)
    if not isinstance(token_id, int) or collate is None or dataset is None:
        return None
    try:
        count = min(rows, len(dataset))
        batch = collate([dataset[i] for i in range(count)])
    except Exception:  # an iterable dataset, a collator that needs more: no check, no harm
        return None
    labels = batch.get("labels") if hasattr(batch, "get") else None
    inputs = batch.get("input_ids") if hasattr(batch, "get") else None
    if not isinstance(labels, torch.Tensor) or not isinstance(inputs, torch.Tensor):
        return None
    if labels.shape != inputs.shape:
        return None
    mask = batch.get("attention_mask")
    real = mask.bool() if isinstance(mask, torch.Tensor) and mask.shape == inputs.shape else (
        torch.ones_like(inputs, dtype=torch.bool))
    return StopTokenFacts(
        token=str(getattr(tokenizer, "eos_token", "")),
        token_id=token_id,
        sequences=int(inputs.shape[0]),
        in_inputs=int(((inputs == token_id) & real).sum()),
        in_labels=int((labels == token_id).sum()),
    )
