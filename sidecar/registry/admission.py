"""Admission: what a batch's arrival means for its run id, decided in one place.

Identity (who may write to which rank), incarnation (when a RunStart begins a new life of
the run id) and capacity (the caps, and who gives up a slot) are one decision: ``decide``
reads the table and the stream, changes nothing, and returns a ``Decision`` that
``Registry.apply`` carries out in one place. Unit tests can then state the policy as a
table of cases.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...proto import pb
from ..model.process import ProcessIdentity, is_alive
from .identity import Peer
from .run_table import Owner, RunEntry, RunTable
from .validation import (
    AttestationRequired,
    CapacityError,
    IdentityRejected,
    IngestError,
    RunIdInUse,
    run_start_event,
)

#: What the caps count a refused registration under (``RunTable.refused``).
CAPACITY_REASONS = frozenset({"process", "uid", "table"})


@dataclass(frozen=True)
class Rules:
    """The registry's settings admission reads."""

    #: The sidecar hands out attestation nonces (it has an attestor).
    attesting: bool = False
    #: On the unix socket, streams need not attest (the operator's opt-out).
    allow_unattested: bool = False
    #: Uids whose attested processes may report (empty: any uid that reaches the socket).
    trainer_uids: frozenset[int] = frozenset()
    max_runs: int = 1000
    #: Ranks held across every run (ended ones too, until they expire).
    max_ranks: int = 4096
    max_runs_per_process: int = 64
    max_runs_per_uid: int = 256
    #: A live run that never stepped this long after it registered may give up its slot.
    reclaim_unstepped_seconds: float = 600.0


@dataclass(frozen=True)
class Eviction:
    """A run the table forgets to make room: an ended one (``reason`` max_runs), or a live
    one (``evicted``: an unstepped run reclaimed, or the hoarder's least recently heard)."""

    run_id: str
    incarnation: int
    reason: str
    #: For a live run: why it gave up its slot, and who registered it (the log line).
    why: str = ""
    owner: str = "unknown"
    #: Its end is journaled with the newcomer's batch (the slot the table made).
    journal: bool = False

    @property
    def live(self) -> bool:
        return self.reason == "evicted"


@dataclass(frozen=True)
class Join:
    """The batch goes to the run as it is: a rank it knows, or a new rank of it."""

    #: The process to bind the batch's rank to (None: nothing to bind).
    bind: ProcessIdentity | None = None
    evict: tuple[Eviction, ...] = ()


@dataclass(frozen=True)
class Register:
    """The batch's RunStart registers a run id the table does not hold."""

    owner: Owner | None
    bind: ProcessIdentity | None = None
    evict: tuple[Eviction, ...] = ()


@dataclass(frozen=True)
class Supersede:
    """The batch's RunStart begins a new incarnation of the run id: the current one ends
    (``superseded``) and a fresh one, started by the batch's rank, takes its place.

    ``reason``: ``ended`` (the run had ended), ``gone`` (the rank's process exited: a
    restarted job), ``unattested`` (an attested process takes a rank only unattested
    streams reported) or ``restarted`` (an unattested rank's sequence numbers start again
    from another stream)."""

    reason: str
    bind: ProcessIdentity | None = None
    evict: tuple[Eviction, ...] = ()


@dataclass(frozen=True)
class Refuse:
    """The batch is refused: ``error`` goes back to the client, nothing of it is applied.

    ``reason``: unknown_run, attestation_required, not_trainer_uid, closed_incarnation,
    unattested, run_id_in_use, other_process, other_uid, ranks, process, uid or table.
    ``collision``: who collided with the run (noted on it: the ``run_id_in_use`` finding).
    ``supersede`` and ``evict``: what the registry did before it refused, when it checked
    step by step (the incarnation it closed, the ended runs it forgot); kept so the
    behaviour is the same."""

    reason: str
    error: IngestError
    collision: str = ""
    owner: Owner | None = None
    supersede: str = ""
    evict: tuple[Eviction, ...] = ()

    @property
    def text(self) -> str:
        """What the client reads."""
        return str(self.error)

    @property
    def counted(self) -> bool:
        """A cap refused a registration: counted by uid (``RunTable.refused``)."""
        return self.reason in CAPACITY_REASONS


