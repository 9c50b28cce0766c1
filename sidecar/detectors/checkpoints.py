"""Detectors over the checkpoints a run wrote: what a promotion pipeline would ship.

These describe artifacts, so they keep firing after the run ended (until the run expires),
and they only look at checkpoints written after an optimizer step at lr > 0.
"""

from __future__ import annotations

from ..model.inspection import CheckpointInspection
from ..model.run_state import CheckpointPoint, RunState
from ..model.settings import DetectorSettings
from .base import SpecDetector, Verdict, fmt, trained_before
from .spec import (
    ROOT_CAUSES,
    DetectorSpec,
    Evidence,
    FixCase,
    Policy,
    Severity,
    Threshold,
)


def _tensor_count(point: CheckpointPoint) -> int:
    """Tensors behind the point's digest: the files' once inspected, else the callback's."""
    if point.inspection is not None and point.inspection.adapter_digest:
        return len(point.inspection.tensor_digests)
    return len(point.tensor_digests)


def unchanged_from(run: RunState, point: CheckpointPoint) -> str:
    """"previous" or "initial" when point's adapter bytes equal them, else "".

    A digest over no tensors (a full fine-tune has no adapter in memory; an empty file) is
    equal to every other such digest and says nothing: it is never compared.
    """
    digest = point.digest
    if not digest or not _tensor_count(point) or not trained_before(run, point.step):
        return ""
    earlier = [c for c in run.checkpoints
               if c.step < point.step and c.digest and _tensor_count(c)]
    if earlier and earlier[-1].digest == digest:
        return f"previous (step {earlier[-1].step})"
    initial = run.start.initial_adapter if run.start is not None else None
    if initial is not None and initial.tensors and initial.combined == digest:
        return "initial"
    return ""


def judge(run: RunState, point: CheckpointPoint) -> None:
    """Compare point with the previous checkpoint and the initial adapter; count it once.

    Called again when the files' inspection arrives: their bytes overrule the in-memory
    digest, but deadweight_checkpoint_unchanged_total is a counter and never goes down.
    """
    same = unchanged_from(run, point)
    if same and not point.counted_unchanged:
        run.checkpoints_unchanged += 1
        point.counted_unchanged = True
    point.unchanged_from = same


class _InspectedCheckpoint(SpecDetector):
    """A detector over the latest checkpoint whose files were inspected: no verdict before."""

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        for point in reversed(run.checkpoints):
            if point.inspection is not None:
                return self.judge_inspected(run, point, point.inspection, settings)
        return None

    def judge_inspected(self, run: RunState, point: CheckpointPoint, ins: CheckpointInspection,
                        settings: DetectorSettings) -> Verdict:
        raise NotImplementedError


