"""Does the loss ever train the stop token? One collated batch of the first rows tells.

With ``pad_token == eos_token`` transformers' language-modelling collator masks every label
equal to the pad id, eos included; a chat template or completion mask can leave the end-of-turn
token outside the loss. Either way the loss looks healthy and the model never learns to stop.
The check runs the trainer's own collator on the first rows (indexing, not the sampler, so the
run's data order is untouched) and counts the stop tokens in the inputs and in the labels,
and the real tokens the loss leaves out (a prompt outside a completion-only loss: the run
trains answers that must end, where raw-text pre-training trains every token).
The stop tokens are the tokenizer's eos and every id the model's generation config stops on
(a chat model stops on its end-of-turn token, which may differ from eos): the loss trains the
stop when any of them is a label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Rows collated for the check.
ROWS = 8
#: The label of a position the loss leaves out (transformers' and TRL's convention).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class StopTokenFacts:
    token: str
    token_id: int
    sequences: int
    in_inputs: int
    in_labels: int
    #: Sequences without padding (every one of them: fixed-length packed blocks).
    full_rows: int = 0
    #: Real tokens the loss leaves out (label -100): a prompt or template outside a
    #: completion-only loss. 0 when every real token is trained (raw text, pre-training).
    outside_loss: int = 0


def stop_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The tokenizer's eos id first, then the generation config's other stop ids."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for candidate in [getattr(tokenizer, "eos_token_id", None),
                      *(configured if isinstance(configured, list | tuple) else [configured])]:
        if isinstance(candidate, int) and candidate not in ids:
            ids.append(candidate)
    return ids


def _token_text(tokenizer: Any, token_id: int) -> str:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    text = convert(token_id) if callable(convert) else None
    return str(text) if isinstance(text, str) else str(getattr(tokenizer, "eos_token", ""))


def check(train_dataloader: Any, processing_class: Any, model: Any = None,
          rows: int = ROWS) -> StopTokenFacts | None:
    """The counts for the run's data, or None when the batch has no labels (DPO, GRPO, ...)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    ids = stop_ids(tokenizer, model)
    dataset = getattr(train_dataloader, "dataset", None)
    collate = getattr(train_dataloader, "collate_fn", None)
    if not ids or collate is None or dataset is None:
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
    stops = torch.tensor(ids, dtype=inputs.dtype)
    in_inputs = torch.isin(inputs, stops) & real
    # The stop token named: the one the inputs hold most (eos when none appears).
    token_id = max(ids, key=lambda i: (int(((inputs == i) & real).sum()), i == ids[0]))
    return StopTokenFacts(
        token=_token_text(tokenizer, token_id),
        token_id=token_id,
        sequences=int(inputs.shape[0]),
        in_inputs=int(in_inputs.sum()),
        in_labels=int(torch.isin(labels, stops).sum()),
        full_rows=int(real.all(dim=-1).sum()) if real.dim() == 2 else 0,
        outside_loss=int(((labels == IGNORE_INDEX) & real).sum()),
    )
