"""The sidecar's memory across restarts: one SQLite file (WAL) in ``--state-dir``.

It holds the runs, which process registered each rank (pid, start time, boot id, as the kernel
reported them), the checkpoint hashes, the incidents and every action with its result. A
restarted sidecar reads it back, so it neither pages nor kills twice for the same incident and
checkpoint comparisons continue. An action that signals a process is written as ``pending``
before the signal and updated after it: a crash in between counts as done (at most once).
Without a state dir the same schema lives in memory, so the code paths do not differ.

Opening it (a private folder and files, damage moved aside) is ``state_db``'s job. A write
that fails (a full disk) raises ``StoreWriteFailed`` and is counted; the caller keeps what it
was about to record pending and tries again later.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ...proto import pb
from ..model.process import ProcessIdentity
from ..model.run_state import CheckpointPoint
from . import history
from .files import open_state_db
from .history_tables import HistoryTables

log = structlog.get_logger("deadweight.store")

#: One log kept for the report: (step, time, the figures worth a plot).
LoggedFigures = tuple[int, float, dict[str, float]]
#: The history kind of a multi-rank run's step timings: per step every rank timed, its
#: slowest rank's own seconds over the next slowest's (``slowest_over_next``), what a
#: baseline calibrates ``rank_straggler`` with.
RANKS = "ranks"
#: One life of a run id, the key of its history: (run id, incarnation).
Life = tuple[str, int]

#: Tables once keyed by run id alone, now by run id and incarnation too: their layout, also
#: given to an older file's table (``migrate`` copies its rows in as they were).
_REKEYED = {
    "runs": """CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT NOT NULL, trainer TEXT NOT NULL, start BLOB, created REAL NOT NULL,
    ended INTEGER NOT NULL DEFAULT 0, end_reason TEXT NOT NULL DEFAULT '', ended_at REAL,
    incarnation INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (run_id, incarnation));
""",
    "history": """CREATE TABLE IF NOT EXISTS history (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, step INTEGER NOT NULL, time REAL NOT NULL,
    series TEXT NOT NULL, incarnation INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (run_id, incarnation, kind, step));
""",
    "step_batches": """CREATE TABLE IF NOT EXISTS step_batches (
    run_id TEXT NOT NULL, first_step INTEGER NOT NULL, steps INTEGER NOT NULL,
    packed BLOB NOT NULL, incarnation INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (run_id, incarnation, first_step));
""",
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS bindings (
    run_id TEXT NOT NULL, incarnation INTEGER NOT NULL, rank INTEGER NOT NULL,
    pid INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    start_time INTEGER NOT NULL, boot_id TEXT NOT NULL, bound_at REAL NOT NULL,
    PRIMARY KEY (run_id, incarnation, rank));
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL, digest TEXT NOT NULL,
    tensors TEXT NOT NULL, bytes INTEGER NOT NULL, time REAL NOT NULL,
    incarnation INTEGER NOT NULL DEFAULT 1);
CREATE INDEX IF NOT EXISTS checkpoints_run ON checkpoints (run_id, time);
CREATE TABLE IF NOT EXISTS signed_adapters (
    digest TEXT NOT NULL, run_id TEXT NOT NULL, incarnation INTEGER NOT NULL,
    time REAL NOT NULL);
CREATE INDEX IF NOT EXISTS signed_adapters_digest ON signed_adapters (digest, time);
CREATE TABLE IF NOT EXISTS incidents (
    run_id TEXT NOT NULL, detector TEXT NOT NULL, incident INTEGER NOT NULL,
    severity TEXT NOT NULL, policy TEXT NOT NULL, step INTEGER NOT NULL, summary TEXT NOT NULL,
    evidence TEXT NOT NULL, fired_at REAL NOT NULL, resolved_at REAL,
    enforcement TEXT NOT NULL DEFAULT 'none', incarnation INTEGER NOT NULL DEFAULT 1,
    targets TEXT NOT NULL DEFAULT '{}', last_evidence TEXT,
    PRIMARY KEY (run_id, detector, incident));
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, run_id TEXT NOT NULL,
    trainer TEXT NOT NULL, detector TEXT NOT NULL, incident INTEGER NOT NULL,
    action TEXT NOT NULL, result TEXT NOT NULL, rank INTEGER, pid INTEGER,
    dry_run INTEGER NOT NULL, detail TEXT NOT NULL, incarnation INTEGER NOT NULL DEFAULT 1);
CREATE INDEX IF NOT EXISTS actions_incident ON actions (run_id, detector, incident);
CREATE TABLE IF NOT EXISTS pager_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, destination TEXT NOT NULL,
    idempotency_key TEXT NOT NULL, page INTEGER, run_id TEXT NOT NULL, detector TEXT NOT NULL,
    kind TEXT NOT NULL, payload TEXT NOT NULL, created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT NOT NULL DEFAULT '',
    settled TEXT, settled_at REAL);
CREATE INDEX IF NOT EXISTS pager_outbox_open ON pager_outbox (destination, settled, id);
""" + "".join(_REKEYED.values())