class CheckpointUnchanged(SpecDetector):
    """The latest checkpoint is byte-identical to the previous one or to the initial adapter."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "warmup-lr-zero-checkpoint", "one-ulp-change"),
        false_positives=("none known past warmup: a checkpoint saved at an lr-0 warmup step is "
                         "left out"),
        symptom_of=(*ROOT_CAUSES, "no_optimizer_step", "zero_gradient"),
        id="checkpoint_unchanged",
        severity=Severity.CRITICAL,
        scope="artifact",
        summary="Run {run_id} writes checkpoints identical to the initial adapter",
        meaning="the saved adapter tensors hash equal to the previous or initial ones: the run "
        "produces nothing new",
        fix="fix the root cause (usually `is_trainable=True`), retrain, and gate promotion on "
        "`deadweight inspect`",
        fires_when="the latest checkpoint's adapter bytes (per-tensor xxh3-128) equal the "
        "previous checkpoint's or the initial adapter's",
        cadence="every checkpoint after a step that should have moved weights",
        evidence=(Evidence("checkpoint_unchanged_total", 2), Evidence("checkpoints_total"),
                  Evidence("update_norm", 0), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if not run.checkpoints:
            return None
        point = run.checkpoints[-1]
        if not point.unchanged_from:
            return Verdict(False, step=point.step)
        return Verdict(
            True,
            step=point.step,
            summary=(f"checkpoint at step {point.step} is byte-identical to the "
                     f"{point.unchanged_from} adapter"),
            evidence={"checkpoint": point.path, "step": fmt(point.step),
                      "digest": point.digest, "same_as": point.unchanged_from,
                      "checkpoints_unchanged": fmt(run.checkpoints_unchanged),
                      "checkpoints_total": fmt(run.checkpoints_total),
                      "inspected": str(point.inspection is not None).lower()},
        )


class AdapterNeverTrained(_InspectedCheckpoint):
    """Every adapted module of the saved adapter is still at its method's untrained identity.

    LoRA's ``B = 0``, IA3's ones, LoHa's ``hada_w2_b = 0``, ...: such an adapter computes
    exactly what the base model computes. Methods with a random start (prompt tuning) have no
    identity to test; an unchanged checkpoint is their evidence.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "peft-methods-trained"),
        false_positives=("none known: a trained adapter always leaves its identity; prompt and "
                         "prefix tuning have no identity and are left out"),
        symptom_of=(*ROOT_CAUSES, "no_optimizer_step", "zero_gradient"),
        id="adapter_never_trained",
        severity=Severity.CRITICAL,
        scope="artifact",
        summary="Run {run_id} saved an adapter that was never trained",
        meaning="every adapted module of the saved adapter is still at its PEFT method's "
        "untrained identity (LoRA B = 0, IA3 ones, ...): the adapter is the identity it "
        "started as",
        fix="load adapters for training with `is_trainable=True`, check the learning rate left 0, "
        "and gate promotion on `deadweight inspect`",
        fires_when="every adapted module of the saved adapter is exactly at its method's "
        "untrained identity, read per `peft_type` (LoRA/DoRA `lora_B` = 0, AdaLoRA `lora_E` = "
        "0, IA3 `ia3_l` = 1, LoHa/LoKr/VeRA/OFT factor = 0, BOFT `boft_R` = 0 and `boft_s` = "
        "1; prompt/prefix tuning have none)",
        cadence="every inspected checkpoint",
        evidence=(Evidence("checkpoints_total"), Evidence("checkpoint_adapter_bytes"),
                  Evidence("update_norm", 0)),
    )

    def judge_inspected(self, run: RunState, point: CheckpointPoint, ins: CheckpointInspection,
                        settings: DetectorSettings) -> Verdict:
        if (not ins.is_adapter or ins.identity_modules == 0 or ins.moved_modules > 0
                or not trained_before(run, point.step)):
            return Verdict(False, step=point.step)
        return Verdict(
            True,
            step=point.step,
            summary=(f"all {ins.identity_modules} adapted modules of the {ins.method} adapter "
                     f"in {point.path} are at its untrained identity ({ins.identity}): the "
                     f"adapter changes nothing"),
            evidence={"checkpoint": point.path, "step": fmt(point.step), "method": ins.method,
                      "identity": ins.identity, "identity_modules": fmt(ins.identity_modules),
                      "moved_modules": "0", "adapter_params": fmt(ins.adapter_params)},
        )


def _embeddings_resized(run: RunState) -> str:
    """"true"/"false" from the facts at train begin (embedding rows against the base model's
    vocabulary), "unknown" when either was not read."""
    f = run.start.preflight if run.start is not None else None
    if f is None or f.embedding_rows <= 0 or f.base_vocab_size <= 0:
        return "unknown"
    return str(f.embedding_rows != f.base_vocab_size).lower()


