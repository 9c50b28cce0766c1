"""A run that trains a named adapter (``add_adapter`` + ``set_adapter``) gets its signed
summary beside that adapter's files, and the gate passes it.

PEFT saves an adapter not named "default" into ``checkpoint-N/<name>/``; the checkpoint's
own folder holds the "default" adapter, which this run did not train. Before, the summary
went to the checkpoint's folder: the sidecar refused to sign it (its files are not the
digest the run claimed), the console warned that the summary is not signed, and the named
adapter had no summary for the gate to read.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from deadweight.demo import runs
from deadweight.proto import run_summary
from deadweight.sidecar.commands.cli import main
from tests.support.healthy_recipes import console, corpus_sidecar

pytestmark = pytest.mark.slow


def _gate(*argv: str | Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["inspect", *map(str, argv)])
    return code, out.getvalue()


def test_a_named_adapter_gets_its_signed_summary_beside_its_own_files(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny
    live = corpus_sidecar(tmp_path / "sidecar")
    try:
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               runs.lora_config())
        model.add_adapter("second", runs.lora_config())
        model.set_adapter("second")
        trainer = runs.sft_trainer(model, model_dir, tmp_path / "out",
                                   [live.callback("named-adapter")], steps=2, save_steps=2)
        with console() as shown:
            trainer.train()
    finally:
        live.stop()

    checkpoint = tmp_path / "out" / "checkpoint-2"
    named = checkpoint / "second"
    document = json.loads((named / run_summary.FILE_NAME).read_text())
    assert document["signature"]["algorithm"] == "ed25519"  # the sidecar read and signed
    assert document["summary"]["run_id"] == "named-adapter"
    # the default adapter at the checkpoint's top is not this run's: no summary claims it
    assert not (checkpoint / run_summary.FILE_NAME).exists()
    unsigned = [line for line in shown.lines if "not signed" in line and str(checkpoint) in line]
    assert unsigned == []
    key = tmp_path / "sidecar" / "summary-signing.pub"
    _, out = _gate(named, "--trust-key", key, "--require-signed", "--require-summary")
    # the gate reads it as this run's, over these very files (its verdicts are the run's own)
    assert "summary of run named-adapter: signature verified" in out, out
    assert not {"adapter_not_what_the_run_produced", "summary_unsigned",
                "summary_missing"} & set(out.split()), out
