"""A run resumed from a checkpoint: the adapter that checkpoint holds, to compare with memory.

The Trainer loads the checkpoint before ``on_train_begin`` (``state.global_step`` is then the
checkpoint's step); when its files are not the adapter it loads (a ``model.safetensors`` beside
the adapter wins and matches no key, an adapter saved under another name), training silently
starts again from a fresh adapter. The digest of the checkpoint's adapter file, computed the way
``digest`` computes the one in memory, lets the sidecar compare the two. The first and last loss
of the checkpoint's log history let it see a restart the digests cannot (an adapter saved under
another name, in a subfolder, while a fresh one trains): the loss is back where it started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..digest import AdapterDigest, combine, tensor_digest

ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class ResumeFacts:
    checkpoint: str
    step: int
    checkpoint_adapter: AdapterDigest
    first_loss: float = 0.0
    last_loss: float = 0.0


def _file_digest(path: Path) -> AdapterDigest:
    if not path.is_file():
        return AdapterDigest()
    from safetensors.torch import load_file

    state = load_file(str(path), device="cpu")
    tensors = {name: tensor_digest(t) for name, t in state.items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    return AdapterDigest(combine(tensors), tensors, size)


def _losses(folder: Path) -> tuple[float, float]:
    """(first, last) training loss in the checkpoint's log history; 0 where unknown."""
    try:
        history = json.loads((folder / "trainer_state.json").read_text()).get("log_history", [])
    except (OSError, ValueError, AttributeError):
        return 0.0, 0.0
    losses = [float(entry["loss"]) for entry in history if isinstance(entry, dict)
              and isinstance(entry.get("loss"), int | float)]
    return (losses[0], losses[-1]) if losses else (0.0, 0.0)


def check(output_dir: str, global_step: int) -> ResumeFacts | None:
    """Facts about the checkpoint the run resumed from, None for a run that starts at step 0."""
    if global_step <= 0:
        return None
    folder = Path(output_dir).resolve() / f"checkpoint-{global_step}"
    if not folder.is_dir():
        return None
    first, last = _losses(folder)
    return ResumeFacts(str(folder), global_step, _file_digest(folder / ADAPTER_FILE), first, last)
