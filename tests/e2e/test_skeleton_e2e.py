"""The walking skeleton, end to end: real TRL trainers, a real sidecar process, a real socket.

The failure: a LoRA adapter loaded with ``PeftModel.from_pretrained`` (is_trainable left
False). Its optimizer is empty, yet loss and grad_norm move. The controls: a fresh LoRA via
``peft_config``, and the same adapter loaded with ``is_trainable=True``, with warmup so that
step 1 runs at lr 0.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from deadweight.callbacks import DeadweightCallback
from deadweight.demo import runs
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from tests.conftest import MetricsProbe

pytestmark = pytest.mark.slow

TRAINERS = ["grpo", "sft"]


def _trainer(kind: str, model: object, model_dir: Path, out: Path, callbacks: list[object],
             **kw: object) -> object:
    build = runs.grpo_trainer if kind == "grpo" else runs.sft_trainer
    return build(model, model_dir, out, callbacks, **kw)  # type: ignore[arg-type]


def _findings(sidecar: SidecarProcess, run_id: str) -> dict[str, pb.Finding]:
    run = sidecar.run_status(run_id)
    assert run is not None, f"sidecar never saw run {run_id}"
    return {f.detector: f for f in run.findings}


@pytest.mark.parametrize("kind", TRAINERS)
def test_frozen_adapter_is_caught_while_running(
    kind: str, tiny: tuple[Path, Path], sidecar: SidecarProcess, tmp_path: Path
) -> None:
    model_dir, adapter_dir = tiny
    run_id = f"f1-{kind}-observe"
    probe = MetricsProbe(sidecar, run_id)
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id)
    trainer = _trainer(kind, model, model_dir, tmp_path, [callback, probe.callback], steps=8)
    trainer.train()  # type: ignore[attr-defined]

    assert trainer.state.global_step == 8  # type: ignore[attr-defined]  # page only: no stop
    findings = _findings(sidecar, run_id)
    assert findings["empty_optimizer"].step == 0  # before optimizer step 1
    assert findings["empty_optimizer"].evidence["optimizer_params"] == "0"
    assert 1 <= findings["frozen_weights"].step <= 3
    assert findings["frozen_weights"].evidence["update_norm"] == "0"
    assert probe.max_firing.get("empty_optimizer") == 1.0
    assert probe.max_firing.get("frozen_weights") == 1.0
    # Still firing once the run ended (a run's end resolves nothing): the alert outlives it.
    assert findings["frozen_weights"].firing
    assert findings["frozen_weights"].state == "firing at end"


@pytest.mark.parametrize("kind", TRAINERS)
def test_stop_policy_ends_the_frozen_run_early(
    kind: str, tiny: tuple[Path, Path], stopping_sidecar: SidecarProcess, tmp_path: Path
) -> None:
    model_dir, adapter_dir = tiny
    run_id = f"f1-{kind}-stop"
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    callback = DeadweightCallback(address=stopping_sidecar.address, run_id=run_id)
    trainer = _trainer(kind, model, model_dir, tmp_path, [callback], steps=30)
    trainer.train()  # type: ignore[attr-defined]

    assert trainer.state.global_step < 30  # type: ignore[attr-defined]
    findings = _findings(stopping_sidecar, run_id)
    assert findings["frozen_weights"].policy == "stop"
    assert stopping_sidecar.metrics().count(
        f'deadweight_actions_total{{action="stop",detector="frozen_weights",result="sent",'
        f'run_id="{run_id}"'
    ) == 1


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("setup", ["fresh_lora", "adapter_trainable"])
def test_healthy_controls_stay_silent(
    kind: str, setup: str, tiny: tuple[Path, Path], sidecar: SidecarProcess, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, adapter_dir = tiny
    run_id = f"healthy-{kind}-{setup}"
    probe = MetricsProbe(sidecar, run_id)
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id)
    if setup == "fresh_lora":
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        extra = {"peft_config": runs.lora_config()}
    else:
        model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
        extra = {}
    if kind == "grpo":  # a healthy policy ends some completions
        extra.update(runs.terminating(model_dir))
    trainer = _trainer(kind, model, model_dir, tmp_path, [callback, probe.callback],
                       steps=8, warmup=2, **extra)
    trainer.train()  # type: ignore[attr-defined]

    assert trainer.state.global_step == 8  # type: ignore[attr-defined]
    assert _findings(sidecar, run_id) == {}
    assert {"empty_optimizer", "frozen_weights"} <= set(probe.max_firing)
    assert set(probe.max_firing.values()) == {0.0}, probe.max_firing
    step_lines = [line for line in sidecar.metrics().splitlines()
                  if line.startswith(f'deadweight_step{{rank="0",run_id="{run_id}"')]
    assert step_lines and step_lines[0].endswith(" 8.0")


def test_no_sidecar_training_completes_saying_so_at_begin_and_end(
    tiny: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning when the run starts (not at its end, glued to the last progress bar),
    and the end's summary says the run was never judged; nothing else."""
    from deadweight.callbacks.callback import console_log

    model_dir, adapter_dir = tiny
    missing = tmp_path / "nobody-listens.sock"
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    callback = DeadweightCallback(address=f"unix://{missing}", run_id="orphan",
                                  start_timeout_seconds=0.2)
    trainer = runs.sft_trainer(model, model_dir, tmp_path / "out", [callback], steps=4)
    console_log.addHandler(caplog.handler)  # deadweight's own console logger does not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="deadweight"):
            trainer.train()
    finally:
        console_log.removeHandler(caplog.handler)
    assert trainer.state.global_step == 4
    records = {id(r): r for r in caplog.records  # once each
               if r.name in ("deadweight", console_log.name)}
    said = [r.getMessage() for r in records.values()]
    assert len(said) == 2, said
    assert "no sidecar answers" in said[0] and "run orphan is NOT monitored" in said[0]
    assert "run orphan ended (completed) at step 4 NOT monitored" in said[1]


