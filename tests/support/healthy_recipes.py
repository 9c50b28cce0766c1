"""The healthy corpus: training recipes as users write them, each on a tiny local model.

Each recipe trains for real against a sidecar and must end with no warning or critical
verdict and nothing on the trainer's console but deadweight's begin and end lines. A recipe
is a function of a ``Kit`` (the sidecar, the tiny model, a folder) that returns the runs it
made (run id, optimizer steps); several recipes share one sidecar, so a detector that fires
wrongly on any of them shows. ``verdicts_and_noise`` is the one check of every recipe.

The recipes the other healthy tests already run are not repeated here: the TRL matrix of
``test_catalogue_healthy`` (SFT, DPO, GRPO, RLOO, KTO, reward, distillation), every PEFT
method of ``test_peft_methods``, the raw loops of ``test_optimizer_families`` and the LoRA
``run_clm`` blocks of ``test_packed_blocks``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch

import deadweight
from deadweight.callbacks.console import CONSOLE_LOGGER
from deadweight.demo import runs
from deadweight.demo.tiny_models import sample_lines
from deadweight.sidecar.model.nonces import Attestor
from deadweight.sidecar.registry import Registry
from tests.support.inprocess_sidecar import TEST_SETTINGS, InProcessSidecar
from tests.support.realprocs import wait_for

#: stalled_seconds and stalled_step_seconds: a few seconds against steps of a fraction of
#: one, so a stall verdict on a healthy recipe would show (the defaults are 300/1800 s).
STALL_SECONDS = 3.0


def corpus_sidecar(folder: Path) -> InProcessSidecar:
    """The corpus's sidecar, started on folder/deadweight.sock: the failure tests' short
    windows and a stall window of seconds, attested as ``deadweight serve`` is (so a run's
    console has no line about attestation)."""
    settings = replace(TEST_SETTINGS, stalled_seconds=STALL_SECONDS,
                       stalled_step_seconds=STALL_SECONDS)
    registry = Registry(settings=settings, attestor=Attestor())
    return InProcessSidecar(folder / "deadweight.sock", registry=registry,
                            checkpoint_settle_seconds=0.5).start()


@dataclass(frozen=True)
class Kit:
    """What a recipe trains with: the sidecar, the tiny model and its saved adapter, and a
    folder of its own."""

    live: InProcessSidecar
    model_dir: Path
    adapter_dir: Path
    folder: Path

    def callback(self, run_id: str) -> Any:
        return self.live.callback(run_id)


#: (run id, optimizer steps the run took).
Ran = tuple[str, int]


@dataclass(frozen=True)
class Recipe:
    """One healthy recipe: how it trains, and the information verdicts that are right on it
    (each with why)."""

    train: Callable[[Kit], list[Ran]]
    allowed: tuple[str, ...] = ()


# -- the check every recipe passes ---------------------------------------------------------

#: The console lines a healthy run shows: the begin line (whether or not the sidecar keeps a
#: state dir) and the end line's "no verdict".
BEGIN = re.compile(r"^deadweight: run \S+ reports to the sidecar at \S+(; open its report|, "
                   r"which keeps no state dir)")
END_CLEAN = re.compile(r"^deadweight: run \S+ ended \(\w+\) at step \d+; no verdict; ")
END_LISTED = re.compile(r"^deadweight: run \S+ ended \(\w+\) at step \d+ with \d+ verdict\(s\), "
                        r"root cause first: (?P<listed>.*); report: ")
VERDICT = re.compile(r"^deadweight (?P<severity>[A-Z]+) (?P<detector>\w+) \(step \d+\)")


class ConsoleLines(logging.Handler):
    """Every line deadweight writes at WARNING or above to the trainer's console: its console
    logger's lines (begin, verdicts, end; that logger does not propagate) and the warnings of
    the ``deadweight`` logger itself (the sidecar in this process logs under other child
    loggers, which are not the trainer's console and are left out)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name in SHOWN_LOGGERS:
            self.lines.append(record.getMessage())


#: The loggers whose lines reach the trainer's console.
SHOWN_LOGGERS = ("deadweight", CONSOLE_LOGGER)


@contextmanager
def console() -> Iterator[ConsoleLines]:
    handler = ConsoleLines()
    loggers = [logging.getLogger(name) for name in SHOWN_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def noise(lines: list[str], allowed: tuple[str, ...]) -> list[str]:
    """Console lines a healthy run must not show: anything but the begin line, the clean
    end line, and the verdict and end lines of the allowed information verdicts."""
    def expected(line: str) -> bool:
        if BEGIN.match(line) or END_CLEAN.match(line):
            return True
        if (verdict := VERDICT.match(line)) is not None:
            return verdict["severity"] == "INFO" and verdict["detector"] in allowed
        if (end := END_LISTED.match(line)) is not None:
            listed = re.findall(r"(\w+) \((\w+), step", end["listed"])
            return all(d in allowed and s == "info" for d, s in listed)
        return False

    return [line for line in lines if not expected(line)]


#: Longest wait for the sidecar to inspect a checkpoint the run reported (it settles 0.5 s).
INSPECTION_SECONDS = 20.0


def settled(live: InProcessSidecar, run_id: str, steps: int) -> list[str]:
    """Wait until the sidecar saw the run's last step and its end, and inspected every
    checkpoint it reported: the verdicts read after this are the run's last. Returns the
    checkpoints the sidecar never inspected (a recipe whose saves it cannot read)."""
    def ended() -> bool:
        run = live.run(run_id)
        return run is not None and run.ended and run.step >= steps

    wait_for(ended, 30, what=f"the end of {run_id} at step {steps}")

    def uninspected() -> list[str]:
        return [f"{p.path} (step {p.step})" for p in live.seen(run_id).checkpoints
                if p.inspection is None]

    try:
        wait_for(lambda: not uninspected(), INSPECTION_SECONDS,
                 what=f"checkpoint inspection of {run_id}")
    except TimeoutError:
        return uninspected()
    return []


def verdicts_and_noise(live: InProcessSidecar, ran: list[Ran], lines: list[str],
                       allowed: tuple[str, ...]) -> list[str]:
    """Every verdict that fired on the recipe's runs (at any point) and is not an allowed
    information verdict, with its severity, step, summary and evidence; every checkpoint the
    sidecar could not inspect; then every console line that is noise. Empty on a healthy
    recipe."""
    problems = []
    for run_id, steps in ran:
        problems += [f"{run_id}: checkpoint never inspected: {where}"
                     for where in settled(live, run_id, steps)]
        for detector, finding in sorted(live.fired(run_id).items()):
            if finding.severity == "info" and detector in allowed:
                continue
            problems.append(f"{run_id}: {detector} [{finding.severity}] at step {finding.step}: "
                            f"{finding.summary} evidence={dict(finding.fired_evidence)}")
    problems += [f"console: {line}" for line in noise(lines, allowed)]
    problems += [f"console: no begin line for {run_id} (is the console captured?)"
                 for run_id, _ in ran
                 if not any(BEGIN.match(line) and f" run {run_id} " in line for line in lines)]
    return problems


# -- TRL trainers ----------------------------------------------------------------------------

def _base(kit: Kit) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kit.model_dir)


def _trained(kit: Kit, run_id: str, trainer: Any, steps: int) -> list[Ran]:
    trainer.train()
    assert trainer.state.global_step == steps, (run_id, trainer.state.global_step)
    return [(run_id, steps)]


def sft_lora(kit: Kit, run_id: str, steps: int = 8) -> list[Ran]:
    """Plain SFT of a fresh LoRA on text: the run the busy-machine recipe trains."""
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=steps, save_steps=4, peft_config=runs.lora_config())
    return _trained(kit, run_id, trainer, steps)


