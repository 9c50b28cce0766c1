"""Verdicts where users already look, and the promotion gate, on real SFT runs.

The trainer's own TensorBoard integration must hold the ``deadweight/*`` keys (read back from
the event files), and ``deadweight inspect`` must refuse the frozen run's final adapter,
accept the healthy one's, and refuse the healthy one once its bytes change.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess


def _train(tiny: tuple[Path, Path], sidecar: SidecarProcess, run_id: str, out: Path,
           trainable: bool) -> None:
    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=trainable)
    trainer = runs.sft_trainer(
        model, model_dir, out, [DeadweightCallback(address=sidecar.address, run_id=run_id)],
        steps=10, save_steps=5, report_to=["tensorboard"])
    trainer.train()
    trainer.save_model(str(out))  # the final adapter, where a pipeline would pick it up


def _scalars(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[float]] = {}
    for events in logdir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend(e.value for e in accumulator.Scalars(tag))
    return found


def _inspect(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", "inspect", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_loggers_show_the_verdict_and_the_gate_rejects_the_frozen_adapter(
    sidecar: SidecarProcess, tiny: tuple[Path, Path], tmp_path: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    frozen_out, healthy_out = tmp_path / "frozen", tmp_path / "healthy"
    with caplog.at_level(logging.DEBUG, logger="deadweight"):
        _train(tiny, sidecar, "loggers-frozen", frozen_out, trainable=False)
        _train(tiny, sidecar, "loggers-healthy", healthy_out, trainable=True)
    # At train end the output folder holds only checkpoint folders: its summary is the run's
    # record, unsigned, and no warning says a gate would refuse an adapter that is not there.
    unsigned = [r for r in caplog.records if "is not signed" in r.getMessage()]
    assert unsigned and all(r.levelno == logging.DEBUG for r in unsigned), [
        r.getMessage() for r in unsigned]
    assert all("no adapter files in this folder" in r.getMessage() for r in unsigned)
    for out in (frozen_out, healthy_out):  # every adapter the runs wrote: signed
        for folder in (out, out / "checkpoint-5", out / "checkpoint-10"):
            document = json.loads((folder / "deadweight-summary.json").read_text())
            assert document["signature"] is not None, (folder, document)

    frozen = _scalars(frozen_out)
    assert frozen["train/deadweight/update_ratio"] and set(
        frozen["train/deadweight/update_ratio"]) == {0.0}
    assert max(frozen["train/deadweight/firing/frozen_weights"]) == 1.0
    assert max(frozen["train/deadweight/findings"]) >= 1.0
    healthy = _scalars(healthy_out)
    assert min(healthy["train/deadweight/update_ratio"]) > 0.0
    assert set(healthy["train/deadweight/findings"]) == {0.0}
    assert not [tag for tag in healthy if "deadweight/firing/" in tag]

    summary = json.loads((frozen_out / "deadweight-summary.json").read_text())["summary"]
    assert summary["sidecar"] == "answered"
    assert "frozen_weights" in {v["detector"] for v in summary["verdicts"]}
    assert (frozen_out / "checkpoint-10" / "deadweight-summary.json").is_file()

    rejected = _inspect(frozen_out)
    assert rejected.returncode == 1, rejected.stdout
    assert "run_has_critical_verdict" in rejected.stdout
    accepted = _inspect(healthy_out)
    assert accepted.returncode == 0, accepted.stdout

    adapter = healthy_out / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor: a different adapter than the run produced
    adapter.write_bytes(bytes(data))
    tampered = _inspect(healthy_out)
    assert tampered.returncode == 1, tampered.stdout
    assert "adapter_not_what_the_run_produced" in tampered.stdout
