"""Detectors over the facts reported at train begin: mistakes visible before step 1."""

from __future__ import annotations

from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import (
    SpecDetector,
    Verdict,
    fmt,
    is_rl,
    steps_after,
    warmup_steps,
)
from .frozen import FROZEN_STEPS
from .spec import (
    DetectorSpec,
    Evidence,
    FixCase,
    Policy,
    Severity,
    Threshold,
)


class PartialTargetModules(SpecDetector):
    """Some requested LoRA target modules matched nothing (a typo such as ``vproj``).

    PEFT raises only when no target matches at all; a partial match trains a smaller adapter
    than intended without a word.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a target list shared across architectures on purpose, where some names "
                         "exist only in other models"),
        id="partial_target_modules",
        severity=Severity.WARNING,
        latching=True,
        summary="Run {run_id} asked for LoRA target modules that matched nothing",
        meaning="some requested target_modules matched no module in the model (PEFT raises "
        "only when none match), so part of the intended adapter does not exist",
        fix="use the model's real module names in `target_modules` (or `\"all-linear\"`) and "
        "restart the run",
        fires_when="some requested `target_modules` (list entries, or the alternatives of a "
        "regex like `.*\\.(q_proj\\|vproj)`) matched no module",
        evidence=(Evidence("trainable_params", 4), Evidence("optimizer_params", 4)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        f = run.start.preflight
        if not f.is_peft or not f.unmatched_target_modules:
            return Verdict(False)
        requested = list(f.requested_target_modules) or [f.target_modules_regex]
        return Verdict(
            True,
            step=0,
            summary=(
                f"target_modules {', '.join(f.unmatched_target_modules)} matched no module "
                f"(requested: {', '.join(requested)})"
            ),
            evidence={
                "unmatched": ",".join(f.unmatched_target_modules),
                "requested": ",".join(requested),
                "step": "0 (train begin)",
            },
        )


class EmbeddingResized(SpecDetector):
    """The embedding has a different row count than the base model's vocabulary, and its new
    rows are neither trained nor saved on purpose.

    Typically a pad token added and ``resize_token_embeddings`` called before LoRA: the new
    rows stay random, PEFT saves the whole embedding (and a tied or separate lm_head) in every
    adapter, and the adapter no longer loads on the unmodified base model. A resize whose
    embedding is in ``modules_to_save`` or in ``trainable_token_indices`` is the correct way
    to add tokens and stays silent.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "new-tokens-trainable-token-indices", "new-tokens-modules-to-save"),
        false_positives=("an embedding resized to a padded multiple (`pad_to_multiple_of`) whose "
                         "extra rows are never used"),
        id="embedding_resized",
        severity=Severity.WARNING,
        latching=True,
        scope="artifact",  # it predicts what every saved adapter will hold
        summary="Run {run_id} resized the token embeddings under a LoRA adapter",
        meaning="the embedding rows differ from the base vocabulary and the new rows do not "
        "train, so the adapter will carry the whole embedding and no longer load on the base "
        "model",
        fix="reuse an existing token as pad instead of `resize_token_embeddings`, or train the new "
        "rows explicitly (`trainable_token_indices` / `modules_to_save`)",
        fires_when="the embedding's rows differ from the base model's `vocab_size` (pad token "
        "added + `resize_token_embeddings` before LoRA) and neither `modules_to_save` nor "
        "`trainable_token_indices` trains the new rows: the adapter will carry the embedding "
        "or not load on the base",
        evidence=(Evidence("checkpoint_adapter_bytes"), Evidence("trainable_params")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        f = run.start.preflight
        if not f.is_peft or f.base_vocab_size <= 0 or f.embedding_rows <= 0:
            return Verdict(False)
        if f.embedding_rows == f.base_vocab_size:
            return Verdict(False)
        if f.embedding_module and f.embedding_module in (
                *f.modules_to_save, *f.trainable_token_modules):
            return Verdict(False)  # the new rows train and the adapter carries them on purpose
        return Verdict(
            True,
            step=0,
            summary=(
                f"embedding has {f.embedding_rows} rows but the base model's vocabulary is "
                f"{f.base_vocab_size}, and {f.embedding_module or 'the embedding'} is neither in "
                f"modules_to_save nor in trainable_token_indices: the new rows stay untrained "
                f"and the adapter will carry the embedding or not load on the base"
            ),
            evidence={
                "embedding_rows": fmt(f.embedding_rows),
                "base_vocab_size": fmt(f.base_vocab_size),
                "tokenizer_size": fmt(f.tokenizer_size),
                "modules_to_save": ",".join(f.modules_to_save) or "none",
                "trainable_token_modules": ",".join(f.trainable_token_modules) or "none",
                "embedding_module": f.embedding_module or "unknown",
                "step": "0 (train begin)",
            },
        )


#: Preference trainers (the DPO family) and PPO, beside the RL trainers ``is_rl`` knows: their
#: full fine-tune default rate is 5e-7..1e-6 and their LoRA recipes run at 5e-6..5e-5 (a
#: QLoRA DPO at 5e-6 is a published recipe), far below an SFT LoRA's, so they have a floor
#: of their own.
PREFERENCE_TRAINERS = frozenset({
    "DPOTrainer", "KTOTrainer", "ORPOTrainer", "CPOTrainer", "BCOTrainer", "OnlineDPOTrainer",
    "NashMDTrainer", "XPOTrainer", "PPOTrainer"})


#: The evidence key (and ``fix_cases`` key) naming the run's kind of LoRA rates:
#: "preference" (the DPO family, RL) or "sft" (the rest).
LORA_LR_KIND = "lora_lr_kind"


def lora_lr_kind(run: RunState) -> str:
    """The run's kind of LoRA learning rates (``LORA_LR_KIND``)."""
    return "preference" if run.trainer in PREFERENCE_TRAINERS or is_rl(run) else "sft"


def lora_floor(run: RunState, settings: DetectorSettings) -> float:
    """The LoRA learning-rate floor of this run's kind of training."""
    if lora_lr_kind(run) == "preference":
        return settings.lora_lr_floor_preference
    return settings.lora_lr_floor


class LoraLrTooLow(SpecDetector):
    """The learning rate the optimizer really uses cannot train the adapter in this run.

    Judged on the optimizer's own rate (reported at train begin), not on an argument it may
    ignore; an optimizer that sets its own step size (Adafactor's ``relative_step``) is never
    judged by a configured rate. Fires for a learning rate of 0, a warmup at least as long as
    the run (the peak rate is never reached), a PEFT run below the LoRA floor of its kind
    (3e-5 above SFT's full fine-tune default of 2e-5; 3e-6 above DPO's and GRPO's 1e-6), or K
    optimizer steps at lr 0 after the warmup.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a LoRA run that deliberately uses a low rate (a large rank or alpha "
                         "scaling, rsLoRA, a careful second stage) is flagged though it learns; "
                         "preference and RL trainers have a floor ten times lower"),
        id="lora_lr_too_low",
        severity=Severity.WARNING,
        summary="Run {run_id} trains a LoRA adapter with a full-fine-tune learning rate",
        meaning="the learning rate is far below the LoRA range of its trainer (SFT: 1e-4..2e-4; "
        "DPO family and RL: 5e-6..5e-5), so the adapter learns almost nothing",
        fix="set the LoRA learning rate range explicitly (`learning_rate=1e-4` to `2e-4`) and "
        "check that the warmup ends",
        fix_cases=(FixCase(
            LORA_LR_KIND, "preference",
            "set the LoRA learning rate explicitly: DPO-family and RL LoRA recipes run at "
            "`5e-6` to `5e-5` (the trainer config's default `1e-6` is a full fine-tune rate), "
            "and check that the warmup ends"),),
        fires_when="the learning rate the optimizer really uses (its own, not an argument it "
        "ignores; none for Adafactor's `relative_step`) is 0 or, in a PEFT run, below the LoRA "
        "floor (`lora_lr_floor` for SFT and other trainers, `lora_lr_floor_preference` for "
        "DPO-family and RL trainers); a warmup at least as long as the run; "
        "or K steps at lr 0 after the warmup",
        thresholds=(Threshold("lora_lr_floor", "learning rate",
                              "a PEFT run configured below this learning rate is flagged (the "
                              "SFT full fine-tune default is 2e-5; an SFT LoRA wants ~1e-4)"),
                    Threshold("lora_lr_floor_preference", "learning rate",
                              "the same for DPO-family and RL trainers (their full fine-tune "
                              "default is 1e-6; their LoRA recipes run at 5e-6..5e-5)"),
                    FROZEN_STEPS),
        evidence=(Evidence("learning_rate", 1e-06), Evidence("update_ratio"),
                  Evidence("update_norm", 2e-06)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        config = run.config
        # the rate the optimizer really uses: its own (a Trainer handed an optimizer steps at
        # that one's rate), none at all when it sets its own step size (Adafactor's
        # relative_step ignores any configured rate), else the configured one
        own_step_size = config.get("optimizer_relative_step", 0.0) > 0
        lr = None if own_step_size else config.get("optimizer_lr", config.get("learning_rate"))
        total = int(config.get("total_steps", 0))
        warmup = warmup_steps(run)
        is_peft = run.start.preflight.is_peft
        evidence = {
            "learning_rate": fmt(lr),
            "configured_learning_rate": fmt(config.get("learning_rate")),
            "warmup_steps": fmt(warmup),
            "total_steps": fmt(total),
            "is_peft": str(is_peft).lower(),
            "lora_lr_floor": fmt(lora_floor(run, settings)),
            LORA_LR_KIND: lora_lr_kind(run),
        }
        if own_step_size:
            return Verdict(False)  # no configured rate or schedule is what it steps with
        reason = ""
        if lr is not None and lr <= 0:
            reason = "learning rate is 0"
        elif total > 0 and warmup >= total:
            reason = f"warmup ({warmup} steps) is not shorter than the run ({total} steps)"
        elif is_peft and lr is not None and lr < (floor := lora_floor(run, settings)):
            reason = f"LoRA at lr {lr:.3g}, below {floor:.3g} (a full fine-tune default)"
        else:
            window = steps_after(run.combined_steps(), warmup + 1)[-settings.frozen_steps:]
            if len(window) == settings.frozen_steps and all(
                    p.learning_rate == 0 for p in window):
                reason = f"lr 0 at steps {window[0].step}-{window[-1].step}, after the warmup"
                evidence["step"] = fmt(window[-1].step)
        if not reason:
            return Verdict(False)
        return Verdict(True, step=int(evidence.get("step", "0").split()[0]),
                       summary=f"{reason}: the adapter barely moves", evidence=evidence)


class NoKlAnchor(SpecDetector):
    """GRPO/RLOO with beta 0: nothing ties the policy to the reference model.

    TRL's default, so information rather than an error; with it the policy can drift and
    completions collapse without a KL term to show it.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("by design it fires on every GRPO/RLOO run with beta 0 (TRL's default), "
                         "most of which are fine: information only"),
        id="no_kl_anchor",
        severity=Severity.INFO,
        policy=Policy.OBSERVE,
        latching=True,
        summary="Run {run_id} trains with beta = 0 (no KL anchor to the reference)",
        meaning="GRPO/RLOO run without a KL penalty; the policy may drift (often fine, but "
        "worth knowing when completions shrink)",
        fix="if drift matters for this task, set a KL penalty (`GRPOConfig(beta=0.04)`) and check "
        "any wrapper forwards `beta`",
        fires_when="GRPO/RLOO with `beta=0` (TRL's default): nothing ties the policy to the "
        "reference",
        evidence=(Evidence("kl_series"), Evidence("completion_mean_length")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        if not is_rl(run) or run.config.get("beta", 0.0) != 0.0:
            return Verdict(False)
        return Verdict(
            True,
            step=0,
            summary=f"{run.trainer or 'the trainer'} runs with beta 0: no KL anchor, no kl logged",
            evidence={"beta": fmt(run.config.get("beta", 0.0)), "trainer": run.trainer,
                      "step": "0 (train begin)"},
        )


class ShardingFallback(SpecDetector):
    """The training config asked for one wrapper and the job runs under another.

    The client reports the wrapper it finds on the model and optimizer objects next to the one
    the config named. On CPU, a Trainer config asking for FSDP2 trains under DDP without a
    word (accelerate falls back): every rank holds the whole model, memory and checkpoints are
    not what was planned, and the update norms are replicas rather than shards.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "ddp-gloo-2-ranks"),
        false_positives=("a config that names FSDP or DeepSpeed but is meant to run unsharded here"
                         " (a CPU smoke test)"),
        id="sharding_fallback",
        severity=Severity.INFO,
        policy=Policy.OBSERVE,
        latching=True,
        scope="artifact",  # a fact of the run that stays true after it ends
        summary="Run {run_id} runs under another wrapper than its config asked for",
        meaning="the training config asked for FSDP or DeepSpeed but the job runs under "
        "another wrapper (e.g. DDP), so every rank may hold the whole model",
        fix="run where the requested wrapper is supported, or configure the wrapper the job really "
        "uses and size the run for it",
        fires_when="the config names FSDP1, FSDP2 or DeepSpeed and the objects at train begin "
        "show another wrapper (FSDP on CPU silently runs as DDP)",
        evidence=(Evidence("trainable_params"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        requested, actual = run.start.requested_wrapper, run.start.wrapper
        if not requested or not actual or requested == actual:
            return Verdict(False)
        return Verdict(
            True,
            step=0,
            summary=f"the config asked for {requested}; the job runs under {actual}",
            evidence={
                "requested_wrapper": requested,
                "wrapper": actual,
                "sharded": str(run.start.sharded).lower(),
                "world_size": fmt(run.start.world_size),
                "step": "0 (train begin)",
            },
        )