def sft_packing(kit: Kit) -> list[Ran]:
    """SFT of a LoRA on plain text, packed into full-length rows (``packing=True``)."""
    run_id = "corpus-sft-packing"
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, peft_config=runs.lora_config(), packing=True)
    return _trained(kit, run_id, trainer, 6)


def sft_completion_only(kit: Kit) -> list[Ran]:
    """SFT on prompt/completion rows, the loss on the completion only."""
    run_id = "corpus-sft-completion-only"
    rows = {"prompt": sample_lines(48, seed=11), "completion": sample_lines(48, seed=12)}
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, peft_config=runs.lora_config(), rows=rows,
                               completion_only_loss=True)
    return _trained(kit, run_id, trainer, 6)


#: The tiny model's ChatML template with the assistant's turns marked for
#: ``assistant_only_loss`` (what the chat templates of instruct models carry).
GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def conversations(n: int) -> dict[str, list[Any]]:
    """User/assistant turns of generated words."""
    return {"messages": [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                         for q, a in zip(sample_lines(n, seed=13), sample_lines(n, seed=14),
                                         strict=True)]}


def sft_assistant_only(kit: Kit) -> list[Ran]:
    """SFT of a LoRA on conversations, the loss on the assistant's turns only."""
    from transformers import AutoTokenizer

    run_id = "corpus-sft-assistant-only"
    tokenizer = AutoTokenizer.from_pretrained(kit.model_dir)
    tokenizer.chat_template = GENERATION_TEMPLATE
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, peft_config=runs.lora_config(), tokenizer=tokenizer,
                               rows=conversations(48), assistant_only_loss=True, max_length=64)
    return _trained(kit, run_id, trainer, 6)


