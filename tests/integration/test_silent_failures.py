"""The silent failures beyond the first catalogue, each as a real failing run next to its
healthy twin (same trainer, same model, the one line that differs set right).

Every failing run asserts the detector that names its cause and the numbers behind it; every
twin asserts that detector stays silent. ``detected`` reports time to detect: the step the
verdict names and the seconds from the start of training to the verdict.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from deadweight.sidecar.registry import Finding
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow


def _base(model_dir: Path, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)


def train(trainer: Any, **kwargs: Any) -> float:
    """Train; return the wall-clock time training started."""
    started = time.time()
    trainer.train(**kwargs)
    return started


def detected(live: InProcessSidecar, run_id: str, detector: str, started: float) -> Finding:
    """The finding, with its time to detect printed for the report."""
    fired = live.fired(run_id)
    assert detector in fired, {k: f.summary for k, f in fired.items()}
    finding = fired[detector]
    print(f"\ntime-to-detect {detector}: step {finding.step}, "
          f"{finding.fired_at - started:.2f} s after train start")
    return finding


def silent(live: InProcessSidecar, run_id: str, *detectors: str) -> None:
    fired = live.fired(run_id)
    assert not set(detectors) & set(fired), {k: fired[k].summary for k in fired}


# -- 1. partial freeze by precision ------------------------------------------------------------


def test_adapter_cast_to_bf16_updates_in_low_precision(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    import torch
    from peft import get_peft_model

    model_dir, _ = tiny
    model = get_peft_model(_base(model_dir), runs.lora_config()).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    started = train(runs.sft_trainer(model, model_dir, tmp_path / "bad",
                                     [live.callback("bf16-cast")], steps=4, save_steps=10))
    low = detected(live, "bf16-cast", "low_precision_update", started)
    # Measured: three steps in a row kept a quarter or more of a bf16 module's elements.
    assert low.step == 3 and low.evidence["dtype"] == "bfloat16"
    assert low.evidence["module_kind"] in {"q_proj", "v_proj"}
    assert float(low.evidence["unchanged_fraction"]) >= 0.25
    assert low.evidence["optimizer_dtypes"].startswith("bfloat16=")
    assert "frozen_weights" not in live.fired("bf16-cast")  # every tensor still moves
    after = dict(model.named_parameters())
    still = sum(int((after[n] == b).sum()) for n, b in before.items())
    total = sum(b.numel() for b in before.values())
    assert all(not torch.equal(after[n], b) for n, b in before.items())
    assert still / total > 0.3  # yet a large share of lora_A elements never moved

    # Twin: a bf16 base with PEFT's default autocast keeps the adapter (and its updates) fp32.
    twin = get_peft_model(_base(model_dir, dtype=torch.bfloat16), runs.lora_config())
    train(runs.sft_trainer(twin, model_dir, tmp_path / "good", [live.callback("bf16-base")],
                           steps=4, save_steps=10))
    silent(live, "bf16-base", "low_precision_update")
    assert dict(live.seen("bf16-base").start.trainable_params_by_dtype).keys() == {"float32"}
    kinds = live.seen("bf16-base").combined_steps()[-1].module_elements
    assert kinds and all(d == "float32" and u == 0 for _, d, _, u in kinds)  # all moved

    # The same bf16 cast in its warmup: warmup steps are lora_lr_too_low's, never counted here.
    cast = get_peft_model(_base(model_dir), runs.lora_config()).to(torch.bfloat16)
    train(runs.sft_trainer(cast, model_dir, tmp_path / "warmup", [live.callback("bf16-warm")],
                           steps=4, warmup=3, save_steps=10))
    silent(live, "bf16-warm", "low_precision_update")


def _dora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=list(runs.LORA_TARGETS),
                      task_type="CAUSAL_LM", use_dora=True)


def _dtypes(model: Any, part: str) -> set[str]:
    """The dtypes of the trainable tensors whose names hold part."""
    return {str(p.dtype) for n, p in model.named_parameters() if p.requires_grad and part in n}


def test_dora_magnitude_in_bf16_never_moves(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A DoRA magnitude in bf16 keeps every element at lr 2e-4: it sits at the size of a row
    norm, so Adam's steps are below half its ULP. The verdict names the magnitude's own kind."""
    import torch
    from peft import get_peft_model

    model_dir, _ = tiny
    # Every DoRA tensor in the base's bf16, magnitude included: the state trl#7268 reports
    # (there via a QLoRA downcast of every trainable tensor, which needs a quantized base),
    # reached here on the plain bf16 base by turning PEFT's fp32 autocast off.
    model = get_peft_model(_base(model_dir, dtype=torch.bfloat16), _dora_config(),
                           autocast_adapter_dtype=False)
    assert _dtypes(model, "lora_magnitude_vector") == _dtypes(model, "lora_") == {
        "torch.bfloat16"}
    magnitude = {n: p.detach().clone() for n, p in model.named_parameters()
                 if "lora_magnitude_vector" in n}
    started = train(runs.sft_trainer(model, model_dir, tmp_path / "bad",
                                     [live.callback("dora-bf16")], steps=4, save_steps=10))
    low = detected(live, "dora-bf16", "low_precision_update", started)
    assert low.step == 3 and low.evidence["dtype"] == "bfloat16"
    assert low.evidence["module_kind"].endswith(".lora_magnitude_vector")
    assert float(low.evidence["unchanged_fraction"]) == 1.0  # measured: every element, every step
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], b) for n, b in magnitude.items())

    # Only the magnitude in bf16, lora_A/B fp32: counted with its module's A/B, the magnitude
    # was 128 of q_proj's 1152 elements (11%, under the 25% threshold) and the run was silent.
    mixed = get_peft_model(_base(model_dir, dtype=torch.bfloat16), _dora_config())
    for module in mixed.modules():
        for layer in getattr(module, "lora_magnitude_vector", {}).values():
            layer.weight = torch.nn.Parameter(layer.weight.detach().to(torch.bfloat16))
    assert _dtypes(mixed, "lora_magnitude_vector") == {"torch.bfloat16"}
    assert _dtypes(mixed, "lora_A") == _dtypes(mixed, "lora_B") == {"torch.float32"}
    started = train(runs.sft_trainer(mixed, model_dir, tmp_path / "mixed",
                                     [live.callback("dora-mag-bf16")], steps=4, save_steps=10))
    low = detected(live, "dora-mag-bf16", "low_precision_update", started)
    assert low.step == 3 and low.evidence["module_kind"].endswith(".lora_magnitude_vector")
    assert low.evidence["dtype"] == "bfloat16" and float(low.evidence["unchanged_fraction"]) == 1
    assert "frozen_weights" not in live.fired("dora-mag-bf16")  # lora_A/B move
    last = live.seen("dora-mag-bf16").combined_steps()[-1].module_elements
    assert {k for k, d, _, _ in last if d == "float32"} == {"q_proj", "v_proj"}
    assert all(u == 0 for k, d, _, u in last if d == "float32")  # every A/B element moved

    # Twin: DoRA on the same bf16 base with PEFT's default autocast: magnitude fp32, silent.
    twin = get_peft_model(_base(model_dir, dtype=torch.bfloat16), _dora_config())
    assert _dtypes(twin, "lora_") == {"torch.float32"}
    train(runs.sft_trainer(twin, model_dir, tmp_path / "good", [live.callback("dora-fp32")],
                           steps=4, save_steps=10))
    silent(live, "dora-fp32", "low_precision_update")
    kinds = live.seen("dora-fp32").combined_steps()[-1].module_elements
    assert {k for k, _, _, _ in kinds} == {"q_proj", "q_proj.lora_magnitude_vector",
                                           "v_proj", "v_proj.lora_magnitude_vector"}
    # fp32 moves (nearly) every element: on one CPU kind here 1 of q_proj's 1024 kept its
    # bytes at step 4 (its gradient rounds to nothing); the bf16 magnitude above kept all.
    assert all(d == "float32" and u <= n // 100 for _, d, n, u in kinds), kinds


def test_pure_bf16_full_fine_tune_loses_its_updates(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A full fine-tune of a bf16 model at lr 2e-5, no fp32 master weights: most elements of
    every module keep their value each step. Its fp32 twin moves them all, and its two
    checkpoints (no adapter: empty adapter digests) are never compared as unchanged."""
    import torch

    model_dir, _ = tiny
    started = train(runs.sft_trainer(_base(model_dir, dtype=torch.bfloat16), model_dir,
                                     tmp_path / "bad", [live.callback("full-bf16")], steps=4,
                                     lr=2e-5, save_steps=10))
    low = detected(live, "full-bf16", "low_precision_update", started)
    assert low.step == 3 and low.evidence["dtype"] == "bfloat16"
    assert float(low.evidence["unchanged_fraction"]) > 0.5

    train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "good",
                           [live.callback("full-fp32")], steps=4, lr=2e-5, save_steps=2))
    live.wait_inspected("full-fp32", 2)
    silent(live, "full-fp32", "low_precision_update", "checkpoint_unchanged")
    assert not live.seen("full-fp32").start.initial_adapter.tensors  # nothing to compare


# -- 2. zero gradient on any trainer -----------------------------------------------------------


def test_dpo_beta_zero_has_no_gradient(live: InProcessSidecar, tiny: tuple[Path, Path],
                                       tmp_path: Path) -> None:
    model_dir, _ = tiny
    started = train(runs.dpo_trainer(_base(model_dir), model_dir, tmp_path / "bad",
                                     [live.callback("dpo-beta0")], beta=0.0, steps=4,
                                     save_steps=10, peft_config=runs.lora_config()))
    zero = detected(live, "dpo-beta0", "zero_gradient", started)
    assert zero.evidence["grad_norm"] == "0" and zero.evidence["loss"] == "0.693147"
    assert zero.step == 3  # the third log report at lr > 0

    train(runs.dpo_trainer(_base(model_dir), model_dir, tmp_path / "good",
                           [live.callback("dpo-beta")], beta=0.1, steps=4, save_steps=10,
                           peft_config=runs.lora_config()))
    silent(live, "dpo-beta", "zero_gradient")


# -- 3. completions always truncated -----------------------------------------------------------


def test_grpo_completions_never_end(live: InProcessSidecar, tiny: tuple[Path, Path],
                                    tmp_path: Path) -> None:
    model_dir, _ = tiny
    started = train(runs.grpo_trainer(_base(model_dir), model_dir, tmp_path / "bad",
                                      [live.callback("grpo-cut")], beta=0.0, steps=4,
                                      save_steps=10, max_completion_length=4,
                                      peft_config=runs.lora_config()))
    cut = detected(live, "grpo-cut", "completions_truncated", started)
    assert cut.evidence["max_completion_length"] == "4" and cut.step == 4

    train(runs.grpo_trainer(_base(model_dir), model_dir, tmp_path / "good",
                            [live.callback("grpo-ends")], beta=0.0, steps=4, save_steps=10,
                            max_completion_length=4, peft_config=runs.lora_config(),
                            **runs.terminating(model_dir)))
    silent(live, "grpo-ends", "completions_truncated")
    assert any(v < 1 for _, v in live.seen("grpo-ends").history("completions/clipped_ratio"))


# -- 4. the stop token is never trained --------------------------------------------------------


def _lm_trainer(model_dir: Path, output_dir: Path, callback: Any, tokenizer: Any) -> Any:
    """The classic causal-LM recipe: plain Trainer, eos appended, transformers' LM collator."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from deadweight.demo.tiny_models import sample_lines

    lines = Dataset.from_dict({"text": sample_lines(32, seed=4)})
    data = lines.map(lambda rows: tokenizer([t + tokenizer.eos_token for t in rows["text"]]),
                     batched=True, remove_columns=["text"])
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=2,
                             **runs.common_args(2, 0, 2e-4, 10))
    return Trainer(model=get_peft_model(_base(model_dir), runs.lora_config()), args=args,
                   train_dataset=data, processing_class=tokenizer, callbacks=[callback],
                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))


