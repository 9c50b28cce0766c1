"""Where a save put the adapter a run trains, so its run summary lies beside those files.

PEFT's ``save_pretrained`` writes an adapter not named "default" into a folder of its name
inside the save's folder (``checkpoint-4/second/``); the folder itself then holds the
"default" adapter, which this run did not train. The summary describes the active adapter's
bytes, and the sidecar signs only bytes it read there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The files a save of an adapter writes (safetensors, or the pickle of an unsafe save).
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def active_adapter(model: Any) -> str:
    """The name of the adapter a PEFT model trains ("default" for any other model)."""
    if not isinstance(getattr(model, "peft_config", None), dict):
        return "default"
    active = getattr(model, "active_adapter", "default")
    return active if isinstance(active, str) else "default"


def adapter_home(folder: Path, model: Any) -> Path:
    """folder/<name> when the model trains a named adapter and the save put it there, else
    folder."""
    name = active_adapter(model)
    if name in ("default", "", ".", "..") or Path(name).name != name:
        return folder
    named = folder / name
    return named if any((named / f).is_file() for f in ADAPTER_FILES) else folder