def sft_full_finetune(kit: Kit) -> list[Ran]:
    """SFT of the whole model at the usual full fine-tune learning rate."""
    run_id = "corpus-sft-full-finetune"
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, lr=2e-5)
    return _trained(kit, run_id, trainer, 6)


def dpo_lora(kit: Kit) -> list[Ran]:
    """DPO of a LoRA at beta 0.1 (the default) and a LoRA learning rate."""
    run_id = "corpus-dpo-lora-beta0.1"
    trainer = runs.dpo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               beta=0.1, steps=10, lr=5e-5, save_steps=5,
                               peft_config=runs.lora_config())
    return _trained(kit, run_id, trainer, 10)


def dpo_full_tiny_lr(kit: Kit) -> list[Ran]:
    """DPO of the whole model at the learning rate of the published full DPO recipes (5e-7,
    beta 0.01), a tenth of the steps in warmup, then a cosine decay: each step moves the
    weights by about a millionth of their size."""
    run_id = "corpus-dpo-full-lr5e-7"
    trainer = runs.dpo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               beta=0.01, steps=10, lr=5e-7, warmup=1, save_steps=5,
                               lr_scheduler_type="cosine")
    return _trained(kit, run_id, trainer, 10)


def dpo_lora_low_lr(kit: Kit) -> list[Ran]:
    """DPO of a LoRA at the published QLoRA DPO recipe's rate (5e-6, beta 0.01), a tenth of
    the steps in warmup, then a cosine decay."""
    run_id = "corpus-dpo-lora-lr5e-6"
    trainer = runs.dpo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               beta=0.01, steps=10, lr=5e-6, warmup=1, save_steps=5,
                               lr_scheduler_type="cosine", peft_config=runs.lora_config())
    return _trained(kit, run_id, trainer, 10)


def kto_resumed(kit: Kit) -> list[Ran]:
    """KTO that goes on training a saved adapter (loaded with ``is_trainable=True``)."""
    run_id = "corpus-kto-resumed-adapter"
    model = runs.load_adapter(kit.model_dir, kit.adapter_dir, trainable=True)
    trainer = runs.kto_trainer(model, kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, save_steps=3)
    return _trained(kit, run_id, trainer, 6)


def _preference(kit: Kit, run_id: str, module: str, name: str, **config: Any) -> list[Ran]:
    """An ORPO or CPO LoRA run (TRL 1.16 keeps both in ``trl.experimental``)."""
    import importlib

    from datasets import Dataset
    from transformers import AutoTokenizer

    found = importlib.import_module(f"trl.experimental.{module}")
    args = getattr(found, f"{name}Config")(
        output_dir=str(kit.folder), per_device_train_batch_size=2, max_length=64,
        **runs.common_args(6, 0, 2e-4, 3), **config)
    trainer = getattr(found, f"{name}Trainer")(
        model=_base(kit), args=args, train_dataset=Dataset.from_dict(runs.preference_rows(32)),
        processing_class=AutoTokenizer.from_pretrained(kit.model_dir),
        peft_config=runs.lora_config(), callbacks=[kit.callback(run_id)])
    return _trained(kit, run_id, trainer, 6)


def orpo_lora(kit: Kit) -> list[Ran]:
    return _preference(kit, "corpus-orpo-lora", "orpo", "ORPO", beta=0.1)


def cpo_lora(kit: Kit) -> list[Ran]:
    return _preference(kit, "corpus-cpo-lora", "cpo", "CPO", beta=0.1)


