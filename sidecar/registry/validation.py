"""Batch validation: what a batch must satisfy before it may touch any run's state.

Checked outside the registry lock; a refused batch raises ``IngestError`` whose message goes
back to the client (the stream stays open), and nothing of it is applied.
"""

from __future__ import annotations

import threading

from ...proto import pb
from ...proto.kinds import KIND_BY_NAME, EventKind
from ..model import limits

MAX_RUN_ID_LENGTH = 128
MAX_EVENTS_PER_BATCH = 4096
MAX_RANK = 65535


class IngestError(ValueError):
    """A batch the sidecar refuses; the message says why and goes back to the client."""


class IdentityRejected(IngestError):
    """A batch for a rank that another (kernel-identified) process registered."""


class AttestationRequired(IdentityRejected):
    """A stream that did not prove who it is where the sidecar requires it (or of a uid that
    is not a trainer uid)."""


class CapacityError(IngestError):
    """The sidecar holds as many runs as it may."""


def refusal_kind(err: IngestError) -> str:
    """The ``kind`` label of a refused batch (a few fixed values: bounded cardinality)."""
    if isinstance(err, AttestationRequired):
        return "attestation"
    if isinstance(err, IdentityRejected):
        return "identity"
    if isinstance(err, CapacityError):
        return "capacity"
    return "invalid"


#: What ``scan`` found for one event: a step report's bytes (serialized once, for its size
#: check, its groups and its history), or the kind of any other event (None: empty or newer).
Scanned = bytes | EventKind | None

def validate(request: pb.StreamRequest) -> list[Scanned]:
    """Raise IngestError naming the first thing wrong with the batch; else its ``scan``."""
    if not request.run_id:
        raise IngestError("run_id is empty")
    if len(request.run_id) > MAX_RUN_ID_LENGTH:
        raise IngestError(f"run_id longer than {MAX_RUN_ID_LENGTH} characters")
    if not request.run_id.isprintable():
        raise IngestError("run_id has non-printable characters")
    if not 0 <= request.rank <= MAX_RANK:
        raise IngestError(f"rank {request.rank} outside 0..{MAX_RANK}")
    if len(request.events) > MAX_EVENTS_PER_BATCH:
        raise IngestError(f"more than {MAX_EVENTS_PER_BATCH} events in one batch")
    return scan(request)


def scan(request: pb.StreamRequest) -> list[Scanned]:
    """One pass over the batch: every event checked against its caps (``limits``), each
    event's kind read once, each step report serialized once; the first RunStart remembered
    for ``run_start_event``. Raises IngestError naming the first refused event (index and
    seq): nothing of a batch with one bad event is applied.

    The step reports are most of every batch: they are checked and serialized here, in the
    loop, without a function call per event.
    """
    found: list[Scanned] = []
    append = found.append
    kinds = KIND_BY_NAME
    step = EventKind.STEP.value
    small = limits.SMALL_STEP_BYTES
    start: pb.Event | None = None
    for event in request.events:  # an event's index is len(found): one entry per event
        if event.HasField(step):  # a third of WhichOneof's cost, for most of the events
            report = event.step
            encoded: bytes = report.SerializeToString()
            if len(encoded) > small:
                problem = limits.step_problem(report, len(encoded))
                if problem is not None:
                    raise IngestError(f"event {len(found)} (seq {event.seq}): {problem}")
            append(encoded)
            continue
        kind = kinds.get(event.WhichOneof("body"))
        if kind is not None:
            problem = limits.event_problem(event, kind)
            if problem is not None:
                raise IngestError(f"event {len(found)} (seq {event.seq}): {problem}")
            if kind is EventKind.RUN_START and start is None:
                start = event
        append(kind)
    _last_scan.request, _last_scan.event = request, start
    return found


#: Per thread, the batch being ingested and its first RunStart event: the registry asks this
#: three or four times a batch (``scan`` notes it; a batch not scanned is scanned for it).
_last_scan = threading.local()


def run_start_event(request: pb.StreamRequest) -> pb.Event | None:
    """The batch's first event that carries a RunStart, if any (scanned once per batch)."""
    if getattr(_last_scan, "request", None) is request:
        found: pb.Event | None = _last_scan.event
        return found
    found = None
    for event in request.events:  # HasField: the cheapest test
        if event.HasField(EventKind.RUN_START):
            found = event
            break
    # The reference kept here stops a new batch from taking this one's address (identity).
    _last_scan.request, _last_scan.event = request, found
    return found


def remember_run_start(request: pb.StreamRequest, event: pb.Event | None) -> None:
    """Note the batch's first RunStart event, found by its scan, on the thread that applies
    the batch (``Registry.apply``; the scan may have run on another thread)."""
    _last_scan.request, _last_scan.event = request, event


def forget_run_start_scan() -> None:
    """End the scan's life with the batch (the registry calls this when done), so a
    request object changed and sent again is scanned again."""
    _last_scan.request = _last_scan.event = None


def run_start_of(request: pb.StreamRequest) -> pb.RunStart | None:
    """The batch's first RunStart, if it carries one."""
    event = run_start_event(request)
    if event is None:
        return None
    start: pb.RunStart = event.run_start
    return start
