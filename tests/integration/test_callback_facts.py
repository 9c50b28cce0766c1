"""The optional facts of the callback's RunStart: a fact that cannot be gathered is left out,
never the run (monitoring stays on)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from deadweight.callbacks.callback import _optional_fact
from deadweight.callbacks.facts import dataset_rows, resume

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 12345  # a job's uid that owns nothing here


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


def test_a_base_model_path_the_file_system_refuses_leaves_the_run_monitored(
    live: Any, tiny: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The adapter's base_model_name_or_path names a folder whose stat fails even for root
    (a name longer than the file system allows): the vocabulary fact goes missing with one
    warning, and the run is still registered and watched step by step."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from deadweight.demo import runs

    model_dir, _ = tiny
    refused = str(tmp_path / ("n" * 300))
    with pytest.raises(OSError, match="too long"):
        (Path(refused) / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.name_or_path = refused  # what PEFT records as the adapter's base_model_name_or_path
    config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=runs.LORA_TARGETS)
    run_id = "base-config-refused"
    trainer = runs.sft_trainer(model, model_dir, tmp_path / "out", [live.callback(run_id)],
                               steps=2, save_steps=2, peft_config=config)
    with caplog.at_level(logging.WARNING, logger="deadweight"):
        trainer.train()

    run = live.seen(run_id)
    assert run.start is not None and run.start.preflight.is_peft
    assert run.start.preflight.base_vocab_size == 0  # the missing fact
    assert live.steps(run_id) == [1, 2]
    warned = [r for r in caplog.records if "config.json" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if "_begin failed" in r.getMessage()]


def test_a_base_model_folder_the_job_may_not_enter_is_a_missing_fact() -> None:
    """As a job running under another uid: the base model's folder sits in a directory it may
    not enter, so looking for config.json raises PermissionError; preflight reports no config
    and a warning instead of failing."""
    with tempfile.TemporaryDirectory() as folder:  # pytest's own folders are closed to others
        _config_as_another_uid(Path(folder))


def _config_as_another_uid(folder: Path) -> None:
    folder.chmod(0o755)
    private = folder / "private"
    (private / "base").mkdir(parents=True)
    (private / "base" / "config.json").write_text('{"vocab_size": 320}')
    private.chmod(0o700)
    script = ("import sys\n"
              "from deadweight.callbacks.facts import preflight\n"
              "path = sys.argv[1]\n"
              "print(preflight.config_file(path), preflight._base_vocab_size(path))\n")
    argv = ["setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups",
            sys.executable, "-c", script, str(private / "base")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "0"]
    assert done.stderr.count("cannot be read") == 1 and "Permission denied" in done.stderr