def reward_full_finetune(kit: Kit) -> list[Ran]:
    """A reward model trained whole (a new score head on the base), no adapter."""
    run_id = "corpus-reward-full-finetune"
    trainer = runs.reward_trainer(runs.reward_model(kit.model_dir), kit.model_dir, kit.folder,
                                  [kit.callback(run_id)], steps=6, lr=1e-5)
    return _trained(kit, run_id, trainer, 6)


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """The usual format reward: 1 when the completion opens with a closed ``<think>`` block.
    A tiny model never writes one, so it is the same (0) for every completion of a group."""
    return [1.0 if re.match(r"^<think>.*?</think>", str(c), re.DOTALL) else 0.0
            for c in completions]


def grpo_format_and_main(kit: Kit) -> list[Ran]:
    """GRPO of a LoRA with a varying main reward and a format reward beside it, at TRL's
    default beta (0: no reference model)."""
    run_id = "corpus-grpo-main-and-format-reward"
    trainer = runs.grpo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                                beta=0.0, steps=6, peft_config=runs.lora_config(),
                                reward_funcs=[runs.length_reward, format_reward],
                                num_generations=4, per_device_train_batch_size=4)
    return _trained(kit, run_id, trainer, 6)


def rloo_kl(kit: Kit) -> list[Ran]:
    """RLOO of a LoRA with a KL penalty (beta > 0)."""
    run_id = "corpus-rloo-kl"
    trainer = runs.rloo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                                beta=0.04, steps=6, save_steps=3,
                                peft_config=runs.lora_config(), num_generations=4,
                                per_device_train_batch_size=4)
    return _trained(kit, run_id, trainer, 6)


def grpo_num_iterations(kit: Kit) -> list[Ran]:
    """GRPO of a LoRA that takes two optimizer steps per generation batch
    (``num_iterations=2``: the clipped ratio against the sampling policy), with a KL term."""
    run_id = "corpus-grpo-num-iterations-2"
    trainer = runs.grpo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                                beta=0.04, steps=6, peft_config=runs.lora_config(),
                                num_generations=4, per_device_train_batch_size=4,
                                num_iterations=2)
    return _trained(kit, run_id, trainer, 6)


def grpo_dr_grpo(kit: Kit) -> list[Ran]:
    """GRPO of a LoRA with the Dr. GRPO loss and unscaled rewards
    (``loss_type="dr_grpo"``, ``scale_rewards=False``)."""
    run_id = "corpus-grpo-dr-grpo"
    trainer = runs.grpo_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                                beta=0.0, steps=6, peft_config=runs.lora_config(),
                                num_generations=4, per_device_train_batch_size=4,
                                loss_type="dr_grpo", scale_rewards=False)
    return _trained(kit, run_id, trainer, 6)


def online_dpo(kit: Kit) -> list[Ran]:
    """Online DPO of a LoRA: pairs sampled from the policy, ranked by a reward function."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    run_id = "corpus-online-dpo"
    args = OnlineDPOConfig(output_dir=str(kit.folder), per_device_train_batch_size=2,
                           max_new_tokens=8, **runs.common_args(6, 0, 2e-4, 3))
    trainer = OnlineDPOTrainer(
        model=_base(kit), reward_funcs=runs.length_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": sample_lines(32, seed=3)}),
        processing_class=AutoTokenizer.from_pretrained(kit.model_dir),
        peft_config=runs.lora_config(), callbacks=[kit.callback(run_id)])
    return _trained(kit, run_id, trainer, 6)


def gkd(kit: Kit) -> list[Ran]:
    """GKD of a LoRA student from a teacher on conversations."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    run_id = "corpus-gkd"
    args = GKDConfig(output_dir=str(kit.folder), per_device_train_batch_size=2,
                     max_new_tokens=8, max_length=64, **runs.common_args(6, 0, 2e-4, 3))
    trainer = GKDTrainer(
        model=_base(kit), teacher_model=runs.teacher_model(kit.model_dir), args=args,
        train_dataset=Dataset.from_dict(conversations(32)),
        processing_class=AutoTokenizer.from_pretrained(kit.model_dir),
        peft_config=runs.lora_config(), callbacks=[kit.callback(run_id)])
    return _trained(kit, run_id, trainer, 6)


# -- PEFT workflows --------------------------------------------------------------------------

