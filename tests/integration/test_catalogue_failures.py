"""Every silent failure of the catalogue, reproduced with a real TRL trainer on a tiny model.

Each test runs the real trainer with the real callback against an in-process sidecar (real
gRPC over a unix socket, real checkpoint watcher) and asserts that the detector fired with
the numbers that expose the failure. The healthy matrix in ``test_catalogue_healthy.py`` is
the control for every detector here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from deadweight.demo.tiny_models import build_model
from tests.support.inprocess_sidecar import InProcessSidecar
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def qwen(tiny: tuple[Path, Path]) -> tuple[Path, Path]:
    """The session's tiny Qwen2-style model and adapter (built once for every module)."""
    return tiny


def _base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _metrics(live: InProcessSidecar, run_id: str) -> dict[str, float]:
    """The run's checkpoint series as /metrics renders them (name, plus digest if any)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from deadweight.sidecar.exposition.collector import DeadweightCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(DeadweightCollector(live.registry, None, live.registry.detectors))
    found: dict[str, float] = {}
    for line in generate_latest(registry).decode().splitlines():
        if not line.startswith("deadweight_checkpoint") or f'run_id="{run_id}"' not in line:
            continue
        name, labels = line.split("{", 1)[0], line.split("{", 1)[1].split("}")[0]
        digest = dict(kv.split("=", 1) for kv in labels.split(",")).get("digest")
        key = f"{name}{{digest={digest}}}" if digest else name
        found[key] = float(line.rsplit(" ", 1)[1])
    return found


def _train(trainer: Any) -> Any:
    trainer.train()
    return trainer


# -- F1: adapter loaded without is_trainable ---------------------------------------------------


def test_f1_grpo_beta_gradients_outside_the_optimizer_and_unchanged_checkpoints(
    live: InProcessSidecar, qwen: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, adapter_dir = qwen
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    _train(runs.grpo_trainer(model, model_dir, tmp_path, [live.callback("f1-grpo")],
                             beta=0.04, steps=6, save_steps=3))
    run = live.wait_inspected("f1-grpo", 2)
    fired = live.fired("f1-grpo")

    grad = fired["grad_not_in_optimizer"]
    assert grad.evidence["optimizer_params"] == "0"
    assert int(grad.evidence["grad_not_in_optimizer_params"]) > 0
    assert grad.evidence["update_norm"] == "0"
    assert fired["empty_optimizer"].step == 0
    assert fired["kl_stuck_zero"].evidence["kl"] == "0"
    unchanged = fired["checkpoint_unchanged"]
    assert unchanged.step == 3  # the first checkpoint: byte-equal to the initial adapter
    assert unchanged.evidence["same_as"] == "previous (step 3)"  # and the next one to it
    assert unchanged.evidence["inspected"] == "true"
    assert [p.unchanged_from for p in run.checkpoints] == ["initial", "previous (step 3)"]
    assert run.checkpoints_unchanged == 2 and run.checkpoints_total == 2
    # The files' digest equals the in-memory digest the callback reported for the same save.
    for point in run.checkpoints:
        assert point.inspection is not None
        assert point.inspection.adapter_digest == point.combined_digest
        assert point.inspection.tensor_digests == point.tensor_digests
    assert "inactive_adapter" not in fired  # TRL's "ref" copy is not an idle adapter

    metrics = _metrics(live, "f1-grpo")
    assert metrics["deadweight_checkpoints_total"] == 2
    assert metrics["deadweight_checkpoint_unchanged_total"] == 2
    assert metrics["deadweight_checkpoint_adapter_bytes"] == run.checkpoints[-1].adapter_bytes > 0
    digest = run.checkpoints[-1].inspection.adapter_digest  # type: ignore[union-attr]
    assert metrics[f'deadweight_checkpoint_info{{digest="{digest}"}}'] == 1


def test_f1_sft_logs_zero_grad_norm_and_never_moves(
    live: InProcessSidecar, qwen: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, adapter_dir = qwen
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    _train(runs.sft_trainer(model, model_dir, tmp_path, [live.callback("f1-sft")],
                            steps=4, save_steps=2))
    run = live.wait_inspected("f1-sft", 2)
    fired = live.fired("f1-sft")
    assert run.history("grad_norm")[-1][1] == 0.0  # what SFT shows for F1
    assert fired["empty_optimizer"].evidence["optimizer_params"] == "0"
    assert fired["frozen_weights"].evidence["update_norm"] == "0"
    assert fired["checkpoint_unchanged"].evidence["same_as"] == "previous (step 2)"
    assert run.checkpoints[0].unchanged_from == "initial"
    assert "grad_not_in_optimizer" not in fired  # no grads anywhere under SFT


# -- F2: no KL anchor, KL missing or stuck ----------------------------------------------------


def test_f2_beta_zero_is_information(live: InProcessSidecar, qwen: tuple[Path, Path],
                                     tmp_path: Path) -> None:
    model_dir, _ = qwen
    _train(runs.grpo_trainer(_base(model_dir), model_dir, tmp_path,
                             [live.callback("f2-beta0")], beta=0.0, steps=3, save_steps=10,
                             peft_config=runs.lora_config()))
    fired = live.fired("f2-beta0")
    assert fired["no_kl_anchor"].severity == "info"
    assert fired["no_kl_anchor"].evidence["beta"] == "0"
    assert not live.seen("f2-beta0").history("kl")
    assert "kl_missing" not in fired  # beta 0: no kl is expected


def test_f2_beta_not_forwarded_kl_missing(live: InProcessSidecar, qwen: tuple[Path, Path],
                                         tmp_path: Path) -> None:
    """A wrapper writes beta into the config after the trainer read it: no KL is computed."""
    model_dir, _ = qwen
    trainer = runs.grpo_trainer(_base(model_dir), model_dir, tmp_path,
                                [live.callback("f2-kl-missing")], beta=0.0, steps=4,
                                save_steps=10, peft_config=runs.lora_config())
    trainer.args.beta = 0.04  # the config says 0.04; the trainer kept 0.0
    _train(trainer)
    fired = live.fired("f2-kl-missing")
    assert fired["kl_missing"].evidence["beta"] == "0.04"
    assert int(fired["kl_missing"].evidence["log_reports"]) >= 2
    assert "no_kl_anchor" not in fired


# -- F3: reward without spread ----------------------------------------------------------------


def constant_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0 for _ in completions]


def prompt_only_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [len(str(p)) / 10.0 for p in prompts]


def test_f3_constant_reward_with_weight_decay(live: InProcessSidecar, qwen: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    model_dir, _ = qwen
    _train(runs.grpo_trainer(_base(model_dir), model_dir, tmp_path, [live.callback("f3-const")],
                             beta=0.0, steps=5, save_steps=5, weight_decay=0.1,
                             reward_funcs=constant_reward, peft_config=runs.lora_config()))
    live.wait_inspected("f3-const", 1)
    fired = live.fired("f3-const")
    zero = fired["zero_reward_variance"]
    assert zero.evidence["rewards/constant_reward/std"] == "0"
    assert zero.evidence["frac_reward_zero_std"] == "1"
    decay = fired["decay_only_update"]  # F8: weights move by decay alone
    assert decay.evidence["grad_norm"] == "0" and float(decay.evidence["update_norm"]) > 0
    assert decay.evidence["weight_decay"] == "0.1"
    never = fired["adapter_never_trained"]  # lora_B starts at 0 and decay keeps it there
    assert never.evidence["moved_modules"] == "0"
    assert "frozen_weights" not in fired  # zero gradient is not cut-off weights


def test_f3_prompt_only_reward_keeps_reward_std_positive(
    live: InProcessSidecar, qwen: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, _ = qwen
    _train(runs.grpo_trainer(_base(model_dir), model_dir, tmp_path,
                             [live.callback("f3-prompt")], beta=0.0, steps=4, save_steps=10,
                             reward_funcs=prompt_only_reward, peft_config=runs.lora_config(),
                             per_device_train_batch_size=4))
    zero = live.fired("f3-prompt")["zero_reward_variance"]
    assert zero.evidence["frac_reward_zero_std"] == "1"
    assert float(zero.evidence["reward_std"]) > 0  # the batch std hides it
    assert "rewards/prompt_only_reward/std" not in zero.evidence


# -- F4: target modules partly misspelled -----------------------------------------------------


@pytest.mark.parametrize("targets", [["q_proj", "vproj"], r".*\.(q_proj|vproj)"])
def test_f4_partial_target_modules(live: InProcessSidecar, qwen: tuple[Path, Path], tmp_path: Path,
                                   targets: Any) -> None:
    from peft import LoraConfig

    model_dir, _ = qwen
    run_id = f"f4-{'list' if isinstance(targets, list) else 'regex'}"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")
    _train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path, [live.callback(run_id)],
                            steps=1, save_steps=10, peft_config=config))
    partial = live.fired(run_id)["partial_target_modules"]
    assert partial.evidence["unmatched"] == "vproj"
    assert partial.step == 0


# -- F5: pad token + resize before LoRA -------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_f5_resized_embedding_bloats_the_adapter(live: InProcessSidecar, tmp_path: Path,
                                                arch: str) -> None:
    from transformers import AutoTokenizer

    model_dir = build_model(tmp_path / f"model-{arch}", arch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"pad_token": "<|newpad|>"})
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    model = _base(model_dir)
    base_vocab = model.config.vocab_size
    model.resize_token_embeddings(len(tokenizer))
    targets = ["c_attn"] if arch == "gpt2" else runs.LORA_TARGETS
    run_id = f"f5-{arch}"
    _train(runs.sft_trainer(model, tokenizer_dir, tmp_path / "out", [live.callback(run_id)],
                            steps=2, save_steps=2, peft_config=runs.lora_config(targets)))
    live.wait_inspected(run_id, 1)
    fired = live.fired(run_id)
    resized = fired["embedding_resized"]
    assert resized.evidence["base_vocab_size"] == str(base_vocab)
    assert resized.evidence["embedding_rows"] == str(len(tokenizer))
    bloat = fired["adapter_bloat"]
    assert float(bloat.evidence["ratio"]) > 5
    embedding = "wte" if arch == "gpt2" else "embed_tokens"
    assert embedding in bloat.evidence["non_adapter_tensors"]


# -- F6: adapters that do not train -----------------------------------------------------------


def _two_adapters(model_dir: Path) -> Any:
    from peft import get_peft_model

    model = get_peft_model(_base(model_dir), runs.lora_config())
    model.add_adapter("second", runs.lora_config())
    return model


def test_f6_second_adapter_never_activated(live: InProcessSidecar, qwen: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    model_dir, _ = qwen
    _train(runs.sft_trainer(_two_adapters(model_dir), model_dir, tmp_path,
                            [live.callback("f6-idle")], steps=2, save_steps=10))
    idle = live.fired("f6-idle")["inactive_adapter"]
    assert idle.evidence["idle_adapters"] == "second"
    assert idle.evidence["trained_adapters"] == "default"
    assert idle.step == 0


def test_f6_set_adapter_switched_mid_run(live: InProcessSidecar, qwen: tuple[Path, Path],
                                         tmp_path: Path) -> None:
    from transformers import TrainerCallback

    class SwitchAdapter(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            if state.global_step == 2:
                model.set_adapter("second")

    model_dir, _ = qwen
    _train(runs.sft_trainer(_two_adapters(model_dir), model_dir, tmp_path,
                            [live.callback("f6-switch"), SwitchAdapter()], steps=6,
                            save_steps=10))
    fired = live.fired("f6-switch")
    grad = fired["grad_not_in_optimizer"]
    assert int(grad.evidence["first_step"]) == 3  # the first step after the switch
    switched = fired["inactive_adapter"]
    assert switched.evidence["stuck_adapter"] == "default"
    assert int(switched.evidence["grad_not_in_optimizer_tensors"]) > 0


# -- F7 / F9: learning rates that cannot train ------------------------------------------------


@pytest.mark.parametrize("case", ["lr0", "warmup_longer_than_run", "full_finetune_default"])
def test_f7_f9_learning_rate(live: InProcessSidecar, qwen: tuple[Path, Path], tmp_path: Path,
                             case: str) -> None:
    model_dir, _ = qwen
    settings = {"lr0": {"lr": 0.0}, "warmup_longer_than_run": {"warmup": 100},
                "full_finetune_default": {"lr": 2e-5}}[case]
    run_id = f"f7-{case}"
    _train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path, [live.callback(run_id)],
                            steps=4, save_steps=4, peft_config=runs.lora_config(),
                            **settings))  # type: ignore[arg-type]
    live.wait_inspected(run_id, 1)
    fired = live.fired(run_id)
    low = fired["lora_lr_too_low"]
    if case == "lr0":
        assert low.evidence["learning_rate"] == "0"
        assert fired["checkpoint_unchanged"].evidence["same_as"] == "initial"  # one save
        assert fired["adapter_never_trained"].evidence["moved_modules"] == "0"
    elif case == "warmup_longer_than_run":
        assert low.evidence["warmup_steps"] == "100" and low.evidence["total_steps"] == "4"
        assert "adapter_never_trained" not in fired  # it does learn, just slowly
    else:
        assert low.evidence["learning_rate"] == "2e-05" and low.evidence["is_peft"] == "true"


# -- F10: collapses behind a rising reward ----------------------------------------------------


def char_length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [-float(len(str(c))) for c in completions]


def test_f10_entropy_collapse(live: InProcessSidecar, qwen: tuple[Path, Path],
                              tmp_path: Path) -> None:
    """GRPO, full fine-tuning at a high rate on a model that can end its completions: the
    policy turns deterministic as reward rises."""
    model_dir = runs.terminating_model(qwen[0].parent, "qwen2")
    _train(runs.grpo_trainer(_base(model_dir), model_dir, tmp_path,
                             [live.callback("f10-entropy")], beta=0.0, steps=10, lr=5e-2,
                             save_steps=100, reward_funcs=char_length_reward,
                             num_generations=4, per_device_train_batch_size=4))
    collapse = live.fired("f10-entropy")["entropy_collapse"]
    assert float(collapse.evidence["drop"]) > 0.4
    start = [v for _, v in live.seen("f10-entropy").history("entropy")][:3]
    assert float(collapse.evidence["baseline"]) == pytest.approx(sum(start) / 3, rel=1e-4)


def test_sft_learning_its_data_is_not_an_entropy_collapse(
    live: InProcessSidecar, qwen: tuple[Path, Path], tmp_path: Path
) -> None:
    """SFT memorising one line drops entropy just as far: that is learning, not collapse."""
    model_dir, _ = qwen
    trainer = runs.sft_trainer(_base(model_dir), model_dir, tmp_path,
                               [live.callback("sft-memorise")], steps=10, lr=3e-2,
                               save_steps=100)
    trainer.train_dataset = trainer.train_dataset.select([0] * 64)
    _train(trainer)
    entropy = [v for _, v in live.seen("sft-memorise").history("entropy")]
    assert entropy[-1] < 0.6 * entropy[0]
    assert "entropy_collapse" not in live.fired("sft-memorise")


def short_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [-float(len(ids)) for ids in completion_ids]


def test_f10_completion_length_collapse(live: InProcessSidecar, qwen: tuple[Path, Path],
                                        tmp_path: Path) -> None:
    """An SFT'd model (it learned to stop) trained by GRPO on a reward for brevity."""
    model_dir, _ = qwen
    model = _base(model_dir)
    _train(runs.sft_trainer(model, model_dir, tmp_path / "sft", [], steps=24, lr=1e-2,
                            save_steps=100))
    _train(runs.grpo_trainer(model, model_dir, tmp_path / "grpo",
                             [live.callback("f10-length")], beta=0.0, steps=10, lr=1e-2,
                             save_steps=100, reward_funcs=short_reward, num_generations=4,
                             per_device_train_batch_size=4, max_completion_length=24))
    collapse = live.fired("f10-length")["completion_length_collapse"]
    assert float(collapse.evidence["drop"]) > 0.4
    assert float(collapse.evidence["baseline"]) > float(collapse.evidence["current"])


