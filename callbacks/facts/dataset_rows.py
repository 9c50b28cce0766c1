"""How many training rows the trainer kept of those it was given.

TRL drops examples during its own preparation (prompts that fill ``max_length``, examples that
truncation left without a trained token) and says nothing. ``datasets`` filters by keeping an
index over the unchanged table, so the prepared dataset still knows how many rows it came from.
"""

from __future__ import annotations

from typing import Any


def count(train_dataloader: Any) -> tuple[int, int] | None:
    """(rows given, rows kept), or None when the data cannot tell (no index, not a Dataset)."""
    dataset = getattr(train_dataloader, "dataset", None)
    if getattr(dataset, "_indices", None) is None:
        return None
    given = getattr(getattr(dataset, "data", None), "num_rows", None)
    try:
        kept = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not isinstance(given, int) or given < kept:
        return None
    return given, kept
