"""Restart: what a previous sidecar left in the store, read back before the lock is taken.

``read_back`` prunes the journal past its retention and reads the runs still worth keeping
(live, or ended within the TTL) with their bindings, checkpoints and incidents; the registry
then installs them under its lock. Stall clocks restart with the sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from deadweight.sidecar.registry.run_table import RunEntry
from deadweight.sidecar.state import RunState
from deadweight.sidecar.store import RETENTION_SECONDS, Store, StoredIncident

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
    for stored in store.runs(ended_since=now - ended_ttl_seconds)[:limit]:
        run = RunState(stored.run_id, created=stored.created)
        run.start = stored.start
        entry = RunEntry(run)
        entry.identities = store.bindings(stored.run_id)
        for rank in entry.identities:
            run.rank(rank).last_seen = now  # stall clocks restart with the sidecar
        run.ended, run.end_reason, run.ended_at = (
            stored.ended, stored.end_reason, stored.ended_at)
        points = store.checkpoints(stored.run_id)
        run.checkpoints.extend(points)
        run.checkpoints_total = len(points)
        restored.append(RestoredRun(entry, store.incidents(stored.run_id)))
    return restored
