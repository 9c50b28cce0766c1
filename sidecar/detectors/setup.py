"""Detectors over the facts reported at train begin: mistakes visible before step 1."""

from __future__ import annotations

from deadweight.sidecar.detectors.base import Policy, Severity, Verdict, fmt, is_rl
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import RunState


class PartialTargetModules:
    """Some requested LoRA target modules matched nothing (a typo such as ``vproj``).

    PEFT raises only when no target matches at all; a partial match trains a smaller adapter
    than intended without a word.
    """

    id = "partial_target_modules"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = True

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


class EmbeddingResized:
    """The embedding has a different row count than the base model's vocabulary, and its new
    rows are neither trained nor saved on purpose.

    Typically a pad token added and ``resize_token_embeddings`` called before LoRA: the new
    rows stay random, PEFT saves the whole embedding (and a tied or separate lm_head) in every
    adapter, and the adapter no longer loads on the unmodified base model. A resize whose
    embedding is in ``modules_to_save`` or in ``trainable_token_indices`` is the correct way
    to add tokens and stays silent.
    """

    id = "embedding_resized"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = True
    scope = "artifact"  # it predicts what every saved adapter will hold

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


class LoraLrTooLow:
    """The configured learning rate cannot train the adapter in this run.

    Fires for a learning rate of 0, a warmup at least as long as the run (the peak rate is
    never reached), a PEFT run below the LoRA floor (the full fine-tune defaults: 2e-5 for SFT,
    1e-6 for GRPO/DPO), or K optimizer steps at lr 0 after the warmup.
    """

    id = "lora_lr_too_low"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = False

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        config = run.config
        lr = config.get("learning_rate")
        total = int(config.get("total_steps", 0))
        warmup = int(config.get("resolved_warmup_steps", config.get("warmup_steps", 0)))
        is_peft = run.start.preflight.is_peft
        evidence = {
            "learning_rate": fmt(lr),
            "warmup_steps": fmt(warmup),
            "total_steps": fmt(total),
            "is_peft": str(is_peft).lower(),
            "lora_lr_floor": fmt(settings.lora_lr_floor),
        }
        reason = ""
        if lr is not None and lr <= 0:
            reason = "learning rate is 0"
        elif total > 0 and warmup >= total:
            reason = f"warmup ({warmup} steps) is not shorter than the run ({total} steps)"
        elif is_peft and lr is not None and lr < settings.lora_lr_floor:
            reason = (f"LoRA at lr {lr:.3g}, below {settings.lora_lr_floor:.3g} (a full "
                      f"fine-tune default)")
        else:
            late = [p for p in run.combined_steps() if p.step > warmup + 1]
            window = late[-settings.frozen_steps:]
            if len(window) == settings.frozen_steps and all(
                    p.learning_rate == 0 for p in window):
                reason = f"lr 0 at steps {window[0].step}-{window[-1].step}, after the warmup"
                evidence["step"] = fmt(window[-1].step)
        if not reason:
            return Verdict(False)
        return Verdict(True, step=int(evidence.get("step", "0").split()[0]),
                       summary=f"{reason}: the adapter barely moves", evidence=evidence)


class NoKlAnchor:
    """GRPO/RLOO with beta 0: nothing ties the policy to the reference model.

    TRL's default, so information rather than an error; with it the policy can drift and
    completions collapse without a KL term to show it.
    """

    id = "no_kl_anchor"
    severity = Severity.INFO
    default_policy = Policy.OBSERVE
    latching = True

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