class AdapterBloat(_InspectedCheckpoint):
    """The adapter file carries tensors of the base model (embeddings, lm_head) larger than
    the adapter's own tensors."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin",
                         "new-tokens-trainable-token-indices"),
        false_positives=("an adapter that carries base tensors on purpose (modules_to_save of a "
                         "large head)"),
        symptom_of=("embedding_resized",),
        id="adapter_bloat",
        severity=Severity.WARNING,
        scope="artifact",
        summary="Run {run_id} saves an adapter with full base-model tensors",
        meaning="the adapter file holds base-model tensors (embed_tokens, lm_head, wte) and is "
        "far larger than its own adapter weights",
        fix="do not resize the embeddings for a pad token (reuse eos), or train only the new rows "
        "with `trainable_token_indices`",
        fires_when="the saved adapter holds tensors that are not its PEFT method's own "
        "(`embed_tokens`, `lm_head`, `wte`) with more parameters than the method's tensors",
        thresholds=(Threshold("adapter_bloat_ratio", "ratio",
                              "base-model parameters saved in an adapter, relative to the "
                              "adapter method's own parameters"),),
        evidence=(Evidence("checkpoint_adapter_bytes", 483328), Evidence("checkpoints_total")),
        fix_cases=(FixCase(
            "embeddings_resized", "false",
            "nothing was resized: the adapter carries the head or embedding because "
            "`modules_to_save` lists it (a tied `lm_head` is saved in full with its embedding) "
            "or `target_modules` names the embedding; keep full heads out of "
            "`modules_to_save` unless they must train, and save with "
            "`save_embedding_layers=False` when the embeddings did not change"),),
    )

    def judge_inspected(self, run: RunState, point: CheckpointPoint, ins: CheckpointInspection,
                        settings: DetectorSettings) -> Verdict:
        extra = ins.non_adapter_params
        own = max(ins.adapter_params, 1)
        if not ins.is_adapter or ins.adapter_tensors == 0 or extra <= (
                settings.adapter_bloat_ratio * own):
            return Verdict(False, step=point.step)
        names = sorted(ins.non_adapter, key=lambda t: -t[1])
        return Verdict(
            True,
            step=point.step,
            summary=(f"adapter holds {extra} params of the base model ("
                     f"{', '.join(n for n, _ in names[:3])}) vs {ins.adapter_params} "
                     f"{ins.method} params: {ins.tensor_bytes} bytes"),
            evidence={"checkpoint": point.path, "non_adapter_params": fmt(extra),
                      "adapter_params": fmt(ins.adapter_params), "method": ins.method,
                      "ratio": fmt(extra / own),
                      "adapter_bytes": fmt(ins.tensor_bytes),
                      "non_adapter_tensors": ",".join(n for n, _ in names[:5]),
                      "embeddings_resized": _embeddings_resized(run),
                      "step": fmt(point.step)},
        )


class EmptyAdapter(_InspectedCheckpoint):
    """The saved weights hold no tensor, or only tensors without a single element.

    ZeRO-3 and FSDP keep each parameter partitioned across ranks; a save that does not gather
    them writes shape-``[0]`` tensors (or none): the file loads and changes nothing.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "healthy-checkpoints"),
        false_positives="none known: a weights file with no element holds no model",
        id="empty_adapter",
        severity=Severity.CRITICAL,
        scope="artifact",
        summary="Run {run_id} saved an empty adapter",
        meaning="the checkpoint's weights file holds no tensor, only tensors without an element, "
        "or no bytes at all (a partitioned ZeRO-3/FSDP save that was never gathered)",
        fix="gather the full weights at save (ZeRO-3: `stage3_gather_16bit_weights_on_model_save: "
        "true`; FSDP: `FULL_STATE_DICT`)",
        fires_when="the inspected weights file is 0 bytes, holds no tensor, or every tensor has "
        "a 0 in its shape",
        cadence="every inspected checkpoint",
        evidence=(Evidence("checkpoint_adapter_bytes", 0), Evidence("checkpoints_total")),
    )

    def judge_inspected(self, run: RunState, point: CheckpointPoint, ins: CheckpointInspection,
                        settings: DetectorSettings) -> Verdict:
        if not ins.weights_file:
            return Verdict(False, step=point.step)
        tensors = max(ins.tensor_count, len(ins.tensor_digests))
        if tensors and len(ins.empty_tensors) < tensors:  # AdaLoRA prunes some to rank 0
            return Verdict(False, step=point.step)
        what = "no tensor at all" if not tensors else f"{tensors} tensors without an element"
        return Verdict(
            True,
            step=point.step,
            summary=f"{ins.weights_file} in {point.path} holds {what}: the saved weights are "
                    f"empty (a partitioned save that was never gathered?)",
            evidence={"checkpoint": point.path, "step": fmt(point.step),
                      "tensors": fmt(tensors), "empty_tensors": fmt(len(ins.empty_tensors)),
                      "empty_tensor_names": ",".join(ins.empty_tensors[:5]),
                      "bytes": fmt(ins.tensor_bytes)},
        )


