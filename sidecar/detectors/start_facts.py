"""Detectors over facts measured once at train begin (and the loss right after a resume).

A stop token the loss never sees, a head that is random at reload, data the trainer dropped,
a resume that restarted the adapter, an AdaLoRA that never allocates: the run trains, and
what it trains is not what the user asked for.
"""

from __future__ import annotations

import math

from ...proto import pb
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import (
    SpecDetector,
    Verdict,
    finite_history,
    fmt,
    is_rl,
    start_facts_or_silent,
    trainer_loop,
)
from .spec import DetectorSpec, Evidence, Severity, Threshold


class StopTokenUntrained(SpecDetector):
    """The labels of a collated batch never train the stop token: the model never learns to stop.

    ``pad_token == eos_token`` with transformers' LM collator masks every eos label; a chat
    template or completion mask can leave the end-of-turn token outside the loss. When the
    data holds no stop token at all, what the run is decides: a loss that leaves real tokens
    out (a prompt outside a completion-only loss: chat or instruction SFT) trains answers that
    must end; raw text trained on every token (continued pre-training, packed blocks or
    padded rows) has no stop to learn and stays silent.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "packed-plain-text-blocks"),
        false_positives=("reads only the first collated rows: a dataset whose first rows lack the "
                         "stop token while later rows have it; continued pre-training on plain "
                         "text that should never stop"),
        id="stop_token_untrained",
        severity=Severity.WARNING,
        latching=True,
        summary="Run {run_id} never trains the stop token",
        meaning="the labels of a batch collated at train begin never contain the stop token: "
        "the model never learns to stop (pad == eos with the LM collator, a template that "
        "leaves the end of turn outside the loss)",
        fix="give padding a token of its own (or use TRL's collator) and put the end-of-turn token "
        "inside the trained part of the template",
        fires_when="at train begin, the trainer's collator applied to the first rows yields "
        "labels without any stop token (`eos_token`, or a stop id of the generation config "
        "such as a chat template's end of turn) while the inputs hold one, or while the loss "
        "leaves a prompt out (completions that must end); raw text trained on every token "
        "(continued pre-training) with no stop token in its inputs is left alone",
        evidence=(Evidence("loss"), Evidence("step")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run, "stop_token")
        if not isinstance(start, pb.RunStart):
            return start
        check = start.stop_token
        if check.sequences <= 0 or check.in_labels > 0:
            return Verdict(False)
        if check.in_inputs == 0 and (check.outside_loss == 0
                                     or check.full_rows == check.sequences):
            # Raw text trained on every token, or packed blocks (run_clm's group_texts):
            # continued pre-training, no stop to learn.
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
                      "in_labels": "0", "outside_loss": fmt(check.outside_loss),
                      "step": "0 (train begin)"},
        )


class UnsavedHead(SpecDetector):
    """A newly initialised output head is not in ``modules_to_save``: the saved adapter reloads
    with a new random head (frozen and random all along, or trained and then lost)."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("none known at critical: a Trainer saves a PEFT model through the "
                         "adapter, so every checkpoint it writes lacks the head; a raw loop may "
                         "save the head itself, apart from the adapter, so there it fires as a "
                         "warning"),
        id="unsaved_head",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the run is a raw loop (`deadweight.watch`): the script may save the head "
        "itself",
        latching=True,
        scope="artifact",
        summary="Run {run_id} trains around a random head its adapter does not save",
        meaning="a newly initialised output head (score, classifier) is not in modules_to_save: "
        "the saved adapter reloads with a new random head",
        fix="set `task_type=\"SEQ_CLS\"` or list the head in `modules_to_save` and retrain",
        fires_when="at train begin, a head absent from the base checkpoint is not listed in "
        "the adapter's `modules_to_save`",
        evidence=(Evidence("trainable_params"), Evidence("checkpoint_adapter_bytes")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run, "heads")
        if not isinstance(start, pb.RunStart):
            return start
        h = start.heads
        lost = [n for n in h.new_heads if n not in h.saved_heads]
        if not lost:
            return Verdict(False)
        trains = [n for n in lost if n in h.trainable_heads]
        how = "trains but is not saved" if trains else "stays frozen at its random init"
        return Verdict(
            True,
            step=0,
            severity=None if trainer_loop(run) else Severity.WARNING,
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
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives="a filter the user wants (rows over max_length dropped on purpose)",
        id="dataset_shrunk",
        severity=Severity.WARNING,
        latching=True,
        summary="Run {run_id} trains on a silently shrunken dataset",
        meaning="the trainer dropped part of the training rows in its own preparation (too "
        "long for max_length) without a count",
        fix="raise `max_length` or shorten the data yourself so any drop is deliberate",
        fires_when="at train begin, the rows the trainer kept fall short of the rows it was "
        "given by at least the threshold",
        thresholds=(Threshold("dataset_drop_fraction", "ratio",
                              "share of the given training rows the trainer dropped"),),
        evidence=(Evidence("step"), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run, "dataset_rows")
        if not isinstance(start, pb.RunStart):
            return start
        rows = start.dataset_rows
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
    """After resuming, training restarted from a fresh (or another) adapter while the step
    count went on.

    Two signs, either suffices: at train begin the adapter in memory differs from the
    resumed checkpoint's adapter file; or, where the digests cannot see it (the checkpoint's
    adapter saved under another name, in a subfolder, while a fresh default adapter trains),
    the first loss after the resume is back near the first loss of the run that wrote the
    checkpoint although that run had learned. RL losses say nothing about learning: the loss
    sign is left out for GRPO/RLOO.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "day2-resume-healthy-twin"),
        false_positives=("none known at critical: the digest rule compares the adapter in "
                         "memory with the checkpoint's file; the first-loss rule is a heuristic "
                         "(a resume onto a new data order or a harder shard can raise the first "
                         "loss without any adapter being lost), so it fires as a warning"),
        id="resume_lost_adapter",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="only the first loss after the resume shows it (no adapter digest to "
        "compare): a new data order can raise that loss too",
        latching=True,
        summary="Run {run_id} resumed without the adapter it resumed from",
        meaning="after resume_from_checkpoint the adapter in memory is not the checkpoint's "
        "adapter: training restarted while the step count went on",
        fix="resume with the adapter name and PEFT config the checkpoint was trained with, or load "
        "it with `PeftModel.from_pretrained(base, checkpoint, is_trainable=True)`",
        fires_when="at train begin of a resumed run, the digest of the adapter in memory "
        "differs from that of the resumed checkpoint's adapter file; or the first loss after "
        "the resume gave back a large share of what the checkpoint's run had learned (its "
        "`trainer_state.json`: first and last loss)",
        thresholds=(
            Threshold("resume_loss_drop", "ratio",
                      "the checkpoint's run had learned: its last loss at least this share "
                      "below its first"),
            Threshold("resume_loss_regain", "ratio",
                      "share of that drop the first loss after the resume gave back"),
        ),
        evidence=(Evidence("step"), Evidence("loss")),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run, "resume")
        if not isinstance(start, pb.RunStart):
            return start
        resume = start.resume
        return self._by_digest(run, resume) or self._by_loss(run, resume, settings)

    @staticmethod
    def _by_digest(run: RunState, resume: pb.Resume) -> Verdict | None:
        """Firing when the adapter in memory differs from the checkpoint's, else None."""
        assert run.start is not None
        saved, memory = resume.checkpoint_adapter, run.start.initial_adapter
        if (not saved.tensors or not memory.tensors or not saved.combined
                or saved.combined == memory.combined):
            return None
        differing = sorted(n for n, d in saved.tensors.items() if memory.tensors.get(n) != d)
        return Verdict(
            True,
            step=resume.step,
            summary=(f"resumed at step {resume.step} from {resume.checkpoint}, but the adapter "
                     f"in memory differs from that checkpoint's in {len(differing)} of "
                     f"{len(saved.tensors)} tensors: training restarted"),
            evidence={"checkpoint": resume.checkpoint, "step": fmt(resume.step),
                      "sign": "digest", "checkpoint_digest": saved.combined,
                      "memory_digest": memory.combined,
                      "differing_tensors": fmt(len(differing)),
                      "first_loss_before": fmt(resume.first_loss)},
        )

    @staticmethod
    def _by_loss(run: RunState, resume: pb.Resume, settings: DetectorSettings) -> Verdict | None:
        first, last = resume.first_loss, resume.last_loss
        learned = first - last
        if (is_rl(run) or not (math.isfinite(first) and math.isfinite(last)) or first == 0
                or learned < settings.resume_loss_drop * abs(first)):
            return Verdict(False)  # no learning the loss could show being lost
        after = [(s, v) for s, v in finite_history(run, "loss") if s > resume.step]
        if not after:
            return None  # no loss since the resume yet
        step, loss = after[0]
        regained = (loss - last) / learned
        if regained < settings.resume_loss_regain:
            return Verdict(False, step=step)
        return Verdict(
            True,
            step=step,
            severity=Severity.WARNING,  # a heuristic: a healthy resume onto new data can do it
            summary=(f"resumed at step {resume.step} from {resume.checkpoint}: the first loss "
                     f"after the resume ({fmt(loss)}, step {step}) is back near that run's first "
                     f"loss ({fmt(first)}; it had reached {fmt(last)}): training restarted"),
            evidence={"checkpoint": resume.checkpoint, "step": fmt(step),
                      "resumed_step": fmt(resume.step), "sign": "loss",
                      "first_loss_before": fmt(first), "last_loss_before": fmt(last),
                      "first_loss_after": fmt(loss), "regained": f"{regained:.3g}"},
        )


class AdaloraNotAllocated(SpecDetector):
    """AdaLoRA past ``tinit + deltaT`` has no rank_pattern: nothing calls ``update_and_allocate``
    (transformers and TRL never do), so it trains as a plain LoRA of rank ``init_r``."""

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin"),
        false_positives=("a run that calls update_and_allocate outside the optimizer step in a way"
                         " the probe does not see"),
        id="adalora_not_allocated",
        severity=Severity.WARNING,
        summary="Run {run_id} trains AdaLoRA as plain LoRA",
        meaning="AdaLoRA is past tinit + deltaT without a rank_pattern: nothing calls "
        "update_and_allocate, so ranks are never allocated",
        fix="call `model.base_model.update_and_allocate(step)` at every optimizer step (a small "
        "callback), or use plain LoRA",
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