# A leaked exception in one of grpc's threads (the channel closed under its connectivity
# poller) fails the test instead of passing with a warning.
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_require_sidecar_fails_fast(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    callback = DeadweightCallback(address=f"unix://{tmp_path}/none.sock", run_id="strict",
                                  require_sidecar=True, start_timeout_seconds=0.2)
    trainer = runs.sft_trainer(model, model_dir, tmp_path / "out", [callback], steps=2)
    with pytest.raises(RuntimeError, match="require_sidecar"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_environment_configures_the_callback(
    sidecar: SidecarProcess, tiny: tuple[Path, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir, adapter_dir = tiny
    monkeypatch.setenv("DEADWEIGHT_ADDRESS", sidecar.address)
    monkeypatch.setenv("DEADWEIGHT_RUN_ID", "from-environment")
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    trainer = runs.sft_trainer(model, model_dir, tmp_path, [DeadweightCallback()], steps=2)
    trainer.train()
    run = sidecar.run_status("from-environment")
    assert run is not None and run.step == 2 and run.trainer == "SFTTrainer"


@pytest.mark.parametrize("where", ["train_begin", "optimizer_step"])
def test_a_failure_of_ours_turns_monitoring_off_not_training(
    where: str, tiny: tuple[Path, Path], sidecar: SidecarProcess, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from deadweight.callbacks import callback as callback_module

    def broken(*args: object, **kwargs: object) -> object:
        raise ValueError("a probe bug")

    target = ("digest_adapter" if where == "train_begin" else "grads_outside_optimizer")
    owner = callback_module.digest if where == "train_begin" else callback_module.membership
    monkeypatch.setattr(owner, target, broken)
    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    callback = DeadweightCallback(address=sidecar.address, run_id=f"shielded-{where}")
    trainer = runs.sft_trainer(model, model_dir, tmp_path, [callback], steps=4)
    with caplog.at_level(logging.ERROR, logger="deadweight"):
        trainer.train()
    assert trainer.state.global_step == 4
    errors = [r for r in caplog.records if r.name == "deadweight" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "monitoring is off" in errors[0].getMessage()
