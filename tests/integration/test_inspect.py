"""``deadweight inspect``: the offline gate on real checkpoints, its output and exit codes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo import runs
from deadweight.sidecar.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real checkpoints: a healthy SFT run's two saves, and the adapter it started from."""
    folder = tmp_path_factory.mktemp("inspect")
    model_dir, adapter_dir = runs.prepare(folder, "qwen2")
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    runs.sft_trainer(model, model_dir, folder / "out", [], steps=4, save_steps=2).train()
    return {"initial": adapter_dir, "model": model_dir,
            "c2": folder / "out" / "checkpoint-2", "c4": folder / "out" / "checkpoint-4"}


def test_healthy_checkpoints_pass(trained: dict[str, Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", str(trained["c2"]), str(trained["c4"]),
                 "--initial", str(trained["initial"])])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("ok    ") == 2 and "2 checkpoint(s) inspected, 0 with findings" in out


def test_the_output_folder_stands_for_its_checkpoints(
        trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``deadweight inspect OUTPUT_DIR``: the trainer's output folder holds no weights of its
    own; its checkpoint-<step> folders are inspected, by step, with a fix for each finding."""
    out = trained["c2"].parent
    code = main(["inspect", str(out), "--initial", str(trained["initial"])])
    listed = capsys.readouterr().out
    assert code == 0, listed
    assert "2 checkpoint(s) inspected, 0 with findings" in listed
    assert listed.index(str(trained["c2"])) < listed.index(str(trained["c4"]))
    # A copy of the last save beside them: the copy fails, and says what to do.
    shutil.copytree(out, tmp_path / "out", ignore=shutil.ignore_patterns("checkpoint-2"))
    shutil.copytree(trained["c4"], tmp_path / "out" / "checkpoint-6")
    code = main(["inspect", str(tmp_path / "out")])
    listed = capsys.readouterr().out
    assert code == 1, listed
    assert f"FAIL  {tmp_path / 'out' / 'checkpoint-6'}" in listed
    assert "checkpoint_unchanged [critical]" in listed
    assert "        fix: Fix the root cause (usually `is_trainable=True`), retrain" in listed


def test_a_copy_of_the_previous_checkpoint_fails(trained: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "checkpoint-10"  # a glob lists it before checkpoint-4: sorted by step
    shutil.copytree(trained["c4"], copy)
    code = main(["inspect", str(copy), str(trained["c4"])])
    out = capsys.readouterr().out
    assert code == 1
    assert f"FAIL  {copy}" in out and "checkpoint_unchanged [critical]" in out
    assert "same_as=previous" in out
    assert out.index(str(trained["c4"])) < out.index(str(copy))


def test_the_initial_adapter_resaved_fails(trained: dict[str, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", str(trained["initial"]), "--initial", str(trained["initial"])])
    assert code == 1 and "same_as=initial" in capsys.readouterr().out


def test_untrained_bloated_and_pickled_adapters_fail(trained: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(trained["model"])
    base.resize_token_embeddings(base.config.vocab_size + 8)
    fresh = get_peft_model(base, runs.lora_config())
    fresh.save_pretrained(tmp_path / "fresh")  # lora_B all zero; embedding saved (resized)
    fresh.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    code = main(["inspect", str(tmp_path / "fresh"), str(tmp_path / "pickled")])
    out = capsys.readouterr().out
    assert code == 1
    assert "adapter_never_trained [critical]" in out and "moved_modules=0" in out
    assert "adapter_bloat [warning]" in out and "embed_tokens" in out
    assert "pickle_checkpoint [warning]" in out and "pickle_files=adapter_model.bin" in out


def test_a_path_that_is_not_a_checkpoint_exits_2_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.cli", "inspect", str(tmp_path / "empty")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "deadweight inspect:" in result.stderr and "adapter_model.safetensors" in result.stderr