Decision = Join | Register | Supersede | Refuse

def closes(decision: Decision) -> str:
    """Why the decision ends the run id's current incarnation first ("": it does not)."""
    if isinstance(decision, Supersede):
        return decision.reason
    return decision.supersede if isinstance(decision, Refuse) else ""


#: The decision for nearly every batch: a known rank of its run, nothing to bind or evict.
JOIN = Join()


def decide(request: pb.StreamRequest, peer: Peer, table: RunTable, rules: Rules, now: float,
           alive: Callable[[ProcessIdentity], bool] = is_alive) -> Decision:
    """What the batch's arrival means, in the order the checks always ran: the incarnation,
    room for a rank new to its run, the stream's identity, then the caps for a new run.

    peer's attestation is already redeemed (``IdentityGate.redeem``); ``alive`` says
    whether a bound process still runs; ``now`` dates the unstepped runs. Reads only.
    """
    run_id, rank = request.run_id, request.rank
    start = run_start_event(request)
    current = table.get(run_id)
    supersede = "" if current is None else _new_incarnation(current, request, start, peer,
                                                            alive)
    # The run as the batch finds it: None for a new incarnation (it starts with no ranks
    # and no identities) or a run id the table does not hold.
    entry = None if supersede else current
    evict: list[Eviction] = []
    if entry is None or rank not in entry.state.ranks:
        full = _room_for_rank(table, current, entry, rules.max_ranks, evict)
        if full is not None:
            return Refuse("ranks", full, supersede=supersede, evict=tuple(evict))
    refused = _identity(request, start is not None, peer, rules, entry,
                        known=current is not None)
    if refused is not None:
        reason, error, collision = refused
        return Refuse(reason, error, collision=collision, supersede=supersede,
                      evict=tuple(evict))
    if supersede:
        return Supersede(supersede, peer.identity, tuple(evict))
    if entry is not None:
        bind = None if rank in entry.identities else peer.identity
        return JOIN if bind is None and not evict else Join(bind, tuple(evict))
    owner = owner_of(peer)
    gone = {e.run_id for e in evict}
    refusal = _make_room(owner, [e for e in table if e.state.run_id not in gone], rules,
                         now, evict)
    if refusal is not None:
        return Refuse(refusal[0], refusal[1], owner=owner, evict=tuple(evict))
    return Register(owner, peer.identity, tuple(evict))


def _new_incarnation(entry: RunEntry, request: pb.StreamRequest, start: pb.Event | None,
                     peer: Peer, alive: Callable[[ProcessIdentity], bool]) -> str:
    """Why a RunStart begins a new life of this run id rather than joining it ("": it
    does not); the reasons are ``Supersede``'s. A live process keeps its rank (the
    identity checks refuse the newcomer)."""
    if start is None:
        return ""
    if entry.state.ended:
        return "ended"
    bound = entry.identities.get(request.rank)
    if bound is not None and peer.identity is not None:
        return "gone" if peer.identity != bound and not alive(bound) else ""
    if (peer.identity is not None and not entry.identities
            and request.rank in entry.state.ranks):
        # The rank was reported by unattested streams only (a TCP token holder first):
        # the attested process starts clean; the double use is a finding (the registry).
        return "unattested"
    if entry.identities or peer.identity is not None:
        return ""  # a new rank of an attested run: the identity checks decide
    rank = entry.state.ranks.get(request.rank)
    start_seq = start.seq
    return "restarted" if (rank is not None and rank.last_seq and start_seq
                           and start_seq <= rank.last_seq
                           and peer.incarnations.get(request.run_id) != entry.incarnation
                           ) else ""


def _room_for_rank(table: RunTable, current: RunEntry | None, entry: RunEntry | None,
                   max_ranks: int, evict: list[Eviction]) -> CapacityError | None:
    """Room within max_ranks for a rank new to its run, made by forgetting ended runs (the
    one that ended first first, never the batch's own); the error when there is none (the
    ended runs are forgotten all the same). A new incarnation holds no ranks: the old one
    leaves the table with its ranks."""
    others = [e for e in table if e is not current]
    total = sum(len(e.state.ranks) for e in others)
    if entry is not None:
        total += len(entry.state.ranks)
    ended = sorted((e for e in others if e.state.ended),
                   key=lambda e: (e.state.ended_at, e.state.run_id))
    for gone in ended:
        if total < max_ranks:
            return None
        evict.append(Eviction(gone.state.run_id, gone.incarnation, "max_runs"))
        total -= len(gone.state.ranks)
    return CapacityError(f"sidecar already holds {max_ranks} ranks") if (
        total >= max_ranks) else None


