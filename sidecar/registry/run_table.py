"""The run table: every run the sidecar tracks, how one enters, and when one leaves.

A run enters with its first RunStart (``register``) or as a new incarnation of its run id
(``succeed``), as ``admission`` decided, or from the store after a restart (``restore``); it
leaves when it ended longer than the TTL ago (``expire_ended``), or when admission made room
with it (``evict``). Refused registrations are counted by uid.
All methods are called under the registry lock; store writes go to the run's outbox.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from ...proto import pb
from ..model.finding import Finding, RunSnapshot
from ..model.process import ProcessIdentity
from ..model.run_state import RunState
from ..store.journal import Store
from .pending import Outbox

if TYPE_CHECKING:
    from .admission import Eviction

log = structlog.get_logger("deadweight.registry")


#: How many distinct uids the refusal counter keeps by name (the rest count as "other").
MAX_REFUSAL_UIDS = 64


@dataclass(frozen=True)
class Owner:
    """The process that registered a run, as the transport named it: an attested process
    (pid and start time), a unix peer (pid), or a TCP host; and its uid (-1: unknown, TCP)."""

    process: str
    uid: int


@dataclass
class RunEntry:
    """One run with everything the registry keeps beside its state."""

    state: RunState
    findings: dict[str, Finding] = field(default_factory=dict)
    directives: list[pb.Directive] = field(default_factory=list)
    #: rank -> how many of ``directives`` that rank was handed.
    delivered: dict[int, int] = field(default_factory=dict)
    #: rank -> the process the kernel named when that rank registered.
    identities: dict[int, ProcessIdentity] = field(default_factory=dict)
    #: Detectors whose firing finding is not yet re-confirmed since it was read back after a
    #: restart or since another rank joined the run (``hold_firing``).
    held: set[str] = field(default_factory=set)
    #: detector -> the highest incident number it ever had on this run id (store included).
    last_incident: dict[str, int] = field(default_factory=dict)
    exit_checked_at: float = 0.0
    #: Counts from 1 per run id in this sidecar; a rebind or a reuse starts the next one.
    incarnation: int = 1
    #: The rank whose RunStart started this incarnation: only it ends the run and sets its
    #: run-wide logs.
    leader: int | None = None
    #: The last optimizer step written to the store's history (for the run report).
    history_step: int = 0
    #: step -> (ranks that timed it, slowest seconds, next slowest) while not every rank of
    #: a multi-rank run has (``EventApplier._time_rank``; the oldest go past RANK_TIMES_HELD).
    rank_times: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    #: rank -> the incidents (``Finding.incident_id``) its stream was sent the words of.
    told: dict[int, set[str]] = field(default_factory=dict)
    #: detector -> the previous incarnation's finding whose page is still held: resolved
    #: once this incarnation proves healthy (``FindingLifecycle.settle_inherited``), carried
    #: on by a new incident of the same detector, else resolved when the run expires.
    inherited_pages: dict[str, Finding] = field(default_factory=dict)
    #: Who registered the run (``Owner``): what the capacity caps count.
    owner: Owner | None = None
    outbox: Outbox = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = Outbox(self.state.run_id)
        self.state.incarnation = self.incarnation

    def hold_firing(self) -> None:
        """Keep every firing finding firing until its detector confirms it or the run has
        reported ``resume_hold_steps`` combined steps since.

        Why: a rank that joins late can move the steps the detectors read. Unsharded, the
        lowest rank stands for the run, so a rank 0 joining after rank 1 fired leaves a window
        of a few fresh steps; sharded, only steps every rank reported count. Without the hold
        the finding would resolve on that short window and fire again as a second incident."""
        self.held.update(d for d, finding in self.findings.items() if finding.firing)

    def snapshot(self, processes: bool = False) -> RunSnapshot:
        """The run as actions see it, with copies of its firing findings (and, with
        processes, the processes bound to this incarnation now). Under the registry lock."""
        run = self.state
        return RunSnapshot(run.run_id, run.trainer, run.step, self.incarnation,
                           tuple(sorted(self.identities.items())) if processes else (),
                           tuple(f.copy() for f in self.findings.values() if f.firing))

    def take_directives(self, rank: int) -> list[pb.Directive]:
        """The directives rank has not been handed yet."""
        start = self.delivered.get(rank, 0)
        self.delivered[rank] = len(self.directives)
        return self.directives[start:]


class RunTable:
    """Live and recently ended runs by id, bounded by ``max_runs``."""

    def __init__(self, store: Store, forget: Callable[[str], None], max_runs: int,
                 ended_ttl_seconds: float) -> None:
        self.store = store
        self.forget = forget
        self.max_runs = max_runs
        #: (uid, reason) -> refused registrations (reason: process, uid, table).
        self.refused: Counter[tuple[str, str]] = Counter()
        #: Live runs evicted to let another process in.
        self.evicted_live = 0
        self.ended_ttl_seconds = ended_ttl_seconds
        self._runs: dict[str, RunEntry] = {}

    def get(self, run_id: str) -> RunEntry | None:
        return self._runs.get(run_id)

    def __iter__(self) -> Iterator[RunEntry]:
        return iter(list(self._runs.values()))

    def __len__(self) -> int:
        return len(self._runs)

    def register(self, run_id: str, rank: int, last_incident: dict[str, int],
                 last_incarnation: int = 0, owner: Owner | None = None,
                 evicted: tuple[Eviction, ...] = ()) -> RunEntry:
        """A new run; last_incident and last_incarnation (read from the store) continue its
        incident and incarnation numbers, so no journal row of an earlier life is shared.
        evicted: the live runs that gave up their slots for it, whose ends its batch
        journals."""
        entry = RunEntry(RunState(run_id), last_incident=dict(last_incident), leader=rank,
                         incarnation=last_incarnation + 1, owner=owner)
        for gone in evicted:  # journaled with the newcomer's batch (its outbox is done)
            entry.outbox.add(functools.partial(self.store.end_run, gone.run_id,
                                               "evicted", time.time(), gone.incarnation))
        self._runs[run_id] = entry
        log.info("run_registered", run_id=run_id, rank=rank)
        return entry

    def evict(self, eviction: Eviction, newcomer: Owner | None) -> None:
        """Forget a run to make room for newcomer's batch (``admission`` chose it)."""
        if eviction.live:
            self.evicted_live += 1
            log.warning("run_evicted", run_id=eviction.run_id, owner=eviction.owner,
                        newcomer=newcomer.process if newcomer is not None else "unknown",
                        reason=eviction.why)
        self._expire(eviction.run_id, eviction.reason)

    def count_refusal(self, owner: Owner | None, reason: str) -> None:
        """A registration a cap refused, by owner's uid (the first MAX_REFUSAL_UIDS by name)."""
        uid = "unknown" if owner is None or owner.uid < 0 else str(owner.uid)
        if (uid, reason) not in self.refused and len({u for u, _ in self.refused}) >= (
                MAX_REFUSAL_UIDS):
            uid = "other"
        self.refused[(uid, reason)] += 1

    def succeed(self, old: RunEntry, rank: int) -> RunEntry:
        """A new incarnation of old's run id, started by rank; incident numbers continue."""
        entry = RunEntry(RunState(old.state.run_id), last_incident=dict(old.last_incident),
                         incarnation=old.incarnation + 1, leader=rank)
        self._runs[old.state.run_id] = entry
        return entry

    def silent(self, now: float, seconds: float) -> list[RunEntry]:
        """Live runs that sent nothing for seconds."""
        return [e for e in self if not e.state.ended and now - e.state.last_seen > seconds]

    def restore(self, entry: RunEntry) -> bool:
        """Put back a run read from the store; False when it is known or there is no room."""
        if entry.state.run_id in self._runs or len(self._runs) >= self.max_runs:
            return False
        self._runs[entry.state.run_id] = entry
        return True

    def expire_ended(self, now: float) -> None:
        """Forget runs that ended longer than the TTL ago."""
        for entry in self:
            run = entry.state
            if run.ended and now - run.ended_at > self.ended_ttl_seconds:
                self._expire(run.run_id, "ttl")

    def _expire(self, run_id: str, reason: str) -> None:
        del self._runs[run_id]
        self.forget(run_id)  # memory only (the action counters): safe under the lock
        log.info("run_expired", run_id=run_id, reason=reason)
