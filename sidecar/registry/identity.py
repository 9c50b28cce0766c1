"""Identity and binding: which process may report for which rank of a run.

The transport says who is on the other end of a stream (``Peer``); a RunStart may redeem an
attestation nonce so the kernel names the process (pid, uid, start time). A rank registered
by an identified process is bound to it: only that process, or a replacement once it is
gone, may report for the rank. Two live processes never own one rank of one run id: the
second is refused (``RunIdInUse``, a clear error in its console) and the run it collided
with gets the ``run_id_in_use`` finding; no turn-taking. An attested process taking a rank
that only unattested streams reported starts a new incarnation, so nothing they sent
(sequence numbers, steps) carries over. A pid in any message field counts for nothing.
``admission`` decides; ``IdentityGate`` redeems attestations first and ``bind`` records
what was decided (the store write is queued).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import structlog

from ...proto import pb
from ..model.nonces import Attestor
from ..model.process import ProcessIdentity
from ..store.journal import Store
from .run_table import RunEntry
from .validation import run_start_of

log = structlog.get_logger("deadweight.registry")


@dataclass
class Peer:
    """Who is on the other end of a stream, as the transport (not the message) says.

    One per stream: ``identity`` is set once the stream's RunStart redeemed an attestation
    nonce (unix socket only); ``rejected`` tells the server to end the stream.
    """

    pid: int = 0
    uid: int = -1
    address: str = ""
    identity: ProcessIdentity | None = None
    rejected: str = ""
    #: run_id -> the incarnation this stream registered in; a newer one closes the stream.
    incarnations: dict[str, int] = field(default_factory=dict)


class IdentityGate:
    """Redeems attestations and records which process a rank is bound to."""

    def __init__(self, store: Store, attestor: Attestor | None) -> None:
        self.store = store
        self.attestor = attestor

    def redeem(self, request: pb.StreamRequest, peer: Peer) -> None:
        """Let the batch's RunStart prove the stream's process (unix socket only)."""
        start = run_start_of(request)
        if start is None or not start.attestation or peer.identity is not None:
            return
        if self.attestor is None or not peer.address.startswith("unix:"):
            log.warning("attestation_ignored", run_id=request.run_id, rank=request.rank,
                        reason="only streams over the unix socket can attest")
            return
        peer.identity = self.attestor.redeem(start.attestation)
        if peer.identity is None:
            log.warning("attestation_refused", run_id=request.run_id, rank=request.rank,
                        reason="unknown, used or stale nonce")
        else:
            peer.pid, peer.uid = peer.identity.pid, peer.identity.uid

    def bind(self, entry: RunEntry, rank: int, identity: ProcessIdentity) -> None:
        """Bind rank to identity now; the store learns it when the outbox is flushed."""
        entry.identities[rank] = identity
        entry.outbox.add(functools.partial(self.store.bind, entry.state.run_id, rank, identity,
                                           entry.incarnation))
        log.info("rank_bound", run_id=entry.state.run_id, rank=rank, pid=identity.pid,
                 uid=identity.uid, start_time=identity.start_time)


def note_collision(entry: RunEntry, rank: int, who: str) -> None:
    """Another party tried to register a rank of the run: counted on the run (the
    ``run_id_in_use`` finding reads it) and logged, each time."""
    run = entry.state
    run.collisions += 1
    run.collision = f"rank {rank}: {who}"
    log.warning("run_id_in_use", run_id=run.run_id, rank=rank, newcomer=who,
                incarnation=entry.incarnation, collisions=run.collisions)