def test_f10_dpo_likelihood_collapse(live: InProcessSidecar, qwen: tuple[Path, Path],
                                     tmp_path: Path) -> None:
    model_dir, _ = qwen
    _train(runs.dpo_trainer(_base(model_dir), model_dir, tmp_path,
                            [live.callback("f10-dpo")], steps=8, lr=5e-3, save_steps=100,
                            rows=runs.collapsing_pairs(), peft_config=runs.lora_config()))
    collapse = live.fired("f10-dpo")["dpo_likelihood_collapse"]
    assert float(collapse.evidence["chosen_late"]) < float(collapse.evidence["chosen_early"]) < 0
    assert float(collapse.evidence["margin_late"]) > float(collapse.evidence["margin_early"])


# -- F11: non-finite numbers, a hung job ------------------------------------------------------


def test_f11_nonfinite_loss(live: InProcessSidecar, qwen: tuple[Path, Path],
                            tmp_path: Path) -> None:
    model_dir, _ = qwen
    # AdamW's first update is about lr * sign(grad) whatever the model: at 1e30 every weight
    # becomes huge but finite, and step 2's forward pass overflows.
    _train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path, [live.callback("f11-nan")],
                            steps=3, lr=1e30, save_steps=100))
    nonfinite = live.fired("f11-nan")["nonfinite_loss"]
    assert "nan" in (nonfinite.evidence["loss"] + nonfinite.evidence["grad_norm"])
    assert nonfinite.step == 2  # step 1 was finite; its update wrote non-finite weights
    assert int(nonfinite.evidence["nonfinite_update_tensors"]) > 0