#: Columns added since the first layout: (table, column, declaration), added to an older file.
_ADDED_COLUMNS = (
    ("runs", "incarnation", "INTEGER NOT NULL DEFAULT 1"),
    ("incidents", "incarnation", "INTEGER NOT NULL DEFAULT 1"),
    ("incidents", "targets", "TEXT NOT NULL DEFAULT '{}'"),
    ("incidents", "last_evidence", "TEXT"),
    ("actions", "incarnation", "INTEGER NOT NULL DEFAULT 1"),
    ("checkpoints", "incarnation", "INTEGER NOT NULL DEFAULT 1"),
    ("history", "incarnation", "INTEGER NOT NULL DEFAULT 1"),
    ("step_batches", "incarnation", "INTEGER NOT NULL DEFAULT 1"),
)
#: Indexes on columns an older file gains in ``migrate`` (created after it).
_INDEXES = """
CREATE INDEX IF NOT EXISTS checkpoints_incarnation ON checkpoints (run_id, incarnation, time);
CREATE INDEX IF NOT EXISTS checkpoints_digest ON checkpoints (digest, time);
CREATE INDEX IF NOT EXISTS actions_incarnation ON actions (run_id, incarnation, id);
"""
#: An older file's bindings (keyed by run id and rank) become incarnation 1's.
_REKEY_BINDINGS = """
ALTER TABLE bindings RENAME TO bindings_by_run;
CREATE TABLE bindings (
    run_id TEXT NOT NULL, incarnation INTEGER NOT NULL, rank INTEGER NOT NULL,
    pid INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    start_time INTEGER NOT NULL, boot_id TEXT NOT NULL, bound_at REAL NOT NULL,
    PRIMARY KEY (run_id, incarnation, rank));
INSERT INTO bindings SELECT run_id, 1, rank, pid, uid, gid, start_time, boot_id, bound_at
    FROM bindings_by_run;
DROP TABLE bindings_by_run;
"""


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _primary_key(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})") if row[5]}


def migrate(db: sqlite3.Connection) -> None:
    """Bring a state file of an older sidecar to this layout: every run, binding, checkpoint,
    history row, incident and action is keyed by run id and incarnation (what an older file
    held is incarnation 1). Each table is rebuilt in one transaction: a crash leaves the
    old table or the new one, never half of each."""
    for table, column, declaration in _ADDED_COLUMNS:
        if column not in _columns(db, table):
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
    if "incarnation" not in _columns(db, "bindings"):
        db.executescript(_REKEY_BINDINGS)
    for table, layout in _REKEYED.items():
        if "incarnation" not in _primary_key(db, table):
            _rekey(db, table, layout)
    db.executescript(_INDEXES)


def _rekey(db: sqlite3.Connection, table: str, layout: str) -> None:
    """Rebuild table with layout (keyed by incarnation too), its rows copied as they are
    (their incarnation column was added already: 1 unless the row said otherwise)."""
    columns = ", ".join(sorted(_columns(db, table)))
    try:
        db.executescript(f"BEGIN; ALTER TABLE {table} RENAME TO {table}_by_run; {layout} "
                         f"INSERT INTO {table} ({columns}) SELECT {columns} FROM "
                         f"{table}_by_run; DROP TABLE {table}_by_run; COMMIT;")
    except sqlite3.Error:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