class PickleCheckpoint(_InspectedCheckpoint):
    """A checkpoint holds pickled weights (``.bin``, ``.pt``): loading them runs code."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "trainer-resume-pickles"),
        false_positives=("a trusted pickle the user wrote on purpose; the Trainer's own resume "
                         "files are not counted"),
        id="pickle_checkpoint",
        severity=Severity.WARNING,
        scope="artifact",
        summary="Run {run_id} wrote a pickle checkpoint",
        meaning="a checkpoint holds a pickle file (adapter_model.bin / pytorch_model.bin); "
        "loading it can run arbitrary code",
        fix="save with safetensors (`save_safetensors=True`, `safe_serialization=True`) and never "
        "load an untrusted pickle",
        fires_when="a checkpoint holds pickled weights (`adapter_model.bin`, `*.pt`, ...); the "
        "Trainer's own resume files (`training_args.bin`, `optimizer.pt`, `scheduler.pt`, "
        "`rng_state*.pth`) are not counted",
        cadence="every inspected checkpoint",
        evidence=(Evidence("checkpoints_total"),),
    )

    def judge_inspected(self, run: RunState, point: CheckpointPoint, ins: CheckpointInspection,
                        settings: DetectorSettings) -> Verdict:
        files = ins.pickle_files
        if not files:
            return Verdict(False, step=point.step)
        return Verdict(
            True,
            step=point.step,
            summary=f"{point.path} holds pickled weights: {', '.join(files)}",
            evidence={"checkpoint": point.path, "pickle_files": ",".join(files),
                      "step": fmt(point.step)},
        )


class CheckpointRefused(SpecDetector):
    """A checkpoint path the run named was not read: outside ``--watch-root``, another uid's,
    over a size cap, or not a regular file. Its verdicts are unknown, and it may be an attack."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a checkpoint folder on shared storage owned by a service uid, or a "
                         "symlinked output folder"),
        id="checkpoint_refused",
        severity=Severity.WARNING,
        # Observed, not paged: the run's own uid names the paths, so a page on every
        # refusal would let any trainer page on-call at will.
        policy=Policy.OBSERVE,
        scope="artifact",
        summary="Run {run_id} named checkpoints the sidecar refused to read",
        meaning="a checkpoint folder the run named belongs to another uid than the run's, lies "
        "outside the allowed --watch-root folders, exceeds a header cap or is not a regular "
        "file: its checkpoints were not audited",
        fires_when="a client-named checkpoint path was refused (its folder or a file in it "
        "owned by another uid than the run's attested one, an unattested run without "
        "`--watch-root`, outside `--watch-root`, header or tensor count over its cap, a FIFO "
        "or symlink)",
        fix="write checkpoints as the training uid, into the run's own output folder (and under "
        "a `deadweight serve --watch-root DIR` where one is set)",
        cadence="every refused path",
        evidence=(Evidence("checkpoints_total"),),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if not run.refused_paths:
            return None
        path, reason = run.refused_paths[-1]
        return Verdict(
            True,
            step=run.step,
            summary=f"{run.refused_total} checkpoint path(s) not read; latest {path}: {reason}",
            evidence={"path": path, "reason": reason, "refused": fmt(run.refused_total)},
        )
