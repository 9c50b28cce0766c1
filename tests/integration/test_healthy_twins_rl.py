"""Healthy recipes that once drew a false verdict, each beside its failing twin.

Each healthy run is written the way users write it, with a real trainer on the tiny model, and
must leave its detector silent; its twin is the real failure, which must still fire:

- GRPO with a constant format reward beside a varying one (``zero_reward_variance`` judges the
  combined reward); twin: every reward function constant.
- Two adapters trained one after another (``add_adapter`` + ``set_adapter``, a second trainer);
  twin: the second adapter added but never activated (``inactive_adapter``).
- A saved adapter re-trained under KTO, which adds TRL's frozen "ref" copy of it; twin: the
  same run with a second adapter never activated (the "ref" copy is still not named).
- DPO at beta 0.1 whose chosen and rejected rewards both dip a little while the margin opens
  (likelihood displacement); twin: rejected extends chosen, both collapse
  (``dpo_likelihood_collapse``).
- Plain-text continued pre-training (plain ``Trainer``, variable-length rows without eos, the
  LM collator); twin: an instruction run whose loss leaves the prompt out and whose answers
  never end (``stop_token_untrained``).

All runs share one sidecar with the failure tests' short windows, in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo import runs
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSidecar]:
    sidecar = InProcessSidecar.live(tmp_path_factory.mktemp("twins"))
    yield sidecar
    sidecar.stop()


def _base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _fired(live: InProcessSidecar, run_id: str) -> dict[str, tuple[str, dict[str, str]]]:
    return {k: (f.summary, dict(f.evidence)) for k, f in live.fired(run_id).items()}


def _series(live: InProcessSidecar, run_id: str, key: str) -> list[float]:
    return [v for _, v in live.seen(run_id).history(key)]


# -- 1. GRPO: a constant format reward beside a varying one --------------------------------------


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A shape reward every completion of this tiny model meets: constant, std 0."""
    return [1.0 for _ in completions]


def flat_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.5 for _ in completions]