def two_adapters(kit: Kit) -> list[Ran]:
    """Two adapters trained one after the other on one base: the first built by
    ``get_peft_model``, the second added with ``add_adapter`` and made active with
    ``set_adapter``; each training its own run."""
    from peft import get_peft_model

    model = get_peft_model(_base(kit), runs.lora_config())
    ran = []
    for name in ("default", "second"):
        if name == "second":
            model.add_adapter("second", runs.lora_config())
            model.set_adapter("second")
        run_id = f"corpus-adapter-{name}"
        trainer = runs.sft_trainer(model, kit.model_dir, kit.folder / name,
                                   [kit.callback(run_id)], steps=4, save_steps=2)
        ran += _trained(kit, run_id, trainer, 4)
    return ran


def save_variants(kit: Kit) -> list[Ran]:
    """A LoRA trained, then saved the ways scripts save it after training: the trainer's
    ``save_model`` and ``save_pretrained`` without the embedding layers."""
    run_id = "corpus-save-variants"
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder / "out",
                               [kit.callback(run_id)], steps=4, save_steps=2,
                               peft_config=runs.lora_config())
    ran = _trained(kit, run_id, trainer, 4)
    trainer.save_model(str(kit.folder / "final"))
    trainer.model.save_pretrained(kit.folder / "no-embeddings", save_embedding_layers=False)
    return ran


# -- Trainer workflows: evaluation, early stopping, resuming ---------------------------------

def sft_eval_best_early_stop(kit: Kit) -> list[Ran]:
    """SFT of a LoRA evaluated every 2 steps on held-out rows, saving at each evaluation,
    stopped early once the eval loss stops improving by 0.05, and the best checkpoint loaded
    back at the end (``load_best_model_at_end``): the weights step back to an earlier state."""
    from datasets import Dataset
    from transformers import AutoTokenizer, EarlyStoppingCallback
    from trl import SFTConfig, SFTTrainer

    run_id = "corpus-sft-eval-best-early-stop"
    args = SFTConfig(output_dir=str(kit.folder), per_device_train_batch_size=2, max_length=32,
                     **{**runs.common_args(40, 0, 2e-3, 2), "eval_strategy": "steps",
                        "eval_steps": 2, "per_device_eval_batch_size": 4,
                        "load_best_model_at_end": True, "metric_for_best_model": "eval_loss",
                        "save_total_limit": 2})
    trainer = SFTTrainer(
        model=_base(kit), args=args,
        train_dataset=Dataset.from_dict({"text": sample_lines(4, seed=21) * 40}),
        eval_dataset=Dataset.from_dict({"text": sample_lines(8, seed=22)}),
        processing_class=AutoTokenizer.from_pretrained(kit.model_dir),
        peft_config=runs.lora_config(),
        callbacks=[kit.callback(run_id), EarlyStoppingCallback(early_stopping_patience=2,
                                                               early_stopping_threshold=0.05)])
    trainer.train()
    steps = trainer.state.global_step
    assert 0 < steps < 40, f"{run_id} did not stop early (step {steps})"
    assert trainer.state.best_model_checkpoint is not None
    return [(run_id, steps)]