def test_pad_equal_eos_with_the_lm_collator_masks_every_stop_label(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token  # the common "no pad token" fix
    started = train(_lm_trainer(model_dir, tmp_path / "bad", live.callback("eos-masked"),
                                tokenizer))
    stop = detected(live, "eos-masked", "stop_token_untrained", started)
    assert stop.evidence["token"] == "<|im_end|>" and stop.evidence["in_labels"] == "0"
    assert int(stop.evidence["in_inputs"]) == int(stop.evidence["sequences"]) == 8

    # Twin: the same recipe with a pad token of its own: every eos is a trained label.
    train(_lm_trainer(model_dir, tmp_path / "good", live.callback("eos-kept"),
                      AutoTokenizer.from_pretrained(model_dir)))
    silent(live, "eos-kept", "stop_token_untrained")
    check = live.seen("eos-kept").start.stop_token
    assert check.in_labels == check.in_inputs == 8
    # The trainers' own collator (SFT) keeps eos labels even with pad == eos.
    train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "sft",
                           [live.callback("eos-sft")], steps=2, save_steps=10,
                           peft_config=runs.lora_config(), tokenizer=tokenizer))
    silent(live, "eos-sft", "stop_token_untrained")
    assert live.seen("eos-sft").start.stop_token.in_labels > 0