@pytest.mark.parametrize("mode", ["hung_loop", "silent_process"])
def test_f11_stalled(tmp_path: Path, qwen: tuple[Path, Path], mode: str) -> None:
    """The loop blocks at step 2 until the sidecar calls the run stalled (or a deadline)."""
    from transformers import TrainerCallback

    from deadweight.callbacks.stream_client import ClientSettings
    from deadweight.sidecar.model.settings import DetectorSettings

    settings = (DetectorSettings(stalled_step_seconds=1.0) if mode == "hung_loop"
                else DetectorSettings(stalled_seconds=1.0))
    sidecar = InProcessSidecar.live(tmp_path / "sidecar", settings)
    run_id = f"f11-{mode}"

    class Hang(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                wait_for(lambda: "stalled" in sidecar.fired(run_id), 20, what="the stalled verdict")

    beats = 0.2 if mode == "hung_loop" else 3600.0  # a frozen process sends nothing at all
    callback = sidecar.callback(run_id, settings=ClientSettings(heartbeat_seconds=beats))
    model_dir, adapter_dir = qwen
    try:
        model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
        _train(runs.sft_trainer(model, model_dir, tmp_path / "out", [callback, Hang()],
                                steps=3, save_steps=100))
        stalled = sidecar.fired(run_id)["stalled"]
        assert stalled.step == 2
        if mode == "hung_loop":
            assert float(stalled.evidence["seconds_since_last_step"]) >= 1.0
            assert float(stalled.evidence["seconds_since_last_message"]) < 1.0
        else:
            assert float(stalled.evidence["seconds_since_last_message"]) >= 1.0
        assert not stalled.firing  # steps resumed, then the run ended
    finally:
        sidecar.stop()


def test_f11_a_long_evaluation_is_no_stall(tmp_path: Path, qwen: tuple[Path, Path]) -> None:
    """The healthy twin of the hung loop: at step 2 the Trainer evaluates for several stall
    windows, each batch slow but finished (a large eval set, a slow metric). Heartbeats carry
    the evaluation batches done, so the loop is making progress: no stalled verdict, where
    one used to fire after the window with no optimizer step."""
    from transformers import TrainerCallback

    from deadweight.callbacks.stream_client import ClientSettings
    from deadweight.sidecar.model.settings import DetectorSettings

    sidecar = InProcessSidecar.live(tmp_path / "sidecar",
                                    DetectorSettings(stalled_step_seconds=1.0))
    run_id = "f11-long-evaluation"

    class SlowBatches(TrainerCallback):  # type: ignore[misc]
        """Each evaluation batch takes a third of the stall window: the scenario itself."""

        batches = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                control.should_evaluate = True  # as eval_steps=2 would

        def on_prediction_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            type(self).batches += 1
            time.sleep(0.35)

    callback = sidecar.callback(run_id, settings=ClientSettings(heartbeat_seconds=0.2))
    model_dir, adapter_dir = qwen
    try:
        model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
        trainer = runs.sft_trainer(model, model_dir, tmp_path / "out", [callback, SlowBatches()],
                                   steps=3, save_steps=100, per_device_eval_batch_size=4)
        trainer.eval_dataset = trainer.train_dataset.select(range(32))  # 8 batches, ~3 s
        _train(trainer)
        assert SlowBatches.batches >= 8  # the evaluation outlasted the window twice over
        seen = sidecar.seen(run_id)
        assert max(r.evaluated_batches for r in seen.ranks.values()) >= 8
        assert "stalled" not in {f.detector for f in sidecar.registry.findings(run_id).values()
                                 if f.firing or f.incidents}
    finally:
        sidecar.stop()


# -- F12: pickled weights in a checkpoint -----------------------------------------------------


def test_f12_pickle_checkpoint(live: InProcessSidecar, qwen: tuple[Path, Path],
                               tmp_path: Path) -> None:
    from transformers import TrainerCallback

    class PickleCopy(TrainerCallback):  # type: ignore[misc]
        """A user callback that also writes the adapter the legacy way."""

        def on_save(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            model.save_pretrained(folder, safe_serialization=False)

    model_dir, adapter_dir = qwen
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    _train(runs.sft_trainer(model, model_dir, tmp_path,
                            [PickleCopy(), live.callback("f12-pickle")], steps=2, save_steps=2))
    live.wait_inspected("f12-pickle", 1)
    # The watcher may inspect the folder before the user's callback adds its .bin: the file
    # it adds changes the folder, which is inspected again at the next scan.
    wait_for(lambda: "pickle_checkpoint" in live.fired("f12-pickle"), 30,
             what="the pickle verdict")
    pickled = live.fired("f12-pickle")["pickle_checkpoint"]
    assert pickled.evidence["pickle_files"] == "adapter_model.bin"
    assert pickled.firing  # an artifact verdict outlives the run
