"""The records the callback reports, and their ``deadweight.v1`` wire form.

The training thread hands plain records to the stream client; the sender thread calls
``to_event`` so protobuf building never runs on the training thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..proto import pb
from ..proto.kinds import EventKind
from .deferred import DeferredScalar
from .digest import AdapterDigest
from .facts.heads import HeadFacts
from .facts.membership import Membership
from .facts.preflight import PreflightFacts
from .facts.resume import ResumeFacts
from .facts.stop_token import StopTokenFacts
from .update.replica import ReplicaRecord
from .update.stats import PendingStats, UpdateStats

#: Most numeric keys one log report carries; the rest are counted as dropped.
MAX_LOG_KEYS = 256
#: Longest log key kept.
MAX_KEY_LENGTH = 128


@dataclass(frozen=True)
class RunStartRecord:
    trainer: str
    world_size: int
    output_dir: str
    config: dict[str, float]
    config_text: dict[str, str]
    versions: dict[str, str]
    membership: Membership
    preflight: PreflightFacts
    initial_adapter: AdapterDigest
    host: str = ""
    sharded: bool = False
    attestation: str = ""
    wrapper: str = ""
    requested_wrapper: str = ""
    stop_token: StopTokenFacts | None = None
    heads: HeadFacts | None = None
    resume: ResumeFacts | None = None
    dataset_rows: tuple[int, int] | None = None
    #: The baseline file's content and name, when the run names one (``baseline_file``).
    baseline: tuple[str, str] | None = None


@dataclass(frozen=True)
class StepRecord:
    step: int
    learning_rate: float
    #: Pending on the training thread; read by the sender thread (``to_event``).
    stats: UpdateStats | PendingStats
    optimizer_params: int
    grad_not_in_optimizer_tensors: int
    grad_not_in_optimizer_params: int
    #: Whether the optimizer skipped the step; a DeferredScalar where it is read off a
    #: device value (the fp16 loss scale), resolved by the sender thread.
    optimizer_step_skipped: bool | DeferredScalar = False
    adalora_rank_pattern_set: bool | None = None
    #: The step's gradient squares (a device scalar until the sender reads it), if measured.
    grad_sq_sum: Any = None
    #: (declared-frozen tensors, those moved since train begin), when modules were declared.
    declared_frozen: tuple[int, int] | None = None
    #: The rank's own seconds in this step before its last forward ended (``progress``).
    local_seconds: float | None = None
    #: Seconds since the previous optimizer step ended on this rank (``progress``).
    step_seconds: float | None = None


@dataclass(frozen=True)
class LogRecord:
    step: int
    #: A DeferredScalar for a tensor the loop logged, read by the sender thread.
    values: dict[str, float | DeferredScalar]
    dropped_keys: int = 0


@dataclass(frozen=True)
class CheckpointRecord:
    step: int
    path: str
    adapter: AdapterDigest


@dataclass(frozen=True)
class RunEndRecord:
    step: int
    reason: str


def numeric_logs(logs: dict[str, Any], step: int) -> LogRecord:
    """Every numeric (or None-for-NaN) log value, bounded in key count and key length."""
    kept: dict[str, float | DeferredScalar] = {}
    dropped = 0
    for key, value in logs.items():
        if isinstance(value, bool):
            value = float(value)
        if value is None:
            value = math.nan  # TRL logs a metric that was NaN for a whole window as None
        if not isinstance(value, int | float | DeferredScalar):
            continue
        if len(kept) >= MAX_LOG_KEYS or len(key) > MAX_KEY_LENGTH:
            dropped += 1
            continue
        kept[str(key)] = value if isinstance(value, DeferredScalar) else float(value)
    return LogRecord(step=step, values=kept, dropped_keys=dropped)


def digest_message(digest: AdapterDigest) -> pb.AdapterDigest:
    return pb.AdapterDigest(combined=digest.combined, tensors=digest.tensors, bytes=digest.bytes)


def _run_start(r: RunStartRecord) -> pb.RunStart:
    m = r.membership
    f = r.preflight
    start = pb.RunStart(
        trainer=r.trainer,
        world_size=r.world_size,
        output_dir=r.output_dir,
        config=r.config,
        config_text=r.config_text,
        versions=r.versions,
        membership=pb.OptimizerMembership(
            optimizer_tensors=m.optimizer_tensors,
            optimizer_params=m.optimizer_params,
            trainable_tensors=m.trainable_tensors,
            trainable_params=m.trainable_params,
            trainable_not_in_optimizer_tensors=m.trainable_not_in_optimizer_tensors,
            adapter_tensors=m.adapter_tensors,
            adapter_params=m.adapter_params,
            adapters=[
                pb.AdapterCoverage(
                    name=a.name, tensors=a.tensors, params=a.params,
                    in_optimizer_tensors=a.in_optimizer_tensors, active=a.active,
                )
                for a in m.adapters
            ],
            layout=m.layout,
        ),
        preflight=pb.Preflight(
            is_peft=f.is_peft,
            peft_type=f.peft_type,
            requested_target_modules=f.requested_target_modules,
            target_modules_regex=f.target_modules_regex,
            unmatched_target_modules=f.unmatched_target_modules,
            embedding_rows=f.embedding_rows,
            base_vocab_size=f.base_vocab_size,
            tokenizer_size=f.tokenizer_size,
            modules_to_save=f.modules_to_save,
            active_adapter=f.active_adapter,
            lora_rank=f.lora_rank,
            adapter_layer_names=f.adapter_layer_names,
            embedding_module=f.embedding_module,
            trainable_token_modules=f.trainable_token_modules,
        ),
        initial_adapter=digest_message(r.initial_adapter),
        attestation=r.attestation,
        sharded=r.sharded,
        host=r.host,
        wrapper=r.wrapper,
        requested_wrapper=r.requested_wrapper,
        trainable_params_by_dtype=m.optimizer_params_by_dtype,
    )
    if r.stop_token is not None:
        t = r.stop_token
        start.stop_token.CopyFrom(pb.StopTokenCheck(
            token=t.token, token_id=t.token_id, sequences=t.sequences, in_inputs=t.in_inputs,
            in_labels=t.in_labels, full_rows=t.full_rows, outside_loss=t.outside_loss))
    if r.heads is not None:
        h = r.heads
        start.heads.CopyFrom(pb.HeadCheck(heads=h.heads, new_heads=h.new_heads,
                                          saved_heads=h.saved_heads,
                                          trainable_heads=h.trainable_heads))
    if r.resume is not None:
        start.resume.CopyFrom(pb.Resume(
            checkpoint=r.resume.checkpoint, step=r.resume.step,
            checkpoint_adapter=digest_message(r.resume.checkpoint_adapter),
            first_loss=r.resume.first_loss, last_loss=r.resume.last_loss))
    if r.baseline is not None:
        start.baseline, start.baseline_name = r.baseline
    if r.dataset_rows is not None:
        start.dataset_rows.CopyFrom(pb.DatasetRows(given=r.dataset_rows[0],
                                                   kept=r.dataset_rows[1]))
    return start


def _step(r: StepRecord) -> pb.StepReport:
    s = r.stats.result() if isinstance(r.stats, PendingStats) else r.stats
    report = pb.StepReport(
        step=r.step,
        learning_rate=r.learning_rate,
        update_sq_sum=s.update_sq_sum,
        param_sq_sum=s.param_sq_sum,
        watched_tensors=s.watched_tensors,
        watched_params=s.watched_params,
        optimizer_params=r.optimizer_params,
        unchanged_tensors=s.unchanged_tensors,
        grad_not_in_optimizer_tensors=r.grad_not_in_optimizer_tensors,
        grad_not_in_optimizer_params=r.grad_not_in_optimizer_params,
        nonfinite_update_tensors=s.nonfinite_update_tensors,
        sampled=s.sampled,
        unchanged_elements=s.unchanged_elements,
        groups=[
            pb.GroupUpdate(
                name=g.name, kind=g.kind, update_sq_sum=g.update_sq_sum,
                tensors=g.tensors, unchanged_tensors=g.unchanged_tensors,
                elements=g.elements, unchanged_elements=g.unchanged_elements, dtype=g.dtype,
            )
            for g in s.groups
        ],
        optimizer_step_skipped=bool(r.optimizer_step_skipped),  # a deferred read, maybe
    )
    if r.adalora_rank_pattern_set is not None:
        report.adalora_rank_pattern_set = r.adalora_rank_pattern_set
    if r.grad_sq_sum is not None:
        report.grad_sq_sum, report.grad_measured = float(r.grad_sq_sum), True
    if r.declared_frozen is not None:
        report.declared_frozen_tensors, report.declared_frozen_moved_tensors = r.declared_frozen
    if r.local_seconds is not None:
        report.local_seconds = r.local_seconds
    if r.step_seconds is not None:
        report.step_seconds = r.step_seconds
    return report


def _replica(r: ReplicaRecord) -> pb.ReplicaDigest:
    return pb.ReplicaDigest(step=r.step, structure=r.structure, values=r.host_values(),
                            sizes=r.sizes, names=r.names)


def to_event(kind: str, record: Any) -> pb.Event:
    """The wire event for one record (seq and time are set by the stream client)."""
    if kind == EventKind.RUN_START:
        return pb.Event(run_start=_run_start(record))
    if kind == EventKind.STEP:
        return pb.Event(step=_step(record))
    if kind == EventKind.LOG:
        return pb.Event(
            log=pb.LogReport(
                step=record.step, values={k: float(v) for k, v in record.values.items()},
                dropped_keys=record.dropped_keys
            )
        )
    if kind == EventKind.CHECKPOINT:
        return pb.Event(
            checkpoint=pb.CheckpointReport(
                step=record.step, path=record.path, adapter=digest_message(record.adapter)
            )
        )
    if kind == EventKind.RUN_END:
        return pb.Event(run_end=pb.RunEnd(step=record.step, reason=record.reason))
    if kind == EventKind.REPLICA:
        return pb.Event(replica=_replica(record))
    raise ValueError(f"unknown record kind {kind!r}")