def _chat_template(end_of_turn_trained: bool) -> str:
    """ChatML with a ``{% generation %}`` block around the assistant's answer, and the
    end-of-turn token inside it (trained) or right after it (never a label)."""
    end = "'<|im_end|>'"
    answer = ("{% generation %}{{ message['content'] + " + end + " }}{% endgeneration %}"
              if end_of_turn_trained else
              "{% generation %}{{ message['content'] }}{% endgeneration %}{{ " + end + " }}")
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['role'] == 'assistant' %}" + answer +
            "{% else %}{{ message['content'] + " + end + " }}{% endif %}{{ '\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _chat_trainer(model_dir: Path, output_dir: Path, callback: Any, end_of_turn_trained: bool,
                  eos: str = "<|im_end|>") -> Any:
    """SFT with assistant_only_loss on user/assistant turns under that template."""
    from transformers import AutoTokenizer

    from deadweight.demo.tiny_models import sample_lines

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = _chat_template(end_of_turn_trained)
    model = _base(model_dir)
    if eos != tokenizer.eos_token:  # a base tokenizer's eos; the model stops on both
        tokenizer.eos_token = eos
        model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                                tokenizer.eos_token_id]
    turns = zip(sample_lines(16, seed=8), sample_lines(16, seed=9), strict=True)
    rows = {"messages": [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                         for q, a in turns]}
    return runs.sft_trainer(model, model_dir, output_dir, [callback], steps=2, save_steps=10,
                            peft_config=runs.lora_config(), tokenizer=tokenizer, rows=rows,
                            assistant_only_loss=True, max_length=64)


