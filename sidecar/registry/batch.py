"""One batch on its way through the registry: checked (``CheckedBatch``), then applied in
memory (``AppliedBatch``), then answered once what it decided is written.

The split lets the server validate a batch once, outside the lock, apply it on the event
loop, and send only a batch that must first write to a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from ...proto import pb
from .identity import Peer
from .notices import report_command
from .run_table import RunEntry
from .validation import (
    MAX_RUN_ID_LENGTH,
    IdentityRejected,
    IngestError,
    Scanned,
    refusal_kind,
)

if TYPE_CHECKING:
    from . import Registry

log = structlog.get_logger("deadweight.registry")


@dataclass(frozen=True)
class CheckedBatch:
    """A batch after validation: what its scan found event by event, or why it is refused."""

    request: pb.StreamRequest
    scanned: list[Scanned]
    error: IngestError | None
    #: The batch's first RunStart event, if any.
    start: pb.Event | None

    @property
    def run_start(self) -> bool:
        """It carries a RunStart: applying it may read the store (a new run's incidents)."""
        return self.start is not None


class AppliedBatch:
    """A batch applied in memory, and what is left to do before its answer: the writes and
    action calls it decided (its runs' outboxes), then the directives they produced."""

    def __init__(self, registry: Registry, request: pb.StreamRequest, peer: Peer,
                 entries: tuple[RunEntry | None, RunEntry | None], ack: int = 0,
                 error: IngestError | None = None) -> None:
        self.registry = registry
        self.request = request
        self.peer = peer
        #: The incarnation this batch closed, if any, and the batch's run.
        self.entries = tuple(e for e in entries if e is not None)
        self.ack = ack
        self.error = error
        #: The answer, when it was ready under the lock (nothing was left to write).
        self.ready: pb.StreamResponse | None = None

    @property
    def pending(self) -> bool:
        """Whether writes or action calls wait in the outboxes (they may touch the disk)."""
        return self.error is not None or any(len(e.outbox) for e in self.entries)

    def response(self, entry: RunEntry) -> pb.StreamResponse:
        """The ack, this rank's directives, the run's firing findings and the words of the
        incidents this rank's stream was not told yet (under the lock)."""
        firing = sorted(d for d, f in entry.findings.items() if f.firing)
        request = self.request
        reconnected = bool(request.events) and request.events[0].HasField("run_start")
        response = pb.StreamResponse(
            ack_seq=self.ack, directives=entry.take_directives(request.rank), firing=firing,
            verdicts=self.registry.notices.untold(entry, request.rank, reconnected))
        if reconnected:  # the console's train-begin line says how to open the report
            response.report_command = report_command(entry.state.run_id,
                                                     self.registry.store.path)
        return response

    def answer(self) -> pb.StreamResponse:
        """Do what the outboxes hold (outside the lock), then answer."""
        if self.ready is not None:
            return self.ready
        registry = self.registry
        registry._flush(*self.entries)
        err = self.error
        if err is None:
            with registry.lock:
                return self.response(self.entries[-1])
        if isinstance(err, IdentityRejected):
            self.peer.rejected = str(err)
        registry.refusals[refusal_kind(err)] += 1
        registry.rejected_batches += 1
        log.warning("batch_rejected", run_id=self.request.run_id[:MAX_RUN_ID_LENGTH],
                    reason=str(err))
        return pb.StreamResponse(error=str(err))
