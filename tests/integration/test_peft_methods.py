"""Every PEFT method trained for real: the live sidecar stays silent, ``deadweight inspect``
fails the untrained adapter and passes the trained one, and frozen variants are caught.

Each method's adapter is built on the session's tiny model and saved before training (its
untrained form), then trained by a real SFTTrainer against the in-process sidecar, which
inspects both checkpoints from disk. Methods with a random start (prompt and prefix tuning)
have no untrained identity: an unchanged save is their evidence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from deadweight.sidecar.commands.cli import main
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj"]
#: Methods whose untrained adapter is the identity (inspect alone fails it).
WITH_IDENTITY = ("lora", "dora", "adalora", "ia3", "loha", "lokr", "vera", "oft")


def peft_config(method: str) -> Any:
    import peft

    configs: dict[str, Any] = {
        "lora": lambda: peft.LoraConfig(r=4, target_modules=TARGETS),
        "dora": lambda: peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True),
        "adalora": lambda: peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=TARGETS,
                                              total_step=4, tinit=1, tfinal=1, deltaT=1),
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                      feedforward_modules=["down_proj"]),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=TARGETS),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=TARGETS),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=TARGETS),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=TARGETS),
        "prompt": lambda: peft.PromptTuningConfig(num_virtual_tokens=4),
        "prefix": lambda: peft.PrefixTuningConfig(num_virtual_tokens=4),
    }
    config = configs[method]()
    config.task_type = "CAUSAL_LM"
    return config


def fresh(model_dir: Path, method: str, untrained: Path) -> Any:
    """The method's adapter on the base model, saved untrained to untrained/."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), peft_config(method))
    model.save_pretrained(untrained)
    return model


def inspect(*paths: Path, initial: Path | None = None) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    argv = ["inspect", *map(str, paths), *(["--initial", str(initial)] if initial else [])]
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.mark.parametrize("method", [*WITH_IDENTITY, "prompt", "prefix"])
def test_method_trains_silently_and_inspect_tells_untrained_from_trained(
    method: str, live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, _ = tiny
    untrained = tmp_path / "untrained"
    model = fresh(model_dir, method, untrained)
    run_id = f"method-{method}"
    extra = [runs.AdaloraAllocator()] if method == "adalora" else []
    # Prefix tuning feeds past key values, which gradient checkpointing turns off (it fails
    # loudly: attention mask and keys differ in length).
    overrides = {"gradient_checkpointing": False} if method == "prefix" else {}
    trainer = runs.sft_trainer(model, model_dir, tmp_path / "out",
                               [live.callback(run_id), *extra], steps=4, save_steps=2,
                               **overrides)
    trainer.train()
    run = live.wait_inspected(run_id, 2)

    assert live.fired(run_id) == {}, {k: f.summary for k, f in live.fired(run_id).items()}
    assert len({p.digest for p in run.checkpoints}) == 2
    inspection = run.checkpoints[-1].inspection
    assert inspection is not None and inspection.non_adapter == ()
    assert inspection.adapter_params > 0
    if method in WITH_IDENTITY:
        assert inspection.moved_modules == inspection.identity_modules > 0

    c2, c4 = tmp_path / "out" / "checkpoint-2", tmp_path / "out" / "checkpoint-4"
    code, out = inspect(c2, c4, initial=untrained)
    assert code == 0, out
    code, out = inspect(untrained)
    if method in WITH_IDENTITY:
        assert code == 1 and "adapter_never_trained [critical]" in out, out
        assert "moved_modules=0" in out
    else:  # a random start: only a comparison with the initial adapter can tell
        assert code == 0, out
        code, out = inspect(untrained, initial=untrained)
        assert code == 1 and "same_as=initial" in out, out


@pytest.mark.parametrize("method", ["ia3", "loha", "prompt"])
def test_frozen_reload_is_caught(method: str, live: InProcessSidecar, tiny: tuple[Path, Path],
                                 tmp_path: Path) -> None:
    """The adapter reloaded without is_trainable: nothing trains, under any method.

    PEFT 0.21 leaves a reloaded prompt encoder trainable (``set_requires_grad`` does not
    apply to prompt learning), so its frozen variant is the other common line: every
    parameter frozen after loading (``requires_grad_(False)`` on the whole model).
    """
    model_dir, _ = tiny
    untrained = tmp_path / "untrained"
    fresh(model_dir, method, untrained)
    model = runs.load_adapter(model_dir, untrained, trainable=False)
    if method == "prompt":
        assert all(p.requires_grad for p in model.prompt_encoder.parameters())
        model.requires_grad_(False)
    run_id = f"frozen-{method}"
    runs.sft_trainer(model, model_dir, tmp_path / "out", [live.callback(run_id)], steps=4,
                     save_steps=2).train()
    run = live.wait_inspected(run_id, 2)
    fired = live.fired(run_id)
    assert fired["empty_optimizer"].evidence["optimizer_params"] == "0"
    assert fired["checkpoint_unchanged"].evidence["same_as"] == "previous (step 2)"
    assert [p.unchanged_from for p in run.checkpoints] == ["initial", "previous (step 2)"]
    if method != "prompt":
        assert fired["adapter_never_trained"].evidence["method"] == method.upper()
    code, out = inspect(tmp_path / "out" / "checkpoint-2", tmp_path / "out" / "checkpoint-4",
                        initial=untrained)
    assert code == 1 and "same_as=initial" in out and "same_as=previous" in out