def test_chat_template_leaves_the_end_of_turn_outside_the_loss(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, _ = tiny
    started = train(_chat_trainer(model_dir, tmp_path / "bad", live.callback("eot-outside"),
                                  end_of_turn_trained=False))
    stop = detected(live, "eot-outside", "stop_token_untrained", started)
    assert stop.evidence["token"] == "<|im_end|>" and stop.evidence["in_labels"] == "0"
    assert int(stop.evidence["in_inputs"]) >= 8  # it ends every user turn and every answer

    # Twins: the end of turn inside the generation block; and the same with a distinct eos
    # (a base tokenizer's <|endoftext|>) that never appears: the end of turn is the stop.
    train(_chat_trainer(model_dir, tmp_path / "good", live.callback("eot-inside"),
                        end_of_turn_trained=True))
    train(_chat_trainer(model_dir, tmp_path / "eos", live.callback("eot-not-eos"),
                        end_of_turn_trained=True, eos="<|endoftext|>"))
    for run_id in ("eot-inside", "eot-not-eos"):
        silent(live, run_id, "stop_token_untrained")
        check = live.seen(run_id).start.stop_token
        assert check.token == "<|im_end|>" and 0 < check.in_labels < check.in_inputs


# -- 5. a random, unsaved head -----------------------------------------------------------------


def test_reward_head_outside_modules_to_save(live: InProcessSidecar, tiny: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    from peft import LoraConfig

    model_dir, _ = tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules=runs.LORA_TARGETS)  # no task_type
    started = train(runs.reward_trainer(runs.reward_model(model_dir), model_dir, tmp_path / "bad",
                                        [live.callback("head-lost")], steps=2, save_steps=2,
                                        peft_config=config))
    head = detected(live, "head-lost", "unsaved_head", started)
    assert head.evidence["new_heads"] == "score" and head.evidence["saved_heads"] == "none"
    assert head.severity == "critical"  # the Trainer saves through the adapter: lost for sure
    live.wait_inspected("head-lost", 1)
    saved = live.seen("head-lost").checkpoints[-1].inspection
    assert saved is not None and not any("score" in n for n in saved.tensor_digests)

    twin = LoraConfig(r=4, lora_alpha=8, target_modules=runs.LORA_TARGETS, task_type="SEQ_CLS")
    train(runs.reward_trainer(runs.reward_model(model_dir), model_dir, tmp_path / "good",
                              [live.callback("head-saved")], steps=2, save_steps=2,
                              peft_config=twin))
    silent(live, "head-saved", "unsaved_head")


# -- 6. empty adapter files --------------------------------------------------------------------


class PartitionedSave:
    """What ZeRO-3 leaves a rank holding at save time when nothing gathers the parameters:
    every parameter replaced by an empty placeholder."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        def on_step_end(_: Any, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            import torch

            if state.global_step == state.max_steps:
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        param.data = torch.empty(0, dtype=param.dtype)

        self.callback = type("Partition", (TrainerCallback,), {"on_step_end": on_step_end})()


def test_partitioned_save_writes_an_empty_adapter(live: InProcessSidecar, tiny: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    from deadweight.sidecar.commands.cli import main

    model_dir, _ = tiny
    started = train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "bad",
                                     [live.callback("empty"), PartitionedSave().callback],
                                     steps=2, save_steps=2, peft_config=runs.lora_config()))
    live.wait_inspected("empty", 1)
    empty = detected(live, "empty", "empty_adapter", started)
    assert empty.evidence["empty_tensors"] == empty.evidence["tensors"] == "8"
    assert "adapter_never_trained" not in live.fired("empty")

    zero_bytes = tmp_path / "zero"  # the other shape of the same failure: a file of 0 bytes
    zero_bytes.mkdir()
    (zero_bytes / "adapter_model.safetensors").write_bytes(b"")
    assert main(["inspect", str(zero_bytes)]) == 1

    train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "good",
                           [live.callback("gathered")], steps=2, save_steps=2,
                           peft_config=runs.lora_config()))
    live.wait_inspected("gathered", 1)
    silent(live, "gathered", "empty_adapter")
    assert main(["inspect", str(tmp_path / "good" / "checkpoint-2")]) == 0


# -- 7. silently shrunken data -----------------------------------------------------------------


def test_dpo_drops_prompts_that_fill_max_length(live: InProcessSidecar, tiny: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    model_dir, _ = tiny
    rows = runs.preference_rows(32)
    rows["prompt"] = [p if i % 2 else " ".join([p] * 12) for i, p in enumerate(rows["prompt"])]
    started = train(runs.dpo_trainer(_base(model_dir), model_dir, tmp_path / "bad",
                                     [live.callback("dpo-shrunk")], steps=2, save_steps=10,
                                     peft_config=runs.lora_config(), rows=rows))
    shrunk = detected(live, "dpo-shrunk", "dataset_shrunk", started)
    assert shrunk.evidence["rows_given"] == "32" and shrunk.evidence["max_length"] == "64"
    assert int(shrunk.evidence["rows_dropped"]) == 16  # every long prompt
    assert int(shrunk.evidence["rows_kept"]) > 0

    train(runs.dpo_trainer(_base(model_dir), model_dir, tmp_path / "good",
                           [live.callback("dpo-whole")], steps=2, save_steps=10,
                           peft_config=runs.lora_config()))
    silent(live, "dpo-whole", "dataset_shrunk")


def test_reward_and_sft_drop_rows_that_fill_max_length(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """Beyond DPO: the reward trainer drops pairs longer than max_length; SFT on
    prompt/completion rows drops rows whose completion truncation cut away (fully masked)."""
    from peft import LoraConfig

    model_dir, _ = tiny
    heads = dict(r=4, lora_alpha=8, target_modules=runs.LORA_TARGETS, task_type="SEQ_CLS")
    started = train(runs.reward_trainer(runs.reward_model(model_dir), model_dir, tmp_path / "rm",
                                        [live.callback("rm-shrunk")], steps=2, save_steps=10,
                                        peft_config=LoraConfig(**heads), max_length=32))
    shrunk = detected(live, "rm-shrunk", "dataset_shrunk", started)
    assert shrunk.evidence["rows_given"] == "32" and shrunk.evidence["max_length"] == "32"
    assert int(shrunk.evidence["rows_dropped"]) > 16

    pairs = runs.preference_rows(32)
    rows = {"prompt": [p if i % 2 else " ".join([p] * 6) for i, p in enumerate(pairs["prompt"])],
            "completion": pairs["chosen"]}
    started = train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "sft",
                                     [live.callback("sft-shrunk")], steps=2, save_steps=10,
                                     peft_config=runs.lora_config(), rows=rows))
    shrunk = detected(live, "sft-shrunk", "dataset_shrunk", started)
    assert shrunk.evidence["rows_given"] == "32" and int(shrunk.evidence["rows_dropped"]) >= 16

    # Twins: the same data with a max_length that holds every row.
    train(runs.reward_trainer(runs.reward_model(model_dir), model_dir, tmp_path / "rm-whole",
                              [live.callback("rm-whole")], steps=2, save_steps=10,
                              peft_config=LoraConfig(**heads)))
    train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "sft-whole",
                           [live.callback("sft-whole")], steps=2, save_steps=10,
                           peft_config=runs.lora_config(), rows=rows, max_length=256))
    for run_id in ("rm-whole", "sft-whole"):
        silent(live, run_id, "dataset_shrunk")
        kept = live.seen(run_id).start.dataset_rows
        assert kept.given == kept.kept == 32


# -- 8. resume that restarts the adapter -------------------------------------------------------


def test_resume_loads_a_full_model_file_and_restarts_the_adapter(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import save_file

    model_dir, _ = tiny
    first = tmp_path / "first"
    train(runs.sft_trainer(_base(model_dir), model_dir, first, [], steps=2, save_steps=2,
                           peft_config=runs.lora_config()))
    for name, extra in (("bad", True), ("good", False)):
        out = tmp_path / name
        shutil.copytree(first, out)
        if extra:  # a full model saved beside the adapter for evaluation: the Trainer loads it
            state = {k: v.contiguous() for k, v in _base(model_dir).state_dict().items()}
            save_file(state, str(out / "checkpoint-2" / "model.safetensors"))
        started = train(runs.sft_trainer(_base(model_dir), model_dir, out,
                                         [live.callback(f"resume-{name}")], steps=4,
                                         save_steps=10, peft_config=runs.lora_config()),
                        resume_from_checkpoint=str(out / "checkpoint-2"))
        if extra:
            lost = detected(live, "resume-bad", "resume_lost_adapter", started)
            assert lost.step == 2 and lost.evidence["differing_tensors"] != "0"
            assert lost.evidence["sign"] == "digest" and lost.severity == "critical"
        else:
            silent(live, "resume-good", "resume_lost_adapter")
            resume = live.seen("resume-good").start.resume
            assert resume.step == 2 and resume.checkpoint_adapter.combined == (
                live.seen("resume-good").start.initial_adapter.combined)


def test_resume_under_another_adapter_name_restarts_the_loss(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The checkpoint's adapter was saved under the name "sft" (a subfolder of the checkpoint);
    the resumed script builds a fresh default adapter: the Trainer loads "sft" frozen beside it
    and trains the fresh one. No adapter file at the checkpoint's top for a digest to compare:
    the first loss after the resume, back at the step-0 loss, shows the restart."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from deadweight.demo.tiny_models import sample_lines

    model_dir, _ = tiny
    texts = sample_lines(4, seed=11) * 16  # a few lines, learnt within a few steps
    # The output head trains too, so the tiny model learns visibly in 8 steps (5.8 -> ~3.6).
    config = dict(r=4, lora_alpha=8, target_modules=runs.LORA_TARGETS,
                  modules_to_save=["lm_head"], task_type="CAUSAL_LM")

    def trainer(model: Any, out: Path, callbacks: list[Any], steps: int) -> Any:
        return runs.sft_trainer(model, model_dir, out, callbacks, steps=steps, lr=1e-2,
                                save_steps=8, texts=texts)

    def peft_model(adapter: str) -> Any:
        return get_peft_model(_base(model_dir), LoraConfig(**config), adapter_name=adapter)

    first = tmp_path / "first"
    train(trainer(peft_model("sft"), first, [], 8))
    assert (first / "checkpoint-8" / "sft" / "adapter_model.safetensors").is_file()
    for name, adapter in (("fresh", "default"), ("named", "sft")):
        out = tmp_path / name
        shutil.copytree(first, out)
        started = train(trainer(peft_model(adapter), out, [live.callback(f"resume-{name}")], 10),
                        resume_from_checkpoint=str(out / "checkpoint-8"))
        resume = live.seen(f"resume-{name}").start.resume
        assert resume.step == 8 and not resume.checkpoint_adapter.tensors  # digests blind
        assert resume.last_loss < 0.8 * resume.first_loss  # the first run had learned
        if name == "fresh":
            lost = detected(live, "resume-fresh", "resume_lost_adapter", started)
    assert lost.evidence["sign"] == "loss" and lost.step == 9 and lost.severity == "warning"
    assert float(lost.evidence["regained"]) > 0.5
    silent(live, "resume-named", "resume_lost_adapter")
    after = dict(live.seen("resume-named").history("loss"))[9]
    assert after < live.seen("resume-named").start.resume.first_loss * 0.8  # it went on


# -- 9. AdaLoRA degraded to LoRA ---------------------------------------------------------------


def test_adalora_without_allocation(live: InProcessSidecar, tiny: tuple[Path, Path],
                                    tmp_path: Path) -> None:
    from peft import AdaLoraConfig

    model_dir, _ = tiny

    def config() -> AdaLoraConfig:
        return AdaLoraConfig(init_r=4, target_r=2, target_modules=runs.LORA_TARGETS,
                             total_step=8, tinit=1, tfinal=2, deltaT=1, task_type="CAUSAL_LM")

    started = train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "bad",
                                     [live.callback("adalora-plain")], steps=6, save_steps=10,
                                     peft_config=config()))
    plain = detected(live, "adalora-plain", "adalora_not_allocated", started)
    assert plain.step == 4 and plain.evidence["tinit"] == "1"

    train(runs.sft_trainer(_base(model_dir), model_dir, tmp_path / "good",
                           [live.callback("adalora-allocated"), runs.AdaloraAllocator()],
                           steps=6, save_steps=10, peft_config=config()))
    silent(live, "adalora-allocated", "adalora_not_allocated")


# -- 10. fp16 skipped steps --------------------------------------------------------------------


def test_fp16_steps_all_skipped(live: InProcessSidecar, tiny: tuple[Path, Path],
                                tmp_path: Path) -> None:
    """fp16 loss scaling whose scale never comes down: every step overflows and is skipped.

    On a CPU the Trainer builds no GradScaler for fp16; one is set on the accelerator as a
    GPU run has it (a scale that only backs off by a hair stands for a loss that overflows
    fp16 at any scale). Every step from the first is skipped: past the allowance for a loss
    scale that calibrates (16 more skips), it fires.
    """
    import torch

    model_dir, _ = tiny
    results = {}
    for name, scaler in (("skipped", dict(init_scale=2.0 ** 127, backoff_factor=0.999999)),
                         ("scaled", dict(init_scale=2.0 ** 10))):
        trainer = runs.sft_trainer(_base(model_dir), model_dir, tmp_path / name,
                                   [live.callback(f"fp16-{name}")], steps=20, save_steps=40,
                                   peft_config=runs.lora_config(), fp16=True)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **scaler)
        results[name] = train(trainer)
    skipped = detected(live, "fp16-skipped", "optimizer_steps_skipped", results["skipped"])
    assert skipped.evidence["all_skipped"] == "true" and skipped.step == 19
    assert "frozen_weights" not in live.fired("fp16-skipped")  # skipped is not frozen
    silent(live, "fp16-scaled", "optimizer_steps_skipped", "frozen_weights")
    assert not any(p.skipped for p in live.seen("fp16-scaled").combined_steps())


# -- zero gradient, again: distillation from the student's own weights -------------------------


def test_distillation_from_an_identical_teacher_has_no_gradient(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A fresh LoRA leaves the student equal to a teacher loaded from the same weights: the
    loss sits at its minimum and no gradient flows; a different teacher teaches."""
    model_dir, _ = tiny
    started = train(runs.distillation_trainer(
        _base(model_dir), model_dir, tmp_path / "bad", [live.callback("distill-self")],
        teacher=_base(model_dir), steps=4, save_steps=10, peft_config=runs.lora_config()))
    zero = detected(live, "distill-self", "zero_gradient", started)
    assert zero.evidence["grad_norm"] == "0"

    train(runs.distillation_trainer(_base(model_dir), model_dir, tmp_path / "good",
                                    [live.callback("distill-teacher")], steps=4, save_steps=10,
                                    peft_config=runs.lora_config()))
    silent(live, "distill-teacher", "zero_gradient")
