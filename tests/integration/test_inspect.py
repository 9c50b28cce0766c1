"""``deadweight inspect``: the offline gate on real checkpoints, its output and exit codes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo import runs
from deadweight.sidecar.commands.cli import main


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


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", "inspect", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_an_output_folder_without_checkpoints_is_inspected_through_its_final_folder(
        trained: dict[str, Path], tmp_path: Path) -> None:
    """``save_strategy="no"`` and ``trainer.save_model(out/"final")``: ``inspect out/`` audits
    ``out/final`` (it exited 2, "no weights here"). Beside checkpoints, ``final/`` is audited
    on its own: the same bytes as the last checkpoint are no copy of it."""
    out = tmp_path / "out"
    shutil.copytree(trained["c4"], out / "final")
    alone = _cli(out)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert f"ok    {out / 'final'}" in alone.stdout
    assert "1 checkpoint(s) inspected" in alone.stdout
    assert "N-th path given" not in alone.stdout
    shutil.copytree(trained["c2"], out / "checkpoint-2")
    shutil.copytree(trained["c4"], out / "checkpoint-4")
    (out / "exports" / "v1").mkdir(parents=True)
    shutil.copy(trained["initial"] / "adapter_config.json", out / "exports" / "v1")
    both = _cli(out)  # exports/v1: a config without weights is a path error, said clearly
    assert both.returncode == 2 and f"{out / 'exports' / 'v1'}: no " in both.stderr, both.stderr
    shutil.rmtree(out / "exports")
    both = _cli(out, "--initial", trained["initial"])
    assert both.returncode == 0, both.stdout
    assert "3 checkpoint(s) inspected, 0 with findings" in both.stdout
    assert both.stdout.index("checkpoint-4") < both.stdout.index(str(out / "final"))
    # Control: a final adapter that is the initial one resaved still fails, audited alone.
    shutil.rmtree(out / "final")
    shutil.copytree(trained["initial"], out / "final")
    failed = _cli(out, "--initial", trained["initial"])
    assert failed.returncode == 1, failed.stdout
    assert f"FAIL  {out / 'final'}" in failed.stdout and "same_as=initial" in failed.stdout


def test_a_run_no_sidecar_judged_is_told_apart_from_a_judged_healthy_one(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A real SFT run whose callback found no sidecar: its summary holds no verdicts. The
    default gate must not read that as healthy: exit status 3 and UNJUDGED (a judged
    healthy adapter exits 0: test_gate_summary, test_trainer_loggers_and_gate)."""
    import json

    from deadweight.callbacks import DeadweightCallback

    model_dir, adapter_dir = tiny
    out = tmp_path / "out"
    trainer = runs.sft_trainer(
        runs.load_adapter(model_dir, adapter_dir, trainable=True), model_dir, out,
        [DeadweightCallback(address=f"unix://{tmp_path}/absent.sock", run_id="never-judged")],
        steps=2, save_strategy="no")
    trainer.train()
    trainer.save_model(str(out / "final"))
    summary = json.loads((out / "final" / "deadweight-summary.json").read_text())["summary"]
    assert summary["sidecar"] != "answered" and not summary["verdicts"]
    result = _cli(out)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"UNJUDGED  {out / 'final'}" in result.stdout
    assert "run_verdicts_unknown [warning]: run never-judged was never judged by a sidecar" \
        in result.stdout
    assert "1 whose run no sidecar judged (exit status 3)" in result.stdout
    # A gate that fails on warnings fails it outright.
    assert _cli(out, "--fail-on", "warning").returncode == 1
    # --help says what each exit status means.
    helped = subprocess.run([sys.executable, "-m", "deadweight.cli", "inspect", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert "3 none fails, but a run summary holds no" in " ".join(helped.stdout.split())


def test_a_path_that_is_not_a_checkpoint_exits_2_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", "inspect",
         str(tmp_path / "empty")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "deadweight inspect:" in result.stderr and "adapter_model.safetensors" in result.stderr
