"""Caps on what one client can make the sidecar hold or export.

Every event of a batch passes ``event_problem`` (a step report ``step_problem``) before the
batch touches state (``registry.validation.scan``): a field beyond its cap rejects the whole
batch with a message that names the event, the field and the cap (the stream stays open).
The caps sit well above what the callback ever sends (it bounds log keys to 256 of at most
128 characters), so only a broken or hostile client meets them. Label values that reach
``/metrics`` are cleaned by ``label_value`` so a client cannot blow up Prometheus' series.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ...proto import pb
from ...proto.kinds import EventKind

#: Longest trainer name exported as a label; longer names are cut (the rest is ignored).
MAX_LABEL_LENGTH = 64
#: Longest free text kept: paths, reasons, config text values, digests.
MAX_TEXT_LENGTH = 4096
#: Longest map key (log keys, config keys, tensor names).
MAX_KEY_LENGTH = 1024
#: Longest log key; matches the callback's own bound.
MAX_LOG_KEY_LENGTH = 128
#: Most entries in one map of one event (log values, config, versions).
MAX_MAP_ENTRIES = 1024
#: Most entries in one repeated field of one event (adapters, groups, target modules).
MAX_LIST_ENTRIES = 1024
#: Most tensors in one adapter digest (a LoRA on every linear layer of a 70B model: ~1.1k).
MAX_DIGEST_TENSORS = 65536
#: Longest adapter digest (xxh3-128 is 32 hex characters); it is exported as a label.
MAX_DIGEST_LENGTH = 128
#: Longest description of where a rank's training thread is (heartbeats).
MAX_WHERE_LENGTH = 256
#: Most ranks one run may report on one sidecar (one sidecar serves one node).
MAX_RANKS_PER_RUN = 1024
#: Most optimizer steps one report may move a rank ahead of its newest: a step further on is
#: refused (counted, and a finding), so one absurd step number cannot make every later step
#: look old and blind the run.
MAX_STEP_JUMP = 1_000_000
#: Highest step a rank's first report may carry (a run resumed at step 100 million is not one
#: we will meet; 2**62 is an attack or a corrupt counter).
MAX_FIRST_STEP = 100_000_000
#: Consecutive step reports, each behind the rank's newest and each newer than the one before,
#: that show the newest step(s) were an outlier (one absurd number inside the bounds above):
#: the outlier points are dropped and the run counts from the reports again. A broken counter
#: that repeats itself (2, 2, 3) never re-anchors; a one-off absurd number blinds three steps.
REANCHOR_REPORTS = 3
#: Most step reports a rank's re-anchoring holds (the oldest goes first).
STEP_WINDOW_HELD = 64


def digest_label(digest: str) -> str:
    """A digest as a label value: lowercase hex up to 64 characters, else ``invalid``.

    Digests come from clients (``CheckpointReport.adapter.combined``); anything but hex is
    not a digest the sidecar computed or could compare, and must not become a label."""
    if not digest:
        return "none"
    if len(digest) <= 64 and all(c in "0123456789abcdef" for c in digest):
        return digest
    return "invalid"


def label_value(text: str, limit: int = MAX_LABEL_LENGTH) -> str:
    """Printable, cut to limit: safe as a Prometheus label value."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _text(name: str, value: str, limit: int = MAX_TEXT_LENGTH) -> str | None:
    if len(value) > limit:
        return f"{name} longer than {limit} characters"
    return None


def _map(name: str, values: Mapping[str, object], key_limit: int = MAX_KEY_LENGTH,
         entries: int = MAX_MAP_ENTRIES) -> str | None:
    if len(values) > entries:
        return f"{name} has more than {entries} entries"
    for key, value in values.items():
        if len(key) > key_limit:
            return f"{name} has a key longer than {key_limit} characters"
        if isinstance(value, str) and len(value) > MAX_TEXT_LENGTH:
            return f"{name}[{key[:40]!r}] longer than {MAX_TEXT_LENGTH} characters"
    return None


def _list(name: str, values: Iterable[object], limit: int = MAX_LIST_ENTRIES) -> str | None:
    items = list(values)
    if len(items) > limit:
        return f"{name} has more than {limit} entries"
    for item in items:
        if isinstance(item, str) and len(item) > MAX_TEXT_LENGTH:
            return f"{name} has an entry longer than {MAX_TEXT_LENGTH} characters"
    return None


def _digest(name: str, digest: pb.AdapterDigest) -> str | None:
    return _text(f"{name}.combined", digest.combined, MAX_DIGEST_LENGTH) or _map(
        f"{name}.tensors", digest.tensors, entries=MAX_DIGEST_TENSORS
    )


#: Largest baseline a RunStart may carry (``deadweight baseline save`` writes a few kB).
MAX_BASELINE_BYTES = 64 * 1024