def _identity(request: pb.StreamRequest, registering: bool, peer: Peer, rules: Rules,
              entry: RunEntry | None, known: bool) -> tuple[str, IngestError, str] | None:
    """Whether the stream may write to the batch's rank: None, or (reason, error, who
    collided with the run). entry: the run as the batch finds it (None: a new one);
    known: the run id is in the table (a new incarnation of it included).

    A rank registered by a kernel-identified process accepts batches only from streams
    that proved the same identity; a run with identified ranks accepts new ranks only
    from identified processes of the same uid. A pid in any message field counts for
    nothing."""
    run_id, rank = request.run_id, request.rank
    if not known and not registering:
        return ("unknown_run", IngestError(
            f"unknown run_id {run_id!r}: send run_start first"), "")
    identity = peer.identity
    if (identity is None and rules.attesting and not rules.allow_unattested
            and peer.address.startswith("unix:")):
        return ("attestation_required", AttestationRequired(
            f"run {run_id!r} rank {rank}: this sidecar requires attestation on the unix "
            "socket (RunStart.attestation from the .attest socket)"), "")
    if rules.trainer_uids and identity is not None and identity.uid not in rules.trainer_uids:
        return ("not_trainer_uid", AttestationRequired(
            f"run {run_id!r}: uid {identity.uid} is not a trainer uid of this sidecar "
            f"({', '.join(str(u) for u in sorted(rules.trainer_uids))})"), "")
    if entry is None:
        return None
    seen = peer.incarnations.get(run_id)
    if seen is not None and seen != entry.incarnation and not registering:
        return ("closed_incarnation", IdentityRejected(
            f"run {run_id!r} started incarnation {entry.incarnation}; this stream belongs "
            f"to incarnation {seen}, which is closed: send run_start again"), "")
    if entry.identities and identity is None:
        return ("unattested", IdentityRejected(
            f"run {run_id!r} is written by attested processes only; this stream did not "
            "attest"), f"an unattested stream ({peer.address})" if registering else "")
    bound = entry.identities.get(rank)
    if bound is not None:
        if identity == bound:
            return None
        assert identity is not None
        who = identity.describe() if registering else ""
        if identity.uid == bound.uid:
            return ("run_id_in_use", RunIdInUse(
                f"run id {run_id!r} rank {rank} is in use by another live process, "
                f"{bound.describe()}, that registered it first: two jobs cannot report as "
                "one run, so THIS job is not monitored. Give each job its own run id "
                "(DEADWEIGHT_RUN_ID, or run_id=); the other run is flagged run_id_in_use"),
                who)
        return ("other_process", IdentityRejected(
            f"rank {rank} of run {run_id!r} is registered to another process (uid "
            f"{bound.uid}); only that process may report for it"), who)
    if entry.identities and rank not in entry.state.ranks:
        owner_uid = next(iter(entry.identities.values())).uid
        if identity is None or identity.uid != owner_uid:
            return ("other_uid", IdentityRejected(
                f"run {run_id!r} was registered by attested processes of uid {owner_uid}; "
                "a new rank must attest as the same uid"), "")
    return None


