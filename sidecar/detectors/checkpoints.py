"""Detectors over the checkpoints a run wrote: what a promotion pipeline would ship.

These describe artifacts, so they keep firing after the run ended (until the run expires),
and they only look at checkpoints written after an optimizer step at lr > 0.
"""

from __future__ import annotations

from deadweight.sidecar.checkpoint_inspector import CheckpointInspection
from deadweight.sidecar.detectors.base import Policy, Severity, Verdict, fmt, trained_before
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import CheckpointPoint, RunState


def unchanged_from(run: RunState, point: CheckpointPoint) -> str:
    """"previous" or "initial" when point's adapter bytes equal them, else ""."""
    digest = point.digest
    if not digest or not trained_before(run, point.step):
        return ""
    earlier = [c for c in run.checkpoints if c.step < point.step and c.digest]
    if earlier and earlier[-1].digest == digest:
        return f"previous (step {earlier[-1].step})"
    if run.start is not None and run.start.initial_adapter.combined == digest:
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


def _latest_inspected(run: RunState) -> tuple[CheckpointPoint, CheckpointInspection] | None:
    for point in reversed(run.checkpoints):
        if point.inspection is not None:
            return point, point.inspection
    return None


class CheckpointUnchanged:
    """The latest checkpoint is byte-identical to the previous one or to the initial adapter."""

    id = "checkpoint_unchanged"
    severity = Severity.CRITICAL
    default_policy = Policy.PAGE
    latching = False
    scope = "artifact"

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


class AdapterNeverTrained:
    """Every adapted module of the saved adapter is still at its method's untrained identity.

    LoRA's ``B = 0``, IA3's ones, LoHa's ``hada_w2_b = 0``, ...: such an adapter computes
    exactly what the base model computes. Methods with a random start (prompt tuning) have no
    identity to test; an unchanged checkpoint is their evidence.
    """

    id = "adapter_never_trained"
    severity = Severity.CRITICAL
    default_policy = Policy.PAGE
    latching = False
    scope = "artifact"

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        latest = _latest_inspected(run)
        if latest is None:
            return None
        point, ins = latest
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


class AdapterBloat:
    """The adapter file carries tensors of the base model (embeddings, lm_head) larger than
    the adapter's own tensors."""

    id = "adapter_bloat"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = False
    scope = "artifact"

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        latest = _latest_inspected(run)
        if latest is None:
            return None
        point, ins = latest
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
                      "step": fmt(point.step)},
        )


class EmptyAdapter:
    """The saved weights hold no tensor, or only tensors without a single element.

    ZeRO-3 and FSDP keep each parameter partitioned across ranks; a save that does not gather
    them writes shape-``[0]`` tensors (or none): the file loads and changes nothing.
    """

    id = "empty_adapter"
    severity = Severity.CRITICAL
    default_policy = Policy.PAGE
    latching = False
    scope = "artifact"

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        latest = _latest_inspected(run)
        if latest is None:
            return None
        point, ins = latest
        if not ins.weights_file:
            return Verdict(False, step=point.step)
        tensors = len(ins.tensor_digests)
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


class PickleCheckpoint:
    """A checkpoint holds pickled weights (``.bin``, ``.pt``): loading them runs code."""

    id = "pickle_checkpoint"
    severity = Severity.WARNING
    default_policy = Policy.PAGE
    latching = False
    scope = "artifact"

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        latest = _latest_inspected(run)
        if latest is None:
            return None
        point, ins = latest
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
