"""The optional facts of the callback's RunStart: a fact that cannot be gathered is left out,
never the run (monitoring stays on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deadweight.callbacks import dataset_rows, resume
from deadweight.callbacks.callback import _optional_fact


def test_an_unreadable_resumed_checkpoint_leaves_the_fact_out(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{not json")
    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error type
        resume.check(str(tmp_path), 4)
    assert _optional_fact(resume.check, str(tmp_path), 4) is None
    assert resume.check(str(tmp_path), 0) is None  # a run that starts at step 0
    assert resume.check(str(tmp_path), 5) is None  # no such checkpoint folder


def test_dataset_rows_need_a_filtered_dataset() -> None:
    from datasets import Dataset
    from torch.utils.data import DataLoader

    data = Dataset.from_dict({"x": list(range(10))})
    assert dataset_rows.count(DataLoader(data)) is None  # never filtered: nothing to compare
    kept = data.filter(lambda row: row["x"] % 2 == 0)
    assert dataset_rows.count(DataLoader(kept)) == (10, 5)
    assert dataset_rows.count(DataLoader(list(range(3)))) is None  # not a datasets.Dataset
