"""Detectors for runs that train in name only: every step runs, nothing useful is learned.

Each covers one mechanism that leaves loss and grad_norm looking ordinary: no gradient at all,
steps the fp16 scaler throws away, weights too coarse to take the update, a stop token the
loss never sees, completions that never end, a head that is random at reload, data the
trainer dropped, a resume that restarted the adapter, an AdaLoRA that never allocates.
"""

from __future__ import annotations

from deadweight.sidecar.detectors.base import SpecDetector, Verdict, finite_history, fmt, is_rl
from deadweight.sidecar.detectors.spec import DetectorSpec, Evidence, Severity, Threshold
from deadweight.sidecar.settings import DetectorSettings
from deadweight.sidecar.state import RunState

#: Dtypes in which an optimizer step loses every update below half a unit in the last place.
LOW_PRECISION = frozenset({"bfloat16", "float16"})


class ZeroGradient(SpecDetector):
    """grad_norm is exactly 0 at lr > 0 with a non-empty optimizer: nothing to learn from.

    DPO with beta 0 (loss ln 2 for every pair), a loss detached from the weights, a reward
    without spread: any trainer. Weights do not move (or move by decay alone), which
    ``frozen_weights`` leaves alone because no gradient flows.
    """

    spec = DetectorSpec(
        id="zero_gradient",
        severity=Severity.CRITICAL,
        summary="Run {run_id} trains with a gradient of exactly zero",
        meaning="grad_norm is exactly 0 at lr > 0 with a non-empty optimizer: the loss gives "
        "the weights nothing to learn from (DPO with beta 0, a detached loss, a flat reward)",
        fires_when="`grad_norm` exactly 0 in the last log reports at lr > 0 (skipped fp16 "
        "steps left out) while the optimizer holds parameters",
        thresholds=(Threshold("zero_gradient_logs", "log reports",
                              "consecutive log reports at lr > 0 with grad_norm exactly 0"),),
        evidence=(Evidence("grad_norm", 0), Evidence("update_norm", 0), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        grads = finite_history(run, "grad_norm")
        if not grads:
            return None
        by_step = {p.step: p for p in run.combined_steps()}
        counted = [(s, g) for s, g in grads
                   if (point := by_step.get(s)) is None
                   or (point.learning_rate > 0 and not point.skipped)]
        streak = []  # the trailing log reports with grad_norm exactly 0, newest first
        for s, g in reversed(counted):
            if g != 0:
                break
            streak.append(s)
        last = by_step.get(streak[0]) if streak else None
        if (len(streak) < settings.zero_gradient_logs
                or (last is not None and last.optimizer_params == 0)):
            return Verdict(False)
        first, end = streak[-1], streak[0]
        # The report at which the streak reached its length, however the logs were batched.
        reached = streak[-settings.zero_gradient_logs]
        return Verdict(
            True,
            step=reached,
            summary=(f"grad_norm exactly 0 for {len(streak)} log reports (steps {first}-{end}) "
                     f"at lr {fmt(last.learning_rate if last else None)}: the loss gives the "
                     f"weights nothing to learn (loss={fmt(run.log_value('loss'))})"),
            evidence={"grad_norm": "0", "zero_logs": fmt(len(streak)), "steps": f"{first}-{end}",
                      "loss": fmt(run.log_value("loss")),
                      "update_norm": fmt(last.update_norm if last else None),
                      "optimizer_params": fmt(last.optimizer_params if last else None),
                      "step": fmt(end)},
        )


class OptimizerStepsSkipped(SpecDetector):
    """The optimizer skipped K steps in a row: fp16 loss scaling found inf/NaN gradients.

    A skipped step is no evidence of frozen weights (``frozen_weights`` ignores it); a run
    whose every step is skipped is its own failure: the weights never change.
    """

    spec = DetectorSpec(
        id="optimizer_steps_skipped",
        severity=Severity.CRITICAL,
        summary="Run {run_id} skips every optimizer step",
        meaning="the optimizer skipped several steps in a row (fp16 loss scaling found inf/NaN "
        "gradients): the weights do not change",
        fires_when="the last optimizer steps were all skipped (the optimizer says so, or its "
        "GradScaler backed off)",
        thresholds=(Threshold("skipped_steps", "optimizer steps",
                              "consecutive skipped optimizer steps"),),
        evidence=(Evidence("update_norm", 0), Evidence("grad_norm"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        steps = run.combined_steps()
        if not steps:
            return None
        streak = 0
        for point in reversed(steps):
            if not point.skipped:
                break
            streak += 1
        if streak < settings.skipped_steps:
            return Verdict(False, step=steps[-1].step)
        skipped = sum(p.skipped for p in steps)
        first = steps[-streak]
        return Verdict(
            True,
            step=steps[-streak + settings.skipped_steps - 1].step,
            summary=(f"the optimizer skipped {streak} steps in a row (steps {first.step}-"
                     f"{steps[-1].step}; {skipped} of {len(steps)} reported): fp16 gradients "
                     f"overflow, the weights do not change"),
            evidence={"skipped_steps": fmt(skipped), "reported_steps": fmt(len(steps)),
                      "streak": fmt(streak), "first_skipped_step": fmt(first.step),
                      "all_skipped": str(skipped == len(steps)).lower(),
                      "step": fmt(steps[-1].step)},
        )


class LowPrecisionUpdate(SpecDetector):
    """The optimizer updates weights held in bf16/fp16, without an fp32 master copy.

    An update below half a unit in the last place rounds back to the old value: at lr 2e-4
    most elements of a bf16 LoRA never move, while every tensor changes a little and loss and
    grad_norm look normal (``model.to(torch.bfloat16)`` after ``get_peft_model`` undoes PEFT's
    fp32 adapter autocast; a DoRA magnitude left in bf16; a pure-bf16 full fine-tune).
    """

    spec = DetectorSpec(
        id="low_precision_update",
        severity=Severity.WARNING,
        latching=True,
        summary="Run {run_id} updates bf16/fp16 weights without an fp32 master copy",
        meaning="most elements the optimizer updates are held in bf16 or fp16: updates below "
        "half a unit in the last place are lost, so many weights never move",
        fires_when="at train begin, the share of the optimizer's elements held in bf16/fp16 "
        "reaches the threshold",
        thresholds=(Threshold("low_precision_fraction", "ratio",
                              "share of the optimizer's elements held in bf16/fp16"),),
        evidence=(Evidence("optimizer_params"), Evidence("update_ratio"), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        by_dtype = dict(run.start.trainable_params_by_dtype)
        total = sum(by_dtype.values())
        low = sum(n for d, n in by_dtype.items() if d in LOW_PRECISION)
        if total <= 0 or low / total < settings.low_precision_fraction:
            return Verdict(False)
        dtypes = ",".join(f"{d}={n}" for d, n in sorted(by_dtype.items()))
        return Verdict(
            True,
            step=0,
            summary=(f"{low} of {total} elements the optimizer updates are held in "
                     f"{'/'.join(sorted(d for d in by_dtype if d in LOW_PRECISION))}: updates "
                     f"below half a unit in the last place are lost"),
            evidence={"low_precision_params": fmt(low), "optimizer_params": fmt(total),
                      "dtypes": dtypes, "step": "0 (train begin)"},
        )


class StopTokenUntrained(SpecDetector):
    """The labels of a collated batch never train the stop token: the model never learns to stop.

    ``pad_token == eos_token`` with transformers' LM collator masks every eos label; a chat
    template or completion mask can leave the end-of-turn token outside the loss.
    """

    spec = DetectorSpec(
        id="stop_token_untrained",
        severity=Severity.WARNING,
        latching=True,
        summary="Run {run_id} never trains the stop token",
        meaning="the labels of a batch collated at train begin never contain the stop token: "
        "the model never learns to stop (pad == eos with the LM collator, a template that "
        "leaves the end of turn outside the loss)",
        fires_when="at train begin, the trainer's collator applied to the first rows yields "
        "labels without the stop token (`eos_token`)",
        evidence=(Evidence("loss"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        if not run.start.HasField("stop_token"):
            return Verdict(False)
        check = run.start.stop_token
        if check.sequences <= 0 or check.in_labels > 0:
            return Verdict(False)
        where = (f"appears {check.in_inputs} times in the inputs but never in the labels"
                 if check.in_inputs else "appears in neither the inputs nor the labels")
        return Verdict(
            True,
            step=0,
            summary=(f"stop token {check.token!r} (id {check.token_id}) {where} of "
                     f"{check.sequences} collated sequences: the model never learns to stop"),
            evidence={"token": check.token, "token_id": fmt(check.token_id),
                      "sequences": fmt(check.sequences), "in_inputs": fmt(check.in_inputs),
                      "in_labels": "0", "step": "0 (train begin)"},
        )


class UnsavedHead(SpecDetector):
    """A newly initialised output head is not in ``modules_to_save``: the saved adapter reloads
    with a new random head (frozen and random all along, or trained and then lost)."""

    spec = DetectorSpec(
        id="unsaved_head",
        severity=Severity.CRITICAL,
        latching=True,
        scope="artifact",
        summary="Run {run_id} trains around a random head its adapter does not save",
        meaning="a newly initialised output head (score, classifier) is not in modules_to_save: "
        "the saved adapter reloads with a new random head",
        fires_when="at train begin, a head absent from the base checkpoint is not listed in "
        "the adapter's `modules_to_save`",
        evidence=(Evidence("trainable_params"), Evidence("checkpoint_adapter_bytes")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        if not run.start.HasField("heads"):
            return Verdict(False)
        h = run.start.heads
        lost = [n for n in h.new_heads if n not in h.saved_heads]
        if not lost:
            return Verdict(False)
        trains = [n for n in lost if n in h.trainable_heads]
        how = "trains but is not saved" if trains else "stays frozen at its random init"
        return Verdict(
            True,
            step=0,
            summary=(f"head {', '.join(lost)} is new (not in the base checkpoint), {how}, and "
                     f"is not in modules_to_save: the saved adapter reloads with a random head"),
            evidence={"heads": ",".join(h.heads), "new_heads": ",".join(h.new_heads),
                      "saved_heads": ",".join(h.saved_heads) or "none",
                      "trainable_heads": ",".join(h.trainable_heads) or "none",
                      "step": "0 (train begin)"},
        )


class DatasetShrunk(SpecDetector):
    """The trainer dropped part of the training rows during its own preparation, unannounced."""

    spec = DetectorSpec(
        id="dataset_shrunk",
        severity=Severity.WARNING,
        latching=True,
        summary="Run {run_id} trains on a silently shrunken dataset",
        meaning="the trainer dropped part of the training rows in its own preparation (too "
        "long for max_length) without a count",
        fires_when="at train begin, the rows the trainer kept fall short of the rows it was "
        "given by at least the threshold",
        thresholds=(Threshold("dataset_drop_fraction", "ratio",
                              "share of the given training rows the trainer dropped"),),
        evidence=(Evidence("step"), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        if not run.start.HasField("dataset_rows"):
            return Verdict(False)
        rows = run.start.dataset_rows
        dropped = rows.given - rows.kept
        if rows.given <= 0 or dropped / rows.given < settings.dataset_drop_fraction:
            return Verdict(False)
        return Verdict(
            True,
            step=0,
            summary=(f"{run.trainer or 'the trainer'} kept {rows.kept} of {rows.given} "
                     f"training rows: {dropped} ({dropped / rows.given:.0%}) were dropped in "
                     f"its preparation (too long for max_length?)"),
            evidence={"rows_given": fmt(rows.given), "rows_kept": fmt(rows.kept),
                      "rows_dropped": fmt(dropped),
                      "max_length": fmt(run.config.get("max_length")),
                      "step": "0 (train begin)"},
        )


class ResumeLostAdapter(SpecDetector):
    """After resuming, the adapter in memory is not the adapter of the checkpoint resumed from:
    training restarted from a fresh (or another) adapter while the step count went on."""

    spec = DetectorSpec(
        id="resume_lost_adapter",
        severity=Severity.CRITICAL,
        latching=True,
        summary="Run {run_id} resumed without the adapter it resumed from",
        meaning="after resume_from_checkpoint the adapter in memory differs from the "
        "checkpoint's adapter: training restarted while the step count went on",
        fires_when="at train begin of a resumed run, the digest of the adapter in memory "
        "differs from the digest of the resumed checkpoint's adapter file",
        evidence=(Evidence("step"), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        if not run.start.HasField("resume"):
            return Verdict(False)
        resume = run.start.resume
        saved = resume.checkpoint_adapter.combined
        memory = run.start.initial_adapter.combined
        if not saved or not memory or saved == memory:
            return Verdict(False)
        differing = sorted(
            n for n, d in resume.checkpoint_adapter.tensors.items()
            if run.start.initial_adapter.tensors.get(n) != d)
        return Verdict(
            True,
            step=resume.step,
            summary=(f"resumed at step {resume.step} from {resume.checkpoint}, but the adapter "
                     f"in memory differs from that checkpoint's in {len(differing)} of "
                     f"{len(resume.checkpoint_adapter.tensors)} tensors: training restarted"),
            evidence={"checkpoint": resume.checkpoint, "step": fmt(resume.step),
                      "checkpoint_digest": saved, "memory_digest": memory,
                      "differing_tensors": fmt(len(differing)),
                      "first_loss_before": fmt(resume.first_loss)},
        )


class AdaloraNotAllocated(SpecDetector):
    """AdaLoRA past ``tinit + deltaT`` has no rank_pattern: nothing calls ``update_and_allocate``
    (transformers and TRL never do), so it trains as a plain LoRA of rank ``init_r``."""

    spec = DetectorSpec(
        id="adalora_not_allocated",
        severity=Severity.WARNING,
        summary="Run {run_id} trains AdaLoRA as plain LoRA",
        meaning="AdaLoRA is past tinit + deltaT without a rank_pattern: nothing calls "
        "update_and_allocate, so ranks are never allocated",
        fires_when="an AdaLoRA run reports a step past `tinit + deltaT + 1` and no rank pattern "
        "was ever allocated",
        cadence="every optimizer step",
        evidence=(Evidence("trainable_params"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        config = run.config
        if "adalora_tinit" not in config:
            return None
        steps = [p for p in run.combined_steps() if p.adalora_allocated is not None]
        if not steps:
            return None
        tinit, delta = int(config["adalora_tinit"]), int(config.get("adalora_deltaT", 1))
        end = int(config.get("adalora_total_step", 0)) - int(config.get("adalora_tfinal", 0))
        due = tinit + max(delta, 1) + 1  # one step of slack: callbacks run in any order
        last = steps[-1]
        if any(p.adalora_allocated for p in steps) or last.step <= due or due >= end > 0:
            return Verdict(False, step=last.step)
        # The step at which allocation was overdue, however the steps were batched.
        overdue = next(p.step for p in steps if p.step > due)
        return Verdict(
            True,
            step=overdue,
            summary=(f"AdaLoRA at step {last.step} has no rank_pattern (allocation due after "
                     f"step {tinit} every {delta}): update_and_allocate is never called, it "
                     f"trains as plain LoRA of rank {fmt(config.get('adalora_init_r'))}"),
            evidence={"tinit": fmt(tinit), "deltaT": fmt(delta),
                      "total_step": fmt(config.get("adalora_total_step")),
                      "init_r": fmt(config.get("adalora_init_r")),
                      "target_r": fmt(config.get("adalora_target_r")),
                      "step": fmt(last.step)},
        )


class CompletionsTruncated(SpecDetector):
    """Every GRPO/RLOO completion hits max_completion_length: the policy never sees an ending.

    ``completions/clipped_ratio`` is 1 and ``completions/mean_terminated_length`` 0 in every
    log report of the window; rewards still vary, so nothing else fires.
    """

    spec = DetectorSpec(
        id="completions_truncated",
        severity=Severity.WARNING,
        summary="Run {run_id}: no completion ever ends",
        meaning="every GRPO/RLOO completion hits max_completion_length (clipped_ratio 1, no "
        "terminated completion): the policy never sees an ending",
        fires_when="`completions/clipped_ratio` is 1 and `completions/mean_terminated_length` "
        "0 in every log report of the window",
        thresholds=(Threshold("truncated_logs", "log reports",
                              "consecutive log reports with every completion truncated"),),
        evidence=(Evidence("completion_mean_length"), Evidence("reward")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if not is_rl(run):
            return None
        clipped = finite_history(run, "completions/clipped_ratio")
        if not clipped:
            return None
        terminated = dict(run.history("completions/mean_terminated_length"))
        streak = []  # the trailing reports in which every completion was cut, newest first
        for s, v in reversed(clipped):
            if v < 1.0 or (terminated.get(s) or 0.0) > 0:
                break
            streak.append((s, v))
        if len(streak) < settings.truncated_logs:
            return Verdict(False)
        window = streak[::-1]
        return Verdict(
            True,
            # The report at which the streak reached its length, however logs were batched.
            step=window[settings.truncated_logs - 1][0],
            summary=(f"every completion was cut at max_completion_length="
                     f"{fmt(run.config.get('max_completion_length'))} for {len(window)} log "
                     f"reports (steps {window[0][0]}-{window[-1][0]}): no completion ends"),
            evidence={"clipped_ratio": "1", "mean_terminated_length": "0",
                      "window_logs": fmt(len(window)),
                      "max_completion_length": fmt(run.config.get("max_completion_length")),
                      "mean_length": fmt(run.log_value("completions/mean_length")),
                      "step": fmt(window[-1][0])},
        )
