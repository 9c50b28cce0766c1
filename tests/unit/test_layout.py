"""The wrapper a Trainer config asks for, read from real ``TrainingArguments``.

FSDP and DeepSpeed cannot run through the Trainer on this CPU machine (FSDP2 falls back to
DDP, FSDP1 refuses to start, accelerate never selects DeepSpeed), so the request side is
checked here on the config objects; ``test_trainer_wrapper`` checks the running side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deadweight.callbacks.layout import requested_wrapper


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"fsdp": "full_shard", "fsdp_config": {"version": 2}}, "fsdp2"),
        ({"fsdp": "full_shard", "fsdp_config": {"version": 1}}, "fsdp1"),
        ({"fsdp": "full_shard"}, "fsdp2"),  # transformers 5's default version
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "deepspeed"),
        ({}, ""),
    ],
)
def test_requested_wrapper(overrides: dict[str, Any], expected: str, tmp_path: Path) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), **overrides)
    assert requested_wrapper(args) == expected