def sft_resumed_same_run_id(kit: Kit) -> list[Ran]:
    """SFT of a LoRA interrupted at step 4, then resumed from its last checkpoint by a new
    trainer (``train(resume_from_checkpoint=True)``) under the same run id, as a job restarted
    by its scheduler keeps its name."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if state.global_step >= 4:
                control.should_training_stop = True
            return control

    run_id = "corpus-sft-resumed-same-run-id"

    def trainer(callbacks: list[Any]) -> Any:
        return runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, callbacks, steps=8,
                                save_steps=2, peft_config=runs.lora_config())

    first = trainer([kit.callback(run_id), Interrupt()])
    first.train()
    assert first.state.global_step == 4
    second = trainer([kit.callback(run_id)])
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 8
    return [(run_id, 8)]


def sft_neftune(kit: Kit) -> list[Ran]:
    """SFT of a LoRA with NEFTune noise on the input embeddings (``neftune_noise_alpha``)."""
    run_id = "corpus-sft-neftune"
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, peft_config=runs.lora_config(),
                               neftune_noise_alpha=5.0)
    return _trained(kit, run_id, trainer, 6)


def sft_pissa(kit: Kit) -> list[Ran]:
    """SFT of a LoRA initialised from the base weights' principal components
    (``init_lora_weights="pissa"``): PEFT moves them out of the base into the adapter before
    training, so the base differs from its file from the start."""
    from peft import LoraConfig

    run_id = "corpus-sft-pissa"
    config = LoraConfig(r=4, lora_alpha=4, target_modules=runs.LORA_TARGETS,
                        init_lora_weights="pissa", task_type="CAUSAL_LM")
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, lr=5e-5, peft_config=config)
    return _trained(kit, run_id, trainer, 6)


def sft_lora_some_layers(kit: Kit) -> list[Ran]:
    """SFT of a LoRA on the last layer only (``layers_to_transform``), on purpose."""
    from peft import LoraConfig

    run_id = "corpus-sft-lora-some-layers"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=runs.LORA_TARGETS,
                        layers_to_transform=[1], task_type="CAUSAL_LM")
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, peft_config=config)
    return _trained(kit, run_id, trainer, 6)


def sft_lora_all_linear(kit: Kit) -> list[Ran]:
    """SFT of a LoRA on every linear layer (``"all-linear"``) with dropout and a higher rank
    for the MLP (``rank_pattern``)."""
    from peft import LoraConfig

    run_id = "corpus-sft-lora-all-linear"
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.05,
                        rank_pattern={"mlp.down_proj": 8}, task_type="CAUSAL_LM")
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, peft_config=config)
    return _trained(kit, run_id, trainer, 6)


def sft_lora_gradient_checkpointing(kit: Kit) -> list[Ran]:
    """SFT of a LoRA with gradient checkpointing (the QLoRA recipe's memory saver: the
    Trainer makes the frozen embeddings' output require grad so the adapter still gets one),
    a constant schedule after a warmup and weight decay."""
    run_id = "corpus-sft-lora-gradient-checkpointing"
    trainer = runs.sft_trainer(_base(kit), kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, warmup=2, peft_config=runs.lora_config(),
                               gradient_checkpointing=True,
                               lr_scheduler_type="constant_with_warmup", weight_decay=0.1)
    return _trained(kit, run_id, trainer, 6)


def sft_partial_freeze(kit: Kit) -> list[Ran]:
    """A full fine-tune with the embeddings and the first layer frozen by hand, the top
    layer and the head trained."""
    run_id = "corpus-sft-partial-freeze"
    model = _base(kit)
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    trainer = runs.sft_trainer(model, kit.model_dir, kit.folder, [kit.callback(run_id)],
                               steps=6, lr=5e-5)
    return _trained(kit, run_id, trainer, 6)


# -- plain Trainer: continued pre-training ---------------------------------------------------

def _clm_trainer(kit: Kit, run_id: str, model: Any, dataset: Any, collator: Any,
                 steps: int, **overrides: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(kit.folder), per_device_train_batch_size=4,
                             **{**runs.common_args(steps, 0, 5e-5, 3), **overrides})
    return Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                   callbacks=[kit.callback(run_id)])


def clm_grouped_blocks(kit: Kit) -> list[Ran]:
    """run_clm as it ships: the whole model, text tokenized, concatenated and cut into
    blocks, ``default_data_collator``, gradient checkpointing on."""
    from datasets import Dataset
    from transformers import AutoTokenizer, default_data_collator

    run_id = "corpus-clm-grouped-blocks"
    tokenizer = AutoTokenizer.from_pretrained(kit.model_dir)
    tokens = tokenizer(sample_lines(200, seed=21))["input_ids"]
    joined = list(chain.from_iterable(tokens))
    blocks = [joined[i:i + 32] for i in range(0, len(joined) // 32 * 32, 32)]
    dataset = Dataset.from_dict({"input_ids": blocks, "labels": [list(b) for b in blocks]})
    trainer = _clm_trainer(kit, run_id, _base(kit), dataset, default_data_collator, 6,
                           gradient_checkpointing=True)
    return _trained(kit, run_id, trainer, 6)


def clm_variable_rows(kit: Kit) -> list[Ran]:
    """Continued pre-training of a LoRA on rows of varying length, no eos appended, padded
    by ``DataCollatorForLanguageModeling(mlm=False)``."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    run_id = "corpus-clm-variable-rows"
    tokenizer = AutoTokenizer.from_pretrained(kit.model_dir)
    dataset = Dataset.from_dict(tokenizer(sample_lines(64, seed=22)))
    model = get_peft_model(_base(kit), runs.lora_config())
    trainer = _clm_trainer(kit, run_id, model, dataset,
                           DataCollatorForLanguageModeling(tokenizer, mlm=False), 6,
                           learning_rate=2e-4)
    return _trained(kit, run_id, trainer, 6)


# -- optimizer families through the Trainer --------------------------------------------------

def _optimized(kit: Kit, run_id: str, lr: float | None = None, optim: str | None = None,
               build: Callable[[Any], tuple[Any, Any]] | None = None) -> list[Ran]:
    """SFT of a LoRA under one optimizer: by name (``optim``) at learning rate ``lr``, or
    built by the script and handed to the trainer (``build(model) -> (optimizer,
    scheduler)``), the config's learning rate then left at its default, as scripts leave it
    (the optimizer carries its own)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = get_peft_model(_base(kit), runs.lora_config())
    extra: dict[str, Any] = {"optim": optim} if optim else {}
    common = runs.common_args(6, 0, lr or 0.0, 3)
    if lr is None:
        del common["learning_rate"]
    args = SFTConfig(output_dir=str(kit.folder), max_length=32, per_device_train_batch_size=2,
                     **common, **extra)
    trainer = SFTTrainer(model=model, args=args,
                         train_dataset=Dataset.from_dict({"text": sample_lines(64, seed=4)}),
                         processing_class=AutoTokenizer.from_pretrained(kit.model_dir),
                         optimizers=build(model) if build else (None, None),
                         callbacks=[kit.callback(run_id)])
    return _trained(kit, run_id, trainer, 6)


def optim_sgd(kit: Kit) -> list[Ran]:
    return _optimized(kit, "corpus-optim-sgd", lr=1e-2, optim="sgd")


def optim_sgd_momentum(kit: Kit) -> list[Ran]:
    return _optimized(kit, "corpus-optim-sgd-momentum", build=lambda m: (
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-2,
                        momentum=0.9), None))


def optim_adagrad(kit: Kit) -> list[Ran]:
    return _optimized(kit, "corpus-optim-adagrad", lr=1e-2, optim="adagrad")


def optim_rmsprop(kit: Kit) -> list[Ran]:
    return _optimized(kit, "corpus-optim-rmsprop", lr=1e-3, optim="rmsprop")


def optim_adafactor(kit: Kit) -> list[Ran]:
    return _optimized(kit, "corpus-optim-adafactor", lr=1e-3, optim="adafactor")


def relative_adafactor(model: Any) -> tuple[Any, Any]:
    """Adafactor with its own relative step size, as its documentation sets it up."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    optimizer = Adafactor([p for p in model.parameters() if p.requires_grad], lr=None,
                          scale_parameter=True, relative_step=True, warmup_init=True)
    return optimizer, AdafactorSchedule(optimizer)