#: How long the journal of an ended run is kept (pruned when the sidecar starts).
RETENTION_SECONDS = 30 * 86400
#: incidents.enforcement while an escalation (STOP, SIGTERM, SIGKILL) is still in progress.
ENFORCEMENT_OPEN = "open"


class StoreWriteFailed(RuntimeError):
    """A write did not reach the database (disk full, I/O error); nothing was recorded."""


@dataclass(frozen=True)
class StoredRun:
    run_id: str
    trainer: str
    start: pb.RunStart | None
    created: float
    ended: bool
    end_reason: str
    ended_at: float
    incarnation: int = 1


@dataclass(frozen=True)
class StoredIncident:
    run_id: str
    detector: str
    incident: int
    severity: str
    policy: str
    step: int
    summary: str
    evidence: dict[str, str]
    fired_at: float
    resolved_at: float | None
    enforcement: str
    incarnation: int = 1
    #: rank -> the process an escalation of this incident may signal, fixed when it began.
    targets: dict[int, ProcessIdentity] = field(default_factory=dict)
    #: The evidence when the verdict resolved or its run ended (empty: none noted since it
    #: fired; ``evidence`` is the evidence at firing).
    last_evidence: dict[str, str] = field(default_factory=dict)

    @property
    def latest_evidence(self) -> dict[str, str]:
        """The newest evidence noted: at resolution or run end, else at firing."""
        return self.last_evidence or self.evidence


@dataclass(frozen=True)
class StoredDelivery:
    """One page (or resolution) to one pager destination, journaled before it is tried and
    settled once acknowledged (``actions.outbox``): those still open at a restart go again."""

    id: int
    destination: str
    idempotency_key: str
    page: int | None  # the page's action id (None: a resolution or a re-assertion)
    run_id: str
    detector: str
    kind: str
    payload: dict[str, Any]
    created: float
    attempts: int


@dataclass(frozen=True)
class ActionRow:
    id: int
    time: float
    run_id: str
    trainer: str
    detector: str
    incident: int
    action: str
    result: str
    rank: int | None
    pid: int | None
    dry_run: bool
    detail: dict[str, Any]
    incarnation: int = 1