def test_grpo_constant_format_reward_beside_a_varying_one(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, _ = tiny
    runs.grpo_trainer(_base(model_dir), model_dir, tmp_path / "mixed",
                      [live.callback("grpo-format")], beta=0.04, steps=6, save_steps=100,
                      reward_funcs=[runs.length_reward, format_reward],
                      peft_config=runs.lora_config(), num_generations=4,
                      per_device_train_batch_size=4, **runs.terminating(model_dir)).train()
    # What used to fire: the format reward is constant in every log report...
    assert set(_series(live, "grpo-format", "rewards/format_reward/std")) == {0.0}
    # ...while the combined reward spreads the groups and the gradient flows.
    assert max(_series(live, "grpo-format", "frac_reward_zero_std")) < 1.0
    assert min(_series(live, "grpo-format", "grad_norm")) > 0.0
    assert _fired(live, "grpo-format") == {}

    # Twin: every reward function constant, so the combined reward is too.
    runs.grpo_trainer(_base(model_dir), model_dir, tmp_path / "flat",
                      [live.callback("grpo-all-flat")], beta=0.04, steps=4, save_steps=100,
                      reward_funcs=[flat_reward, format_reward],
                      peft_config=runs.lora_config()).train()
    zero = live.fired("grpo-all-flat")["zero_reward_variance"]
    assert zero.evidence["frac_reward_zero_std"] == "1"
    assert zero.evidence["rewards/flat_reward/std"] == "0"
    assert zero.evidence["rewards/format_reward/std"] == "0"


# -- 2. two adapters trained one after another --------------------------------------------------


def _adapter_values(model: Any, adapter: str) -> list[Any]:
    return [p.detach().clone() for n, p in model.named_parameters()
            if f".{adapter}." in n and "lora_B" in n]


def test_two_adapters_trained_one_after_another(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    from peft import get_peft_model

    model_dir, _ = tiny
    model = get_peft_model(_base(model_dir), runs.lora_config())
    runs.sft_trainer(model, model_dir, tmp_path / "first", [live.callback("adapters-first")],
                     steps=2, save_steps=100).train()
    model.add_adapter("second", runs.lora_config())
    model.set_adapter("second")
    first_before = _adapter_values(model, "default")
    runs.sft_trainer(model, model_dir, tmp_path / "second", [live.callback("adapters-second")],
                     steps=3, save_steps=100).train()
    # The run is the documented workflow: the first adapter frozen, the second trains.
    coverage = {a.name: a for a in live.seen("adapters-second").start.membership.adapters}
    assert coverage["default"].in_optimizer_tensors == 0 and not coverage["default"].active
    assert coverage["second"].in_optimizer_tensors == coverage["second"].tensors > 0
    assert all(a.equal(b) for a, b in zip(first_before, _adapter_values(model, "default"),
                                          strict=True))
    assert any(p.abs().sum() > 0 for p in _adapter_values(model, "second"))
    assert _fired(live, "adapters-first") == {}
    assert _fired(live, "adapters-second") == {}

    # Twin (F6): the second adapter added, set_adapter forgotten: the first trains again.
    model = get_peft_model(_base(model_dir), runs.lora_config())
    runs.sft_trainer(model, model_dir, tmp_path / "again", [live.callback("adapters-again")],
                     steps=2, save_steps=100).train()
    model.add_adapter("second", runs.lora_config())
    runs.sft_trainer(model, model_dir, tmp_path / "never", [live.callback("adapters-never")],
                     steps=2, save_steps=100).train()
    idle = live.fired("adapters-never")["inactive_adapter"]
    assert idle.evidence["idle_adapters"] == "second"
    assert idle.evidence["trained_adapters"] == "default"


# -- 3. a saved adapter re-trained under KTO (TRL's frozen "ref" copy) -------------------------


def test_kto_resumed_adapter_with_its_reference_copy(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, adapter_dir = tiny
    runs.kto_trainer(runs.load_adapter(model_dir, adapter_dir, trainable=True), model_dir,
                     tmp_path / "kto", [live.callback("kto-resumed")], steps=3,
                     save_steps=100).train()
    coverage = {a.name: a for a in live.seen("kto-resumed").start.membership.adapters}
    assert coverage["ref"].in_optimizer_tensors == 0  # TRL added the frozen copy
    assert (coverage["ref"].tensors, coverage["ref"].params) == (
        coverage["default"].tensors, coverage["default"].params)
    assert _fired(live, "kto-resumed") == {}

    # Twin: the same run with a second adapter added and never activated.
    model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
    model.add_adapter("second", runs.lora_config())
    runs.kto_trainer(model, model_dir, tmp_path / "kto-idle", [live.callback("kto-idle")],
                     steps=2, save_steps=100).train()
    idle = live.fired("kto-idle")["inactive_adapter"]
    assert idle.evidence["idle_adapters"] == "second"  # the "ref" copy is still not named


# -- 4. DPO: likelihood displacement vs. collapse ----------------------------------------------


def _pairs(chosen: str, rejected: str, n: int = 16) -> dict[str, list[str]]:
    return {"prompt": ["the model learns"] * n, "chosen": [chosen] * n,
            "rejected": [rejected] * n}


def test_dpo_displacement_is_not_a_likelihood_collapse(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, _ = tiny
    # The rejected answer ends one word past the chosen one: both dip a little (they share
    # every chosen token), the margin opens well past chosen's dip.
    runs.dpo_trainer(_base(model_dir), model_dir, tmp_path / "displaced",
                     [live.callback("dpo-displaced")], beta=0.1, steps=8, lr=5e-3,
                     save_steps=100, rows=_pairs(" yes no yes", " yes no yes no"),
                     peft_config=runs.lora_config()).train()
    chosen = _series(live, "dpo-displaced", "rewards/chosen")
    rejected = _series(live, "dpo-displaced", "rewards/rejected")
    margins = _series(live, "dpo-displaced", "rewards/margins")
    assert max(chosen[1:]) < 0 and max(rejected[1:]) < 0  # both dip below the reference
    assert chosen[-1] < chosen[1] and rejected[-1] < rejected[1]
    assert margins[-1] > margins[1] and margins[-1] > -chosen[-1]  # the margin outgrows it
    assert _fired(live, "dpo-displaced") == {}

    # Twin (F10): the rejected answer extends the chosen one by two words: both collapse.
    runs.dpo_trainer(_base(model_dir), model_dir, tmp_path / "collapsed",
                     [live.callback("dpo-collapsed")], beta=0.1, steps=8, lr=5e-3,
                     save_steps=100, rows=runs.collapsing_pairs(),
                     peft_config=runs.lora_config()).train()
    collapse = live.fired("dpo-collapsed")["dpo_likelihood_collapse"]
    chosen_fall = float(collapse.evidence["chosen_early"]) - float(collapse.evidence["chosen_late"])
    margin_gain = float(collapse.evidence["margin_late"]) - float(collapse.evidence["margin_early"])
    assert chosen_fall >= margin_gain > 0


# -- 5. plain-text continued pre-training vs. an instruction run that never ends -----------------


def _plain_trainer(model_dir: Path, output_dir: Path, callback: Any, data: Any,
                   collator: Any) -> Any:
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=2,
                             **runs.common_args(2, 0, 2e-4, 100))
    from peft import get_peft_model

    return Trainer(model=get_peft_model(_base(model_dir), runs.lora_config()), args=args,
                   train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir),
                   callbacks=[callback], data_collator=collator)


def test_plain_text_pretraining_has_no_stop_to_learn(
    live: InProcessSidecar, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    from deadweight.demo.tiny_models import sample_lines

    model_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = Dataset.from_dict({"text": sample_lines(32, seed=4)})
    raw = lines.map(lambda rows: tokenizer(rows["text"]), batched=True, remove_columns=["text"])
    _plain_trainer(model_dir, tmp_path / "raw", live.callback("raw-text"), raw,
                   DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
    check = live.seen("raw-text").start.stop_token
    assert check.in_inputs == check.in_labels == check.outside_loss == 0
    assert check.full_rows < check.sequences  # variable-length rows, padded: not packed
    assert _fired(live, "raw-text") == {}

    # Twin: instruction rows (prompt, answer) whose loss leaves the prompt out and whose
    # answers never end: a model that never learns to stop.
    prompts, answers = sample_lines(32, seed=8), sample_lines(32, seed=9)

    def encode(rows: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
        for prompt, answer in zip(rows["prompt"], rows["answer"], strict=True):
            p, a = tokenizer(prompt)["input_ids"], tokenizer(" " + answer)["input_ids"]
            out["input_ids"].append(p + a)
            out["attention_mask"].append([1] * (len(p) + len(a)))
            out["labels"].append([-100] * len(p) + a)
        return out

    pairs = Dataset.from_dict({"prompt": prompts, "answer": answers})
    instruct = pairs.map(encode, batched=True, remove_columns=["prompt", "answer"])
    _plain_trainer(model_dir, tmp_path / "instruct", live.callback("instruct-no-end"), instruct,
                   DataCollatorForSeq2Seq(tokenizer, padding=True)).train()
    stop = live.fired("instruct-no-end")["stop_token_untrained"]
    assert stop.evidence["in_inputs"] == stop.evidence["in_labels"] == "0"
    assert int(stop.evidence["outside_loss"]) > 0