def _make_room(owner: Owner | None, runs: list[RunEntry], rules: Rules, now: float,
               evict: list[Eviction]) -> tuple[str, CapacityError] | None:
    """Check a new run's caps and make room for it (``evict``); None, or (the cap, the
    error) when it is refused.

    Capacity cannot be hoarded: each process and each uid may hold only so many live
    runs. When the table is full the run that ended first goes; else a run that never
    stepped (below); else the least recently heard live run of the process that holds the
    most live runs, when it holds more than the newcomer's process would after admission
    (never the newcomer's own, never a one-run job's). Nor can capacity be held by runs
    that never step: before a newcomer is refused for a full uid cap or a full table, the
    oldest live run that registered over ``reclaim_unstepped_seconds`` ago and never
    reported an optimizer step (of that uid, or of anyone for the table) gives up its
    slot."""
    if owner is not None:
        live = [e.owner for e in runs if not e.state.ended]
        if sum(o is not None and o.process == owner.process for o in live) >= (
                rules.max_runs_per_process):
            return "process", CapacityError(
                f"this process already holds {rules.max_runs_per_process} live runs "
                "(--max-runs-per-process): end some (RunEnd) before starting more")
        uid = owner.uid
        if uid >= 0 and sum(o is not None and o.uid == uid for o in live) >= (
                rules.max_runs_per_uid):
            idle = _unstepped(runs, rules, now, uid)
            if idle is None:
                return "uid", CapacityError(
                    f"uid {owner.uid} already holds {rules.max_runs_per_uid} live runs "
                    "(--max-runs-per-uid)")
            evict.append(_reclaimed(idle, owner, rules, journal=True))
            runs = [e for e in runs if e is not idle]
    if len(runs) < rules.max_runs:
        return None
    ended = [e for e in runs if e.state.ended]
    if ended:
        first = min(ended, key=lambda e: (e.state.ended_at, e.state.run_id))
        evict.append(Eviction(first.state.run_id, first.incarnation, "max_runs"))
        return None
    idle = _unstepped(runs, rules, now)
    if idle is not None:
        evict.append(_reclaimed(idle, owner, rules, journal=True))
        return None
    held = Counter(e.owner.process for e in runs if not e.state.ended and e.owner is not None)
    hoarder, most = held.most_common(1)[0] if held else (None, 0)
    mine = held.get(owner.process, 0) if owner is not None else 0
    # Only a process holding more than the newcomer would after admission gives one up:
    # runs balance out across processes and a one-run job is never evicted for another.
    if hoarder is None or most <= mine + 1:
        return "table", CapacityError(f"sidecar already tracks {rules.max_runs} live runs")
    victim = min((e for e in runs if not e.state.ended and e.owner is not None
                  and e.owner.process == hoarder), key=lambda e: e.state.last_seen)
    evict.append(Eviction(victim.state.run_id, victim.incarnation, "evicted",
                          "the table is full and this process holds the most live runs",
                          hoarder, journal=True))
    return None


def _unstepped(runs: Iterable[RunEntry], rules: Rules, now: float,
               uid: int | None = None) -> RunEntry | None:
    """The oldest live run (of uid, else of anyone) that registered over
    ``reclaim_unstepped_seconds`` ago and never reported an optimizer step: it holds a
    slot and tells nobody anything, and a real job refused for it matters more."""
    cutoff = now - rules.reclaim_unstepped_seconds
    idle = [e for e in runs
            if not e.state.ended and e.state.created < cutoff
            and (uid is None or (e.owner is not None and e.owner.uid == uid))
            and not any(rank.steps or rank.step for rank in e.state.ranks.values())]
    return min(idle, key=lambda e: e.state.created) if idle else None


def _reclaimed(victim: RunEntry, owner: Owner | None, rules: Rules,
               journal: bool = False) -> Eviction:
    return Eviction(victim.state.run_id, victim.incarnation, "evicted",
                    f"no optimizer step in the {rules.reclaim_unstepped_seconds:g} s since it "
                    "registered, and a newcomer needed its slot",
                    victim.owner.process if victim.owner is not None else "unknown",
                    journal=journal)


def owner_of(peer: Peer) -> Owner | None:
    """Who registers a run, for the capacity caps: the attested process (pid and start time,
    so a reused pid is another owner), else the unix peer's pid, else the TCP host (a new
    connection does not make a new owner); None when the transport named nobody (a caller
    in this process)."""
    if not peer.address and not peer.pid and peer.identity is None:
        return None
    if peer.identity is not None:
        return Owner(f"pid {peer.identity.pid} start {peer.identity.start_time}",
                     peer.identity.uid)
    if peer.pid:
        return Owner(f"pid {peer.pid}", peer.uid)
    return Owner(f"host {peer.address.rsplit(':', 1)[0]}", peer.uid)
