"""Restart: what a previous sidecar left in the store, read back before the lock is taken.

``read_back`` prunes the journal past its retention and reads the runs still worth keeping
(live, or ended within the TTL; of a run id used again, its newest incarnation) with that
incarnation's bindings and checkpoints, and the incidents of every one; ``resume``
then installs them under the registry's lock and ends those that expired while no sidecar
watched. Stall clocks restart with the sidecar.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ..model.finding import RunSnapshot
from ..model.run_state import RunState
from ..store.journal import RETENTION_SECONDS, Store, StoredIncident
from .events import end_run
from .incidents import FindingLifecycle
from .run_table import Owner, RunEntry, RunTable

log = structlog.get_logger("deadweight.registry")


@dataclass
class RestoredRun:
    """One run rebuilt from the store, and its incidents (for the findings lifecycle)."""

    entry: RunEntry
    incidents: list[StoredIncident]


def read_back(store: Store, now: float, ended_ttl_seconds: float,
              limit: int) -> list[RestoredRun]:
    """At most limit runs from the store, oldest first."""
    pruned = store.prune(ended_before=now - RETENTION_SECONDS)
    if pruned:
        log.info("state_pruned", runs=pruned, older_than_days=RETENTION_SECONDS / 86400)
    restored = []
    for stored in store.runs(ended_since=now - ended_ttl_seconds, newest=True)[:limit]:
        run = RunState(stored.run_id, created=stored.created)
        run.start = stored.start
        entry = RunEntry(run, incarnation=stored.incarnation)
        entry.identities = store.bindings(stored.run_id, stored.incarnation)
        first = entry.identities.get(min(entry.identities)) if entry.identities else None
        if first is not None:  # the caps count a restored run for its process again
            entry.owner = Owner(f"pid {first.pid} start {first.start_time}", first.uid)
        # The lowest bound rank ends the run and sets its run-wide logs (none bound: the
        # first RunStart after the restart); without one, a resumed run never ended.
        entry.leader = min(entry.identities) if entry.identities else None
        for rank in entry.identities:
            run.rank(rank).last_seen = now  # stall clocks restart with the sidecar
        run.ended, run.end_reason, run.ended_at = (
            stored.ended, stored.end_reason, stored.ended_at)
        points = store.checkpoints(stored.run_id, stored.incarnation)  # its own chain
        run.checkpoints.extend(points)
        run.checkpoints_total = len(points)
        # Every incarnation's incidents: their numbers continue; only this one's stay live.
        restored.append(RestoredRun(entry, store.incidents(stored.run_id)))
    return restored


def resume(store: Store, table: RunTable, lifecycle: FindingLifecycle, lock: threading.RLock,
           silent_run_seconds: float, check_exits: Callable[[RunEntry, float], None]
           ) -> list[RunEntry]:
    """Install the runs a previous sidecar left, as many as the table has room for; returns
    them (their outboxes still to flush, outside the lock).

    Firing findings come back firing (no second page, STOP or kill for the same incident).
    Runs already silent, or whose processes are gone (check_exits), ended while no sidecar
    watched: they end before the first stream, so stale runs never hold the room of the run
    table (a full table of them refused every new run after a restart). A run still live
    then gets again the STOP on-call sent its incarnation by hand (``deadweight stop``), as
    a firing verdict's STOP comes again: the previous sidecar may have died before the
    run's stream picked it up.
    """
    now = time.time()
    found = read_back(store, now, table.ended_ttl_seconds, limit=table.max_runs - len(table))
    restored = []
    with lock:
        for run in found:
            if table.restore(run.entry):
                lifecycle.restore(run.entry, run.incidents)
                restored.append(run.entry)
        for silent in table.silent(now, silent_run_seconds):
            end_run(silent, store, "silent", now)
        for entry in restored:
            check_exits(entry, now)
            if not entry.state.ended:
                entry.outbox.add(functools.partial(lifecycle.actions.resumed_operator_stop,
                                                   RunSnapshot.of(entry.state)))
    if restored:
        log.info("runs_resumed", runs=len(restored))
    return restored
