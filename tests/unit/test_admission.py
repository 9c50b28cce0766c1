"""Admission as a table of cases: what ``decide`` makes of one batch, and that it changes
nothing while deciding (the registry carries the decision out; the trust and registry tests
check that end to end)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from deadweight.proto import pb
from deadweight.sidecar.model.process import ProcessIdentity
from deadweight.sidecar.registry import Peer
from deadweight.sidecar.registry.admission import (
    JOIN,
    Decision,
    Eviction,
    Join,
    Refuse,
    Register,
    Rules,
    Supersede,
    closes,
    decide,
    owner_of,
)
from deadweight.sidecar.registry.run_table import Owner, RunEntry, RunTable
from deadweight.sidecar.registry.validation import (
    AttestationRequired,
    CapacityError,
    IdentityRejected,
    IngestError,
    RunIdInUse,
)
from deadweight.sidecar.store.journal import Store

NOW = time.time()
UNIX = "unix:/run/deadweight.sock"


def ident(pid: int, uid: int = 1000) -> ProcessIdentity:
    return ProcessIdentity(pid, uid, uid, pid * 10, "boot")


A, B, OTHER_UID, DEAD = ident(10), ident(20), ident(30, uid=2000), ident(40)
RECLAIMED = "no optimizer step in the 600 s since it registered, and a newcomer needed its slot"


def attested(identity: ProcessIdentity, **incarnations: int) -> Peer:
    return Peer(identity.pid, identity.uid, UNIX, identity, incarnations=dict(incarnations))


def start(run_id: str = "run", rank: int = 0, seq: int = 0) -> pb.StreamRequest:
    return pb.StreamRequest(run_id=run_id, rank=rank,
                            events=[pb.Event(seq=seq, run_start=pb.RunStart(trainer="t"))])


def steps(run_id: str = "run", rank: int = 0, seq: int = 1) -> pb.StreamRequest:
    return pb.StreamRequest(run_id=run_id, rank=rank,
                            events=[pb.Event(seq=seq, step=pb.StepReport(step=1))])


def run(table: RunTable, run_id: str = "run",
        ranks: dict[int, ProcessIdentity | None] | None = None, owner: Owner | None = None,
        stepped: bool = True, age: float = 0.0, ended_at: float = 0.0,
        last_seq: int = 0) -> RunEntry:
    """A run in table: ranks (bound to a process, or None: reported unattested), owner,
    whether it ever stepped, registered age seconds ago, ended at ended_at (0: live)."""
    entry = table.register(run_id, 0, {}, owner=owner)
    entry.state.created = NOW - age
    for rank, identity in (ranks if ranks is not None else {0: None}).items():
        state = entry.state.rank(rank)
        state.last_seq = last_seq
        state.step = 5 if stepped else 0
        if identity is not None:
            entry.identities[rank] = identity
    if ended_at:
        entry.state.ended, entry.state.ended_at, entry.state.end_reason = True, ended_at, "x"
    return entry


def owned(n: int, uid: int = 1000) -> Owner:
    return Owner(f"pid {n} start {n * 10}", uid)


@dataclass
class Case:
    """One row: the table as the batch finds it, the batch, who sends it, the rules, and
    what admission decides."""

    build: Callable[[RunTable], object]
    request: pb.StreamRequest
    peer: Peer
    expect: Decision
    rules: Rules = field(default_factory=Rules)
    #: The error the client reads (a refusal): its class and words.
    error: tuple[type[IngestError], str] | None = None


CASES: dict[str, Case] = {
    "fresh run": Case(
        lambda t: None, start(), attested(A),
        Register(owned(10), A)),
    "fresh run, unattested over tcp": Case(
        lambda t: None, start(), Peer(address="10.0.0.7:5555"),
        Register(Owner("host 10.0.0.7", -1), None)),
    "unknown run without a run start": Case(
        lambda t: None, steps(), attested(A),
        Refuse("unknown_run", IngestError()),
        error=(IngestError, "send run_start first")),
    "same process reconnects": Case(
        lambda t: run(t, ranks={0: A}), start(seq=1), attested(A),
        JOIN),
    "same process reports steps": Case(
        lambda t: run(t, ranks={0: A}), steps(seq=9), attested(A, run=1),
        JOIN),
    "a new rank of the same uid joins and is bound": Case(
        lambda t: run(t, ranks={0: A}), start(rank=1), attested(B),
        Join(B)),
    "another live process of the same uid, bound rank": Case(
        lambda t: run(t, ranks={0: A}), start(), attested(B),
        Refuse("run_id_in_use", IngestError(), collision=B.describe()),
        error=(RunIdInUse, "in use by another live process")),
    "another process of the same uid, bound process gone: new incarnation": Case(
        lambda t: run(t, ranks={0: DEAD}), start(), attested(B),
        Supersede("gone", B)),
    "another uid, bound process gone: new incarnation all the same": Case(
        lambda t: run(t, ranks={0: DEAD}), start(), attested(OTHER_UID),
        Supersede("gone", OTHER_UID)),
    "another uid, bound rank": Case(
        lambda t: run(t, ranks={0: A}), start(), attested(OTHER_UID),
        Refuse("other_process", IngestError(), collision=OTHER_UID.describe()),
        error=(IdentityRejected, "registered to another process (uid 1000)")),
    "another uid, a new rank": Case(
        lambda t: run(t, ranks={0: A}), start(rank=1), attested(OTHER_UID),
        Refuse("other_uid", IngestError()),
        error=(IdentityRejected, "a new rank must attest as the same uid")),
    "another uid's steps for a bound rank: refused, no collision": Case(
        lambda t: run(t, ranks={0: A}), steps(), attested(OTHER_UID),
        Refuse("other_process", IngestError()),
        error=(IdentityRejected, "only that process may report for it")),
    "unattested stream on an attested run": Case(
        lambda t: run(t, ranks={0: A}), start(), Peer(address="10.0.0.7:1"),
        Refuse("unattested", IngestError(), collision="an unattested stream (10.0.0.7:1)"),
        error=(IdentityRejected, "attested processes only")),
    "ended run: new incarnation": Case(
        lambda t: run(t, ranks={0: A}, ended_at=NOW - 5), start(), attested(B),
        Supersede("ended", B)),
    "ended run, steps without a run start: joins it": Case(
        lambda t: run(t, ranks={0: A}, ended_at=NOW - 5), steps(), attested(A),
        JOIN),
    "attested process takes a rank unattested streams reported": Case(
        lambda t: run(t, ranks={0: None}), start(), attested(A),
        Supersede("unattested", A)),
    "unattested rank whose sequence numbers start again: new incarnation": Case(
        lambda t: run(t, ranks={0: None}, last_seq=40), start(seq=3),
        Peer(address="10.0.0.7:2"),
        Supersede("restarted", None)),
    "unattested rank, same stream sends its run start again: joins": Case(
        lambda t: run(t, ranks={0: None}, last_seq=40), start(seq=3),
        Peer(address="10.0.0.7:2", incarnations={"run": 1}),
        JOIN),
    "stream of a closed incarnation": Case(
        lambda t: run(t, ranks={0: A}), steps(), attested(A, run=0),
        Refuse("closed_incarnation", IngestError()),
        error=(IdentityRejected, "which is closed: send run_start again")),
    "unattested on the unix socket where attestation is required": Case(
        lambda t: None, start(), Peer(pid=5, uid=1000, address=UNIX),
        Refuse("attestation_required", IngestError()), rules=Rules(attesting=True),
        error=(AttestationRequired, "requires attestation on the unix socket")),
    "unattested on the unix socket, attestation optional": Case(
        lambda t: None, start(), Peer(pid=5, uid=1000, address=UNIX),
        Register(Owner("pid 5", 1000), None), rules=Rules(attesting=True,
                                                          allow_unattested=True)),
    "ended run, refused stream: the old incarnation closed all the same (as it was)": Case(
        lambda t: run(t, ranks={0: A}, ended_at=NOW - 5), start(),
        Peer(pid=5, uid=1000, address=UNIX),
        Refuse("attestation_required", IngestError(), supersede="ended"),
        rules=Rules(attesting=True),
        error=(AttestationRequired, "requires attestation")),
    "not a trainer uid": Case(
        lambda t: None, start(), attested(OTHER_UID),
        Refuse("not_trainer_uid", IngestError()), rules=Rules(trainer_uids=frozenset({1000})),
        error=(AttestationRequired, "uid 2000 is not a trainer uid")),
    "full table, an ended run makes room": Case(
        lambda t: (run(t, "a", owner=owned(1)), run(t, "b", owner=owned(2), ended_at=NOW))
       , start(), attested(A),
        Register(owned(10), A, (Eviction("b", 1, "max_runs"),)), rules=Rules(max_runs=2)),
    "full table with an unstepped run: reclaimed, then admitted": Case(
        lambda t: (run(t, "idle", owner=owned(1), stepped=False, age=3600),
                   run(t, "busy", owner=owned(2))), start(), attested(A),
        Register(owned(10), A, (Eviction("idle", 1, "evicted", RECLAIMED, "pid 1 start 10",
                                         journal=True),)),
        rules=Rules(max_runs=2)),
    "full table, unstepped but young: not reclaimable, refused": Case(
        lambda t: (run(t, "idle", owner=owned(1), stepped=False, age=60),
                   run(t, "busy", owner=owned(2))), start(), attested(A),
        Refuse("table", IngestError(), owner=owned(10)), rules=Rules(max_runs=2),
        error=(CapacityError, "sidecar already tracks 2 live runs")),
    "full table, a process holds the most: its least recently heard run goes": Case(
        lambda t: (run(t, "h1", owner=owned(1)), run(t, "h2", owner=owned(1)),
                   run(t, "h3", owner=owned(1))), start(), attested(A),
        Register(owned(10), A, (Eviction(
            "h1", 1, "evicted", "the table is full and this process holds the most live runs",
            "pid 1 start 10", journal=True),)),
        rules=Rules(max_runs=3)),
    "per-process cap": Case(
        lambda t: (run(t, "a", owner=owned(10)), run(t, "b", owner=owned(10))),
        start(), attested(A),
        Refuse("process", IngestError(), owner=owned(10)),
        rules=Rules(max_runs_per_process=2),
        error=(CapacityError, "this process already holds 2 live runs")),
    "per-uid cap": Case(
        lambda t: (run(t, "a", owner=owned(1)), run(t, "b", owner=owned(2))),
        start(), attested(A),
        Refuse("uid", IngestError(), owner=owned(10)), rules=Rules(max_runs_per_uid=2),
        error=(CapacityError, "uid 1000 already holds 2 live runs")),
    "per-uid cap, another uid's runs do not count": Case(
        lambda t: (run(t, "a", owner=owned(1, uid=7)), run(t, "b", owner=owned(2, uid=7)))
       , start(), attested(A),
        Register(owned(10), A), rules=Rules(max_runs_per_uid=2)),
    "per-uid cap with an unstepped run of that uid: reclaimed (journaled), admitted":
    Case(
        lambda t: (run(t, "a", owner=owned(1), stepped=False, age=3600),
                   run(t, "b", owner=owned(2))), start(), attested(A),
        Register(owned(10), A, (Eviction("a", 1, "evicted", RECLAIMED, "pid 1 start 10",
                                         journal=True),)),
        rules=Rules(max_runs_per_uid=2)),
    "no room for another rank": Case(
        lambda t: run(t, "a", ranks={0: None, 1: None}), start(), attested(A),
        Refuse("ranks", IngestError()), rules=Rules(max_ranks=2),
        error=(CapacityError, "sidecar already holds 2 ranks")),
    "no room for another rank: ended runs make it, oldest first": Case(
        lambda t: (run(t, "old", ended_at=NOW - 50), run(t, "new", ended_at=NOW - 5),
                   run(t, "live")), start(), attested(A),
        Register(owned(10), A, (Eviction("old", 1, "max_runs"),)), rules=Rules(max_ranks=3)),
    "no room for another rank, refused: the ended runs are forgotten all the same": Case(
        lambda t: (run(t, "old", ended_at=NOW - 50), run(t, "live", ranks={0: A, 1: B})),
        start(rank=0), attested(OTHER_UID),
        Refuse("ranks", IngestError(), evict=(Eviction("old", 1, "max_runs"),)),
        rules=Rules(max_ranks=2), error=(CapacityError, "sidecar already holds 2 ranks")),
    "a known rank needs no room": Case(
        lambda t: run(t, ranks={0: A, 1: B}), steps(), attested(A, run=1),
        JOIN, rules=Rules(max_ranks=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_admission_decides(name: str) -> None:
    case = CASES[name]
    table = RunTable(Store(), lambda run_id: None, case.rules.max_runs, 900.0)
    case.build(table)
    before = _look(table, case.peer)
    decision = decide(case.request, case.peer, table, case.rules, NOW,
                      alive=lambda identity: identity != DEAD)
    assert _look(table, case.peer) == before, "deciding changed the table or the stream"
    if isinstance(decision, Refuse) and isinstance(case.expect, Refuse):
        assert case.error is not None, "a refusal's case names the error the client reads"
        kind, words = case.error
        assert type(decision.error) is kind, decision.error
        assert words in decision.text, decision.text
        decision = dataclasses.replace(decision, error=case.expect.error)  # by identity
    assert decision == case.expect


def _look(table: RunTable, peer: Peer) -> object:
    return ([(e.state.run_id, e.incarnation, e.state.ended, sorted(e.state.ranks),
              dict(e.identities), e.state.collisions) for e in table],
            peer.identity, dict(peer.incarnations))


def test_a_known_rank_with_nothing_to_do_is_the_shared_join() -> None:
    table = RunTable(Store(), lambda run_id: None, 10, 900.0)
    run(table, ranks={0: A})
    assert decide(steps(), attested(A, run=1), table, Rules(), NOW) is JOIN


def test_what_a_decision_closes() -> None:
    assert closes(Supersede("gone")) == "gone"
    assert closes(Refuse("ranks", CapacityError("x"), supersede="ended")) == "ended"
    assert closes(Refuse("ranks", CapacityError("x"))) == ""
    assert closes(JOIN) == closes(Register(None)) == ""


def test_refusals_by_a_cap_are_the_counted_ones() -> None:
    assert Refuse("uid", CapacityError("x")).counted
    assert not Refuse("ranks", CapacityError("x")).counted
    assert not Refuse("run_id_in_use", RunIdInUse("x")).counted


def test_owner_of_names_the_process_the_transport_names() -> None:
    assert owner_of(Peer()) is None
    assert owner_of(attested(A)) == Owner("pid 10 start 100", 1000)
    assert owner_of(Peer(pid=7, uid=3, address=UNIX)) == Owner("pid 7", 3)
    assert owner_of(Peer(address="10.1.2.3:4567")) == Owner("host 10.1.2.3", -1)