class Store:
    """Thread-safe access to the state database; every write commits before returning."""

    def __init__(self, state_dir: str | Path | None = None) -> None:
        self._lock = threading.RLock()
        #: Writes that failed (disk full, I/O error): exported on /metrics.
        self.write_failures = 0
        opened = open_state_db(None if state_dir is None else Path(state_dir), SCHEMA)
        self._db = opened.connection
        migrate(self._db)
        #: The database file (None: memory only).
        self.path: Path | None = opened.path
        #: Where a corrupt database was moved at start (None: it was sound or new).
        self.moved_aside: Path | None = opened.moved_aside
        #: The report's history tables (written inside this store's transactions).
        self._history = HistoryTables(self._db)

    @property
    def persistent(self) -> bool:
        return self.path is not None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        with self._lock:
            try:
                cursor = self._db.execute(sql, args)
            except (sqlite3.OperationalError, OSError) as err:
                self.write_failures += 1
                log.error("state_write_failed", error=str(err), failures=self.write_failures)
                raise StoreWriteFailed(str(err)) from err
            return int(cursor.lastrowid or 0)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT, ROLLBACK on an error: the writes inside commit together or not at
        all. A write that fails raises StoreWriteFailed, counted once."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                try:
                    yield
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except (sqlite3.OperationalError, OSError) as err:
                self.write_failures += 1
                log.error("state_write_failed", error=str(err), failures=self.write_failures)
                raise StoreWriteFailed(str(err)) from err

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    # -- runs ------------------------------------------------------------------------------

    def upsert_run(self, run_id: str, trainer: str, start: pb.RunStart,
                   incarnation: int = 1) -> None:
        """An incarnation of the run id and its RunStart (a row per incarnation: an earlier
        one keeps its own row, its end and its verdicts)."""
        clean = pb.RunStart()
        clean.CopyFrom(start)
        clean.attestation = ""  # redeemed already; worthless and not worth keeping
        self._write(
            "INSERT INTO runs (run_id, trainer, start, created, incarnation) "
            "VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(run_id, incarnation) DO UPDATE SET trainer=excluded.trainer, "
            "start=excluded.start, ended=0, end_reason='', ended_at=NULL",
            (run_id, trainer, clean.SerializeToString(), time.time(), incarnation),
        )

    def end_run(self, run_id: str, reason: str, at: float, incarnation: int = 1) -> None:
        """End the run id's incarnation (an older incarnation's end changes nothing)."""
        self._write("UPDATE runs SET ended=1, end_reason=?, ended_at=? WHERE run_id=? "
                    "AND incarnation=?", (reason, at, run_id, incarnation))

    def last_incarnation(self, run_id: str) -> int:
        """The highest incarnation the journal knows of a run id (0: none)."""
        rows = self._read(
            "SELECT MAX(n) FROM (SELECT incarnation AS n FROM runs WHERE run_id=? "
            "UNION ALL SELECT incarnation FROM incidents WHERE run_id=? "
            "UNION ALL SELECT incarnation FROM bindings WHERE run_id=?)",
            (run_id, run_id, run_id))
        return int(rows[0][0] or 0) if rows else 0

    def runs(self, ended_since: float = 0.0, newest: bool = False) -> list[StoredRun]:
        """Live runs, and ended runs that ended after ended_since: every incarnation, or
        (newest) only each run id's newest (the one a restarted sidecar watches)."""
        only = (" AND incarnation = (SELECT MAX(incarnation) FROM runs AS later WHERE "
                "later.run_id = runs.run_id)") if newest else ""
        rows = self._read(
            "SELECT run_id, trainer, start, created, ended, end_reason, ended_at, incarnation "
            f"FROM runs WHERE (ended=0 OR ended_at >= ?){only} ORDER BY created, incarnation",
            (ended_since,))
        found = []
        for run_id, trainer, blob, created, ended, reason, ended_at, incarnation in rows:
            start = pb.RunStart.FromString(blob) if blob else None
            found.append(StoredRun(run_id, trainer, start, created, bool(ended), reason,
                                   ended_at or 0.0, int(incarnation)))
        return found

    # -- who registered each rank ----------------------------------------------------------

    def bind(self, run_id: str, rank: int, identity: ProcessIdentity,
             incarnation: int = 1) -> None:
        """The process of one rank of one incarnation; written once (a rank of an
        incarnation is never bound to a second process: that is another incarnation)."""
        self._write(
            "INSERT OR IGNORE INTO bindings VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, incarnation, rank, identity.pid, identity.uid, identity.gid,
             identity.start_time, identity.boot_id, time.time()),
        )

    def bindings(self, run_id: str, incarnation: int | None = None
                 ) -> dict[int, ProcessIdentity]:
        """rank -> process of one incarnation (None: the run id's newest one, as the runs
        table names it, else its newest bound one)."""
        if incarnation is None:
            incarnation = self._current_incarnation(run_id)
        rows = self._read(
            "SELECT rank, pid, uid, gid, start_time, boot_id FROM bindings WHERE run_id=? "
            "AND incarnation=?", (run_id, incarnation))
        return {rank: ProcessIdentity(pid, uid, gid, start, boot)
                for rank, pid, uid, gid, start, boot in rows}

    def _current_incarnation(self, run_id: str) -> int:
        """The run id's newest incarnation in the runs table, else its newest bound one."""
        rows = self._read("SELECT MAX(incarnation) FROM runs WHERE run_id=?", (run_id,))
        if rows and rows[0][0] is not None:
            return int(rows[0][0])
        rows = self._read("SELECT MAX(incarnation) FROM bindings WHERE run_id=?", (run_id,))
        return int(rows[0][0] or 1)

    # -- checkpoints -----------------------------------------------------------------------

    def add_checkpoint(self, run_id: str, point: CheckpointPoint, incarnation: int = 1) -> None:
        """A checkpoint of one incarnation (the hash chain a later one compares is its own)."""
        self._write(
            "INSERT INTO checkpoints (run_id, step, path, digest, tensors, bytes, time, "
            "incarnation) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, point.step, point.path, point.combined_digest,
             json.dumps(point.tensor_digests, sort_keys=True), point.adapter_bytes, point.time,
             incarnation),
        )

    def checkpoints(self, run_id: str, incarnation: int | None = None,
                    limit: int = 10_000) -> list[CheckpointPoint]:
        """One incarnation's checkpoints, oldest first (None: the run id's newest one)."""
        if incarnation is None:
            incarnation = self._current_incarnation(run_id)
        rows = self._read(
            "SELECT step, path, digest, tensors, bytes, time FROM checkpoints WHERE run_id=? "
            "AND incarnation=? ORDER BY time DESC, rowid DESC LIMIT ?",
            (run_id, incarnation, limit))
        return [CheckpointPoint(step, path, digest, json.loads(tensors), size, at)
                for step, path, digest, tensors, size, at in reversed(rows)]

    def add_signed_adapter(self, digest: str, run_id: str, incarnation: int,
                           at: float) -> None:
        """An adapter whose summary the sidecar signed for a run (it read the files itself):
        a producer ``first_producer`` knows even when no checkpoint reported those bytes (a
        script's ``save_model`` after training)."""
        self._write("INSERT INTO signed_adapters (digest, run_id, incarnation, time) "
                    "VALUES (?, ?, ?, ?)", (digest, run_id, incarnation, at))

    def first_producer(self, digest: str) -> tuple[str, int] | None:
        """(run id, incarnation) of the earliest checkpoint or signed summary with this
        adapter digest; None when no run reported those bytes."""
        rows = self._read(
            "SELECT run_id, incarnation FROM (SELECT run_id, incarnation, time FROM checkpoints "
            "WHERE digest=? UNION ALL SELECT run_id, incarnation, time FROM signed_adapters "
            "WHERE digest=?) ORDER BY time LIMIT 1", (digest, digest))
        return (str(rows[0][0]), int(rows[0][1])) if rows else None

    def had_critical(self, run_id: str, incarnation: int) -> bool:
        """Whether a critical verdict ever fired on this life of the run id."""
        return bool(self._read("SELECT 1 FROM incidents WHERE run_id=? AND incarnation=? AND "
                               "severity='critical' LIMIT 1", (run_id, incarnation)))

    # -- incidents -------------------------------------------------------------------------

    def open_incident(
        self, run_id: str, detector: str, incident: int, severity: str, policy: str,
        step: int, summary: str, evidence: dict[str, str], fired_at: float, enforce: bool,
        incarnation: int = 1,
    ) -> None:
        self._write(
            "INSERT OR IGNORE INTO incidents (run_id, detector, incident, severity, policy, "
            "step, summary, evidence, fired_at, resolved_at, enforcement, incarnation) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?)",
            (run_id, detector, incident, severity, policy, step, summary,
             json.dumps(evidence, sort_keys=True), fired_at,
             ENFORCEMENT_OPEN if enforce else "none", incarnation),
        )

    def set_targets(self, run_id: str, detector: str, incident: int,
                    targets: dict[int, ProcessIdentity], incarnation: int | None = None
                    ) -> None:
        """The processes an escalation may signal, fixed when it begins (a restart reads
        them back; nothing bound later, under any incarnation, is ever added)."""
        encoded = {str(rank): [i.pid, i.uid, i.gid, i.start_time, i.boot_id]
                   for rank, i in targets.items()}
        life, args = _life(incarnation)
        self._write("UPDATE incidents SET targets=? WHERE run_id=? AND detector=? AND "
                    f"incident=?{life}", (json.dumps(encoded, sort_keys=True), run_id,
                                          detector, incident, *args))

    def resolve_incident(self, run_id: str, detector: str, incident: int, at: float,
                         evidence: dict[str, str] | None = None,
                         incarnation: int | None = None) -> None:
        """The condition cleared while the run was live; evidence: the latest it showed."""
        life, args = _life(incarnation)
        self._write(
            "UPDATE incidents SET resolved_at=?, last_evidence=COALESCE(?, last_evidence) "
            f"WHERE run_id=? AND detector=? AND incident=? AND resolved_at IS NULL{life}",
            (at, None if evidence is None else json.dumps(evidence, sort_keys=True), run_id,
             detector, incident, *args))

    def note_evidence(self, run_id: str, detector: str, incident: int,
                      evidence: dict[str, str], incarnation: int | None = None) -> None:
        """The latest evidence of an open incident (its run ended with it firing)."""
        life, args = _life(incarnation)
        self._write(
            "UPDATE incidents SET last_evidence=? WHERE run_id=? AND detector=? AND incident=? "
            f"AND resolved_at IS NULL{life}",
            (json.dumps(evidence, sort_keys=True), run_id, detector, incident, *args))

    def close_enforcement(self, run_id: str, detector: str, incident: int,
                          outcome: str, incarnation: int | None = None) -> None:
        life, args = _life(incarnation)
        self._write(
            "UPDATE incidents SET enforcement=? WHERE run_id=? AND detector=? AND incident=?"
            f"{life}", (outcome, run_id, detector, incident, *args))

    def _incidents(self, where: str, args: tuple[Any, ...]) -> list[StoredIncident]:
        rows = self._read(
            "SELECT run_id, detector, incident, severity, policy, step, summary, evidence, "
            f"fired_at, resolved_at, enforcement, incarnation, targets, last_evidence FROM "
            f"incidents WHERE {where} ORDER BY fired_at, incident", args)
        return [StoredIncident(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]),
                               r[8], r[9], r[10], r[11], _targets(r[12]),
                               json.loads(r[13]) if r[13] else {}) for r in rows]

    def last_incidents(self, run_id: str) -> dict[str, int]:
        """Per detector, the highest incident number journaled for a run (absent: none)."""
        rows = self._read("SELECT detector, MAX(incident) FROM incidents WHERE run_id=? "
                          "GROUP BY detector", (run_id,))
        return {detector: int(number) for detector, number in rows}

    def incidents(self, run_id: str, incarnation: int | None = None
                  ) -> list[StoredIncident]:
        """A run id's incidents, of every incarnation or of one."""
        if incarnation is None:
            return self._incidents("run_id=?", (run_id,))
        return self._incidents("run_id=? AND incarnation=?", (run_id, incarnation))

    def open_enforcements(self) -> list[StoredIncident]:
        return self._incidents("enforcement=?", (ENFORCEMENT_OPEN,))

    # -- per-step history (for the run report) ---------------------------------------------

    def add_history(self, run_id: str, kind: str, step: int, series: dict[str, float],
                    at: float, incarnation: int = 1) -> None:
        """Keep one step's figures of one kind ("step" or "log"); bounded per run and kind."""
        with self._transaction():
            self._history.insert((run_id, incarnation), kind,
                                 [(step, at, json.dumps(series, sort_keys=True))])

    def add_logs(self, run_id: str, logs: Sequence[LoggedFigures],
                 incarnation: int = 1) -> None:
        """Keep a batch's logs, (step, time, figures) each, in one transaction."""
        self.write_history(logs=[((run_id, incarnation), logs)])

    def add_step_history(self, run_id: str, rows: Sequence[history.StoredStep],
                         incarnation: int = 1) -> None:
        """Keep a batch of steps (``history.encode_step``) as one row (``history.pack_steps``);
        past ``history_tables.MAX_HISTORY_ROWS`` steps of the run, every other older batch
        is dropped (a batch is a few steps in a real run; the run's whole span stays, at a
        coarser grain)."""
        self.write_history(steps=[((run_id, incarnation), rows)])

    def add_rank_history(self, run_id: str, rows: Sequence[LoggedFigures],
                         incarnation: int = 1) -> None:
        """Keep a batch's rank timings (``RANKS``: step, time, figures), in one transaction."""
        self.write_history(ranks=[((run_id, incarnation), rows)])

    def write_history(self, steps: Sequence[tuple[Life, Sequence[history.StoredStep]]] = (),
                      logs: Sequence[tuple[Life, Sequence[LoggedFigures]]] = (),
                      ranks: Sequence[tuple[Life, Sequence[LoggedFigures]]] = ()) -> None:
        """Steps, logs and rank timings of any number of runs in one transaction: a commit per
        batch cost more than the rest of a small batch's ingest (``HistoryQueue`` gathers
        them). Each is keyed by (run id, incarnation): a run id used again never writes over,
        nor reads, the steps of its earlier life."""
        if not any(rows for _, rows in steps) and not any(rows for _, rows in logs) \
                and not any(rows for _, rows in ranks):
            return
        with self._transaction():
            for life, rows in steps:
                if rows:
                    self._history.insert_steps(life, rows)
            for kind, lives in (("log", logs), (RANKS, ranks)):
                for life, entries in lives:
                    if entries:
                        self._history.insert(life, kind, [
                            (step, at, json.dumps(series, sort_keys=True))
                            for step, at, series in entries])

    def history(self, run_id: str, kind: str, incarnation: int | None = None
                ) -> list[tuple[int, float, dict[str, float]]]:
        """(step, time, figures) of one incarnation's history of one kind ("step", "log" or
        ``RANKS``), by step (None: the run id's newest incarnation)."""
        if incarnation is None:
            incarnation = self._current_incarnation(run_id)
        with self._lock:
            return self._history.read((run_id, incarnation), kind)

    def run(self, run_id: str, incarnation: int | None = None) -> StoredRun | None:
        """One incarnation of a run id, ended or not (None: its newest)."""
        lives = [r for r in self.runs() if r.run_id == run_id and (
            incarnation is None or r.incarnation == incarnation)]
        return max(lives, key=lambda r: r.incarnation, default=None)

    def incarnations(self, run_id: str) -> list[int]:
        """The incarnations of a run id the runs table holds, oldest first."""
        return [int(n) for (n,) in self._read(
            "SELECT incarnation FROM runs WHERE run_id=? ORDER BY incarnation", (run_id,))]

    # -- the action journal ----------------------------------------------------------------

    def add_action(
        self, run_id: str, trainer: str, detector: str, incident: int, action: str,
        result: str, rank: int | None = None, pid: int | None = None, dry_run: bool = False,
        detail: dict[str, Any] | None = None, at: float | None = None, incarnation: int = 1,
    ) -> int:
        return self._write(
            "INSERT INTO actions (time, run_id, trainer, detector, incident, action, result, "
            "rank, pid, dry_run, detail, incarnation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "?)",
            (time.time() if at is None else at, run_id, trainer, detector, incident, action,
             result, rank, pid, int(dry_run), json.dumps(detail or {}, sort_keys=True),
             incarnation),
        )

    def set_result(self, action_id: int, result: str) -> None:
        self._write("UPDATE actions SET result=? WHERE id=?", (result, action_id))

    def actions(self, run_id: str | None = None, detector: str | None = None,
                incident: int | None = None, incarnation: int | None = None
                ) -> list[ActionRow]:
        """Journaled actions, oldest first, of every run or of those named (a run id with
        incarnation: that life's only; without, every life of the run id)."""
        clauses: list[str] = []
        args: list[Any] = []
        for column, value in (("run_id", run_id), ("detector", detector),
                              ("incident", incident), ("incarnation", incarnation)):
            if value is not None:
                clauses.append(f"{column}=?")
                args.append(value)
        where = " AND ".join(clauses) or "1=1"
        rows = self._read(
            "SELECT id, time, run_id, trainer, detector, incident, action, result, rank, pid, "
            f"dry_run, detail, incarnation FROM actions WHERE {where} ORDER BY id",
            tuple(args))
        return [ActionRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9],
                          bool(r[10]), json.loads(r[11]), r[12]) for r in rows]

    def prune(self, ended_before: float) -> int:
        """Forget incarnations that ended before a time, with everything recorded about them
        (a later incarnation of the same run id keeps its own rows)."""
        with self._lock:
            lives = [(r[0], r[1]) for r in self._db.execute(
                "SELECT run_id, incarnation FROM runs WHERE ended=1 AND ended_at < ?",
                (ended_before,))]
            try:
                # Deliveries older than the retention go too, settled or not (a page a
                # month old is noise, not news).
                self._write("DELETE FROM pager_outbox WHERE created < ?", (ended_before,))
                for life in lives:
                    for table in ("bindings", "checkpoints", "signed_adapters", "incidents",
                                  "actions", "history", "step_batches", "runs"):
                        self._write(f"DELETE FROM {table} WHERE run_id=? AND incarnation=?",
                                    life)
            except StoreWriteFailed:
                return 0  # a full disk: pruning waits for the next start
        return len(lives)

    def action(self, action_id: int) -> ActionRow | None:
        """One journaled action by its id."""
        rows = self._read(
            "SELECT id, time, run_id, trainer, detector, incident, action, result, rank, pid, "
            "dry_run, detail, incarnation FROM actions WHERE id=?", (action_id,))
        return None if not rows else ActionRow(
            rows[0][0], rows[0][1], rows[0][2], rows[0][3], rows[0][4], rows[0][5], rows[0][6],
            rows[0][7], rows[0][8], rows[0][9], bool(rows[0][10]), json.loads(rows[0][11]),
            rows[0][12])

    # -- the pager outbox ------------------------------------------------------------------

    def add_delivery(self, destination: str, idempotency_key: str, page: int | None,
                     run_id: str, detector: str, kind: str, payload: dict[str, Any],
                     created: float) -> int:
        """Journal one delivery before its first attempt (committed when this returns)."""
        return self._write(
            "INSERT INTO pager_outbox (destination, idempotency_key, page, run_id, detector, "
            "kind, payload, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (destination, idempotency_key, page, run_id, detector, kind,
             json.dumps(payload, sort_keys=True), created))

    def delivery_tried(self, delivery_id: int, error: str) -> None:
        """One more failed attempt, and why."""
        self._write("UPDATE pager_outbox SET attempts=attempts+1, last_error=? WHERE id=?",
                    (error, delivery_id))

    def settle_deliveries(self, delivery_ids: Sequence[int], result: str) -> None:
        """Deliveries done with: acknowledged, superseded by a newer one, or dropped."""
        if not delivery_ids:
            return
        marks = ", ".join("?" * len(delivery_ids))
        self._write(f"UPDATE pager_outbox SET settled=?, settled_at=? WHERE id IN ({marks}) "
                    "AND settled IS NULL", (result, time.time(), *delivery_ids))

    def open_deliveries(self, destination: str) -> list[StoredDelivery]:
        """The destination's deliveries not yet settled, oldest first."""
        rows = self._read(
            "SELECT id, destination, idempotency_key, page, run_id, detector, kind, payload, "
            "created, attempts FROM pager_outbox WHERE destination=? AND settled IS NULL "
            "ORDER BY id", (destination,))
        return [StoredDelivery(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]),
                               r[8], r[9]) for r in rows]

    def has_action(self, run_id: str, detector: str, incident: int, action: str,
                   incarnation: int | None = None) -> bool:
        life, args = _life(incarnation)
        rows = self._read(
            "SELECT 1 FROM actions WHERE run_id=? AND detector=? AND incident=? AND action=?"
            f"{life} LIMIT 1", (run_id, detector, incident, action, *args))
        return bool(rows)


def _life(incarnation: int | None) -> tuple[str, tuple[int, ...]]:
    """The clause and argument that scope a write to one incarnation (none: the incident
    number alone, which no two incarnations share)."""
    return ("", ()) if incarnation is None else (" AND incarnation=?", (incarnation,))


def _targets(encoded: str) -> dict[int, ProcessIdentity]:
    return {int(rank): ProcessIdentity(int(v[0]), int(v[1]), int(v[2]), int(v[3]), str(v[4]))
            for rank, v in json.loads(encoded or "{}").items()}