def optim_adafactor_relative(kit: Kit) -> list[Ran]:
    return _optimized(kit, "corpus-optim-adafactor-relative-step", build=relative_adafactor)


# -- raw loops under deadweight.watch --------------------------------------------------------

def logged(kit: Kit, run_id: str, count: int) -> None:
    """Until the sidecar holds the loop's count-th log report: a real loop's step takes
    longer than the sidecar's turn, so the sidecar judges each step live, as it would."""
    wait_for(lambda: (run := kit.live.run(run_id)) is not None and run.log_steps >= count,
             15, what=f"log {count} of {run_id}")


def accelerate_loop(kit: Kit, accumulation: int, optimizer_steps: int = 6) -> list[Ran]:
    """An Accelerate loop over the whole tiny model, ``accumulate`` over ``accumulation``
    micro-batches, the loop logging every micro-batch under its own count."""
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    run_id = f"corpus-accelerate-accum-{accumulation}"
    tokenizer = AutoTokenizer.from_pretrained(kit.model_dir)
    rows = Dataset.from_dict(tokenizer(sample_lines(accumulation * optimizer_steps * 2,
                                                    seed=23)))
    loader = torch.utils.data.DataLoader(
        rows, batch_size=2, collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = _base(kit)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with deadweight.watch(model, optimizer, run_id=run_id, address=kit.live.address) as monitor:
        for step, batch in enumerate(loader, start=1):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            monitor.log(step, loss=loss)
            logged(kit, run_id, step)
        steps = monitor.step
    assert steps == optimizer_steps, (run_id, steps)
    return [(run_id, steps)]


def accelerate_1(kit: Kit) -> list[Ran]:
    return accelerate_loop(kit, 1)


def accelerate_4(kit: Kit) -> list[Ran]:
    return accelerate_loop(kit, 4)


def accelerate_16(kit: Kit) -> list[Ran]:
    return accelerate_loop(kit, 16, optimizer_steps=4)


def cnn() -> torch.nn.Module:
    """A small image classifier: two conv blocks with batch norm, a linear head."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 4))


def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 classes of 16x16 images: a bright quadrant (the class) in noise."""
    generator = torch.Generator().manual_seed(24)
    labels = torch.randint(0, 4, (n,), generator=generator)
    x = torch.randn(n, 1, 16, 16, generator=generator) * 0.5
    for i, label in enumerate(labels.tolist()):
        row, col = divmod(label, 2)
        x[i, 0, row * 8:(row + 1) * 8, col * 8:(col + 1) * 8] += 1.0
    return x, labels


def vision_batchnorm(kit: Kit, steps: int = 24) -> list[Ran]:
    """A plain PyTorch loop training the CNN (momentum SGD), logging loss and grad norm."""
    run_id = "corpus-vision-cnn-batchnorm"
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = images(steps * 16)
    with deadweight.watch(model, optimizer, run_id=run_id, address=kit.live.address) as monitor:
        model.train()
        for step in range(1, steps + 1):
            batch = slice((step - 1) * 16, step * 16)
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            optimizer.step()
            optimizer.zero_grad()
            monitor.log(step, loss=loss, grad_norm=grad_norm)
            logged(kit, run_id, step)
    return [(run_id, steps)]


#: name -> recipe, in the order they run (one process, one sidecar).
RECIPES: dict[str, Recipe] = {
    "sft-lora-packing": Recipe(sft_packing),
    "sft-lora-completion-only-loss": Recipe(sft_completion_only),
    "sft-lora-assistant-only-loss": Recipe(sft_assistant_only),
    "sft-full-finetune": Recipe(sft_full_finetune),
    "dpo-lora-beta0.1": Recipe(dpo_lora),
    "dpo-full-lr5e-7": Recipe(dpo_full_tiny_lr),
    "dpo-lora-lr5e-6": Recipe(dpo_lora_low_lr),
    "kto-resumed-adapter": Recipe(kto_resumed),
    "orpo-lora": Recipe(orpo_lora),
    "cpo-lora": Recipe(cpo_lora),
    "reward-full-finetune": Recipe(reward_full_finetune),
    # TRL's default beta 0 keeps no reference: no_kl_anchor says so, as information.
    "grpo-lora-main-and-format-reward": Recipe(grpo_format_and_main, ("no_kl_anchor",)),
    "rloo-lora-kl": Recipe(rloo_kl),
    "grpo-lora-num-iterations-2": Recipe(grpo_num_iterations),
    "grpo-lora-dr-grpo": Recipe(grpo_dr_grpo, ("no_kl_anchor",)),
    "online-dpo-lora": Recipe(online_dpo),
    "gkd-lora": Recipe(gkd),
    "peft-two-adapters-one-after-another": Recipe(two_adapters),
    "peft-save-variants": Recipe(save_variants),
    "sft-lora-eval-best-early-stop": Recipe(sft_eval_best_early_stop),
    "sft-lora-resumed-same-run-id": Recipe(sft_resumed_same_run_id),
    "sft-lora-neftune": Recipe(sft_neftune),
    "sft-pissa": Recipe(sft_pissa),
    "sft-lora-some-layers": Recipe(sft_lora_some_layers),
    "sft-lora-all-linear": Recipe(sft_lora_all_linear),
    "sft-partial-freeze": Recipe(sft_partial_freeze),
    "sft-lora-gradient-checkpointing": Recipe(sft_lora_gradient_checkpointing),
    "clm-grouped-blocks-full-gradient-checkpointing": Recipe(clm_grouped_blocks),
    "clm-variable-rows-no-eos-lora": Recipe(clm_variable_rows),
    "optim-sgd": Recipe(optim_sgd),
    "optim-sgd-momentum": Recipe(optim_sgd_momentum),
    "optim-adagrad": Recipe(optim_adagrad),
    "optim-rmsprop": Recipe(optim_rmsprop),
    "optim-adafactor": Recipe(optim_adafactor),
    "optim-adafactor-relative-step": Recipe(optim_adafactor_relative),
    "accelerate-accumulation-1": Recipe(accelerate_1),
    "accelerate-accumulation-4": Recipe(accelerate_4),
    "accelerate-accumulation-16": Recipe(accelerate_16),
    "vision-cnn-batchnorm": Recipe(vision_batchnorm),
}
