"""Identity and binding: which process may report for which rank of a run.

The transport says who is on the other end of a stream (``Peer``); a RunStart may redeem an
attestation nonce so the kernel names the process (pid, uid, start time). A rank registered
by an identified process is bound to it: only that process, or a replacement once it is
gone, may report for the rank. Two live processes never own one rank of one run id: the
second is refused (``RunIdInUse``, a clear error in its console) and the run it collided
with gets the ``run_id_in_use`` finding; no turn-taking. An attested process taking a rank
that only unattested streams reported starts a new incarnation, so nothing they sent
(sequence numbers, steps) carries over. A pid in any message field counts for nothing.
``IdentityGate.admit`` decides; ``bind`` records the decision (the store write is queued).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from ...proto import pb
from ..model.nonces import Attestor
from ..model.process import ProcessIdentity, is_alive
from ..store.journal import Store
from .run_table import RunEntry
from .validation import (
    AttestationRequired,
    IdentityRejected,
    IngestError,
    RunIdInUse,
    run_start_event,
    run_start_of,
)

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
    """Redeems attestations and decides which stream may write to which rank."""

    def __init__(self, store: Store, attestor: Attestor | None,
                 allow_unattested: bool = False, trainer_uids: Iterable[int] = ()) -> None:
        self.store = store
        self.attestor = attestor
        #: On the unix socket, streams need not attest (the operator's opt-out).
        self.allow_unattested = allow_unattested
        #: Uids whose attested processes may report (empty: any uid that reaches the socket).
        self.trainer_uids = frozenset(trainer_uids)

    def starts_incarnation(self, entry: RunEntry, request: pb.StreamRequest,
                           peer: Peer) -> str:
        """Why a RunStart begins a new life of this run id rather than joining it ("": it
        does not): ``ended``, ``gone``, ``unattested`` or ``restarted``.

        That is a run that ended; a rank bound to a process that is gone (a restarted job, a
        run id used again: a live process keeps its rank, ``admit`` refuses the newcomer); a
        rank only unattested streams reported, taken by an attested process; or, for
        unattested runs, a rank whose sequence numbers start again from another stream (a
        new process)."""
        start_event = run_start_event(request)
        if start_event is None:
            return ""
        start_seq = start_event.seq
        if entry.state.ended:
            return "ended"
        self.redeem(request, peer)
        bound = entry.identities.get(request.rank)
        if bound is not None and peer.identity is not None:
            return "gone" if peer.identity != bound and not is_alive(bound) else ""
        if (peer.identity is not None and not entry.identities
                and request.rank in entry.state.ranks):
            # The rank was reported by unattested streams only (a TCP token holder first):
            # the attested process starts clean; the double use is a finding (the caller).
            return "unattested"
        if entry.identities or peer.identity is not None:
            return ""  # a new rank of an attested run: admit decides
        rank = entry.state.ranks.get(request.rank)
        return "restarted" if (rank is not None and rank.last_seq and start_seq
                               and start_seq <= rank.last_seq
                               and peer.incarnations.get(request.run_id) != entry.incarnation
                               ) else ""

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

    def admit(self, entry: RunEntry | None, request: pb.StreamRequest,
              peer: Peer) -> ProcessIdentity | None:
        """Who may write to this rank; returns the identity to bind it to, if any.

        A rank registered by a kernel-identified process accepts batches only from streams
        that proved the same identity; a run with identified ranks accepts new ranks only
        from identified processes of the same uid.
        """
        self.redeem(request, peer)
        if entry is None and run_start_of(request) is None:
            raise IngestError(f"unknown run_id {request.run_id!r}: send run_start first")
        if (peer.identity is None and self.attestor is not None and not self.allow_unattested
                and peer.address.startswith("unix:")):
            raise AttestationRequired(
                f"run {request.run_id!r} rank {request.rank}: this sidecar requires "
                "attestation on the unix socket (RunStart.attestation from the .attest socket)")
        if (self.trainer_uids and peer.identity is not None
                and peer.identity.uid not in self.trainer_uids):
            raise AttestationRequired(
                f"run {request.run_id!r}: uid {peer.identity.uid} is not a trainer uid of this "
                f"sidecar ({', '.join(str(u) for u in sorted(self.trainer_uids))})")
        if entry is None:
            return peer.identity
        known = peer.incarnations.get(request.run_id)
        if known is not None and known != entry.incarnation and run_start_of(request) is None:
            raise IdentityRejected(
                f"run {request.run_id!r} started incarnation {entry.incarnation}; this stream "
                f"belongs to incarnation {known}, which is closed: send run_start again")
        registering = run_start_of(request) is not None
        if entry.identities and peer.identity is None:
            if registering:
                note_collision(entry, request.rank, f"an unattested stream ({peer.address})")
            raise IdentityRejected(
                f"run {request.run_id!r} is written by attested processes only; this stream "
                "did not attest")
        bound = entry.identities.get(request.rank)
        owner_uid = next(iter(entry.identities.values())).uid if entry.identities else None
        if bound is not None:
            if peer.identity == bound:
                return None
            assert peer.identity is not None
            if registering:
                note_collision(entry, request.rank, peer.identity.describe())
            if peer.identity.uid == bound.uid:
                raise RunIdInUse(
                    f"run id {request.run_id!r} rank {request.rank} is in use by another live "
                    f"process, {bound.describe()}, that registered it first: two jobs cannot "
                    "report as one run, so THIS job is not monitored. Give each job its own "
                    "run id (DEADWEIGHT_RUN_ID, or run_id=); the other run is flagged "
                    "run_id_in_use")
            raise IdentityRejected(
                f"rank {request.rank} of run {request.run_id!r} is registered to another "
                f"process (uid {bound.uid}); only that process may report for it"
            )
        if owner_uid is not None and request.rank not in entry.state.ranks and (
            peer.identity is None or peer.identity.uid != owner_uid
        ):
            raise IdentityRejected(
                f"run {request.run_id!r} was registered by attested processes of uid "
                f"{owner_uid}; a new rank must attest as the same uid"
            )
        return peer.identity

    def bind(self, entry: RunEntry, rank: int, identity: ProcessIdentity) -> None:
        """Bind rank to identity now; the store learns it when the outbox is flushed."""
        entry.identities[rank] = identity
        entry.outbox.add(functools.partial(self.store.bind, entry.state.run_id, rank, identity,
                                           entry.incarnation))
        log.info("rank_bound", run_id=entry.state.run_id, rank=rank, pid=identity.pid,
                 uid=identity.uid, start_time=identity.start_time)

    @staticmethod
    def all_gone(entry: RunEntry) -> bool:
        """Whether every process that registered a rank of the run has exited."""
        return bool(entry.identities) and not any(
            is_alive(identity) for identity in entry.identities.values())


def note_collision(entry: RunEntry, rank: int, who: str) -> None:
    """Another party tried to register a rank of the run: counted on the run (the
    ``run_id_in_use`` finding reads it) and logged, each time."""
    run = entry.state
    run.collisions += 1
    run.collision = f"rank {rank}: {who}"
    log.warning("run_id_in_use", run_id=run.run_id, rank=rank, newcomer=who,
                incarnation=entry.incarnation, collisions=run.collisions)