def _run_start(start: pb.RunStart) -> str | None:
    m, f = start.membership, start.preflight
    return (
        _text("run_start.trainer", start.trainer, MAX_TEXT_LENGTH)
        or _text("run_start.output_dir", start.output_dir)
        or _text("run_start.attestation", start.attestation)
        or _text("run_start.host", start.host)
        or _map("run_start.config", start.config)
        or _map("run_start.config_text", start.config_text)
        or _map("run_start.versions", start.versions)
        or _list("run_start.membership.adapters", (a.name for a in m.adapters))
        or _list("run_start.preflight.requested_target_modules", f.requested_target_modules)
        or _list("run_start.preflight.unmatched_target_modules", f.unmatched_target_modules)
        or _list("run_start.preflight.modules_to_save", f.modules_to_save)
        or _list("run_start.preflight.trainable_token_modules", f.trainable_token_modules)
        or _text("run_start.preflight.embedding_module", f.embedding_module)
        or _text("run_start.preflight.peft_type", f.peft_type)
        or _text("run_start.preflight.target_modules_regex", f.target_modules_regex)
        or _text("run_start.preflight.active_adapter", f.active_adapter)
        or _digest("run_start.initial_adapter", start.initial_adapter)
        or _list("run_start.preflight.adapter_layer_names", f.adapter_layer_names)
        or _map("run_start.trainable_params_by_dtype", start.trainable_params_by_dtype)
        or _text("run_start.stop_token.token", start.stop_token.token)
        or _list("run_start.heads", [*start.heads.heads, *start.heads.new_heads,
                                     *start.heads.saved_heads, *start.heads.trainable_heads])
        or _text("run_start.resume.checkpoint", start.resume.checkpoint)
        or _digest("run_start.resume.checkpoint_adapter", start.resume.checkpoint_adapter)
        or _text("run_start.baseline", start.baseline, MAX_BASELINE_BYTES)
        or _text("run_start.baseline_name", start.baseline_name)
    )


#: A serialized step report at most this long needs no look inside: none of its texts can be
#: longer than the whole, and each group costs at least 2 bytes (its tag and its length), so
#: it holds at most MAX_LIST_ENTRIES groups. A LoRA run's step report is a few hundred bytes.
SMALL_STEP_BYTES = min(MAX_TEXT_LENGTH, 2 * MAX_LIST_ENTRIES)


def step_problem(step: pb.StepReport, size: int) -> str | None:
    """Why a step report of size bytes (serialized) is refused, or None.

    The ingest serializes every step report anyway (its groups and its history are kept as
    bytes), so the size is known for free: only a report past SMALL_STEP_BYTES is looked into.
    """
    if size <= SMALL_STEP_BYTES:
        return None
    groups = step.groups
    if len(groups) > MAX_LIST_ENTRIES:
        return f"step.groups has more than {MAX_LIST_ENTRIES} entries"
    if size <= MAX_TEXT_LENGTH:
        return None  # no text in it can be longer than the whole
    for group in groups:
        if len(group.name) > MAX_TEXT_LENGTH or len(group.kind) > MAX_TEXT_LENGTH \
                or len(group.dtype) > MAX_TEXT_LENGTH:
            return f"step.groups has an entry longer than {MAX_TEXT_LENGTH} characters"
    return None


def event_problem(event: pb.Event, kind: EventKind | None) -> str | None:
    """Why one event (of kind, ``kind_of(event)``) is refused, or None; a step report is
    checked by ``step_problem``, with its serialized size."""
    if kind == EventKind.RUN_START:
        return _run_start(event.run_start)
    if kind == EventKind.STEP:
        step = event.step
        return step_problem(step, step.ByteSize())
    if kind == EventKind.LOG:
        return _map("log.values", event.log.values, key_limit=MAX_LOG_KEY_LENGTH)
    if kind == EventKind.CHECKPOINT:
        return _text("checkpoint.path", event.checkpoint.path) or _digest(
            "checkpoint.adapter", event.checkpoint.adapter
        )
    if kind == EventKind.RUN_END:
        return _text("run_end.reason", event.run_end.reason)
    if kind == EventKind.REPLICA:
        return _replica(event.replica)
    if kind == EventKind.HEARTBEAT:
        return _text("heartbeat.where", event.heartbeat.where, MAX_WHERE_LENGTH)
    return None


def _replica(digest: pb.ReplicaDigest) -> str | None:
    """A replica sample: bounded lists whose sizes add up to its values."""
    problem = (_text("replica.structure", digest.structure, MAX_DIGEST_LENGTH)
               or _list("replica.values", digest.values)
               or _list("replica.sizes", digest.sizes)
               or _list("replica.names", digest.names))
    if problem is not None:
        return problem
    if any(n < 0 for n in digest.sizes) or sum(digest.sizes) != len(digest.values):
        return "replica.sizes do not add up to the number of replica.values"
    if len(digest.names) != len(digest.sizes):
        return "replica.names and replica.sizes differ in length"
    return None
