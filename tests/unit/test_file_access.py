"""Weight files a save wrote 0600 become group-readable, as the umask allows, and nothing else
changes: the sidecar of another uid reads checkpoints and adapters through the group."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deadweight.callbacks.file_access import share_with_group, umask


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint folder as PEFT and the Trainer write it: safetensors files (0600 since
    safetensors 0.8, whatever the umask), a named adapter's subfolder, JSON beside them."""
    folder = tmp_path / "checkpoint-4"
    (folder / "second").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(folder / "adapter_model.safetensors"))
    save_file({"w": torch.ones(2)}, str(folder / "second" / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text("{}")
    os.chmod(folder / "adapter_config.json", 0o600)
    yield folder


def test_safetensors_files_get_group_read_and_nothing_else(checkpoint: Path) -> None:
    weights = [checkpoint / "adapter_model.safetensors",
               checkpoint / "second" / "adapter_model.safetensors"]
    assert [_mode(p) for p in weights] == [0o600, 0o600]  # what the save left
    assert share_with_group(checkpoint) == 2
    assert [_mode(p) for p in weights] == [0o640, 0o640]  # group read, never others'
    assert _mode(checkpoint / "adapter_config.json") == 0o600  # not a weight file
    assert share_with_group(checkpoint) == 0  # nothing left to change


def test_a_private_umask_keeps_the_files_private(checkpoint: Path) -> None:
    previous = os.umask(0o077)
    try:
        assert umask() == 0o077
        assert share_with_group(checkpoint) == 0
    finally:
        os.umask(previous)
    assert _mode(checkpoint / "adapter_model.safetensors") == 0o600


def test_a_link_out_of_the_folder_is_not_followed(checkpoint: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.zeros(1)}, str(outside))
    (checkpoint / "link.safetensors").symlink_to(outside)
    share_with_group(checkpoint)
    assert _mode(outside) == 0o600


def test_a_missing_folder_changes_nothing_and_never_raises(tmp_path: Path) -> None:
    assert share_with_group(tmp_path / "gone") == 0
