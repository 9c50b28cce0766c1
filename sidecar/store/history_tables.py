"""The run report's history in the state database: each run's steps packed a batch a row
(``step_batches``) and its logs a row each (``history``), both bounded per run.

Both are keyed by the run's life, (run id, incarnation): a run id used again (a relaunch,
a job template's fixed id) starts its steps at 1 again, and those must neither replace nor
join the steps of the life before.

``Store`` owns the connection, its lock and its transactions, and calls these inside them;
what goes into the two tables, and how they stay bounded, is here.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from . import history

log = structlog.get_logger("deadweight.store")

#: Steps (and log rows) of history kept per run; past it, every other older row is dropped,
#: so a long run keeps its whole span at a coarser grain (the report's plots need no more).
MAX_HISTORY_ROWS = 2000
#: The history kind under which step counts are held in memory (rows of ``step_batches``).
PACKED_STEPS = "steps"
#: One life of a run id: (run id, incarnation).
Life = tuple[str, int]
#: (life, kind) pairs whose history row count is held in memory.
_MAX_COUNTED_HISTORIES = 10_000


class HistoryTables:
    """Writes and reads of the two history tables (the caller holds the store's lock, and a
    transaction for writes)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        #: History rows per (life, kind), once counted (see ``insert``).
        self._rows: dict[tuple[Life, str], int] = {}

    def _select(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return list(self._db.execute(sql, args).fetchall())

    def insert_steps(self, life: Life, rows: Sequence[history.StoredStep]) -> None:
        """In a transaction: one packed row of steps, the life's oldest thinned past the
        cap."""
        self._db.execute("INSERT OR REPLACE INTO step_batches (run_id, incarnation, "
                         "first_step, steps, packed) VALUES (?, ?, ?, ?, ?)",
                         (*life, rows[0][0], len(rows), history.pack_steps(rows)))
        self._keep_bounded((life, PACKED_STEPS), len(rows), lambda: self._count_steps(life),
                           lambda: self._db.execute(
            "DELETE FROM step_batches WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
            "row_number() OVER (ORDER BY first_step) AS n, COUNT(*) OVER () AS total "
            "FROM step_batches WHERE run_id=? AND incarnation=?) WHERE n % 2 = 0 AND "
            "n < total)", life))

    def _count_steps(self, life: Life) -> int:
        (count,) = self._db.execute(
            "SELECT COALESCE(SUM(steps), 0) FROM step_batches WHERE run_id=? AND "
            "incarnation=?", life).fetchone()
        return int(count)

    def _packed_steps(self, life: Life) -> list[history.StoredStep]:
        """A life's packed steps, by step (a step kept twice: the later batch's)."""
        by_step: dict[int, history.StoredStep] = {}
        for (packed,) in self._select("SELECT packed FROM step_batches WHERE run_id=? AND "
                                      "incarnation=? ORDER BY first_step", life):
            try:
                for stored in history.unpack_steps(packed):
                    by_step[stored[0]] = stored
            except ValueError as err:  # a damaged row: the steps before the damage are kept
                log.warning("history_row_damaged", run_id=life[0], incarnation=life[1],
                            error=str(err))
        return [by_step[step] for step in sorted(by_step)]

    def _keep_bounded(self, key: tuple[Life, str], added: int, counted: Callable[[], int],
                      thin: Callable[[], object]) -> None:
        """Count added rows (steps) for key, from SQL the first time; past MAX_HISTORY_ROWS,
        thin (drop every other older row) and count again."""
        count = self._rows.get(key)
        count = counted() if count is None else count + added
        if count > MAX_HISTORY_ROWS:
            thin()
            count = counted()
        if len(self._rows) >= _MAX_COUNTED_HISTORIES:
            self._rows.clear()  # bounded; counted again from SQL when next written
        self._rows[key] = count

    def insert(self, life: Life, kind: str,
               rows: Sequence[tuple[int, float, str | bytes]]) -> None:
        """In a transaction: insert rows; past MAX_HISTORY_ROWS for the life and kind, drop
        every other older row. The row count is kept in memory (counting in SQL at every
        write grew with it)."""
        run_id, incarnation = life
        self._db.executemany(
            "INSERT OR REPLACE INTO history (run_id, incarnation, kind, step, time, series) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [(run_id, incarnation, kind, step, at, series) for step, at, series in rows])
        key = (life, kind)
        self._keep_bounded(key, len(rows), lambda: self._count_history(life, kind), lambda: (
            self._db.execute(
                "DELETE FROM history WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
                "row_number() OVER (ORDER BY step) AS n, COUNT(*) OVER () AS total FROM "
                "history WHERE run_id=? AND incarnation=? AND kind=?) WHERE n % 2 = 0 AND "
                "n < total)", (run_id, incarnation, kind))))

    def _count_history(self, life: Life, kind: str) -> int:
        (count,) = self._db.execute(
            "SELECT COUNT(*) FROM history WHERE run_id=? AND incarnation=? AND kind=?",
            (*life, kind)).fetchone()
        return int(count)

    def read(self, life: Life, kind: str) -> list[tuple[int, float, dict[str, float]]]:
        """(step, time, figures) of a life's history of one kind ("step" or "log"), by step.

        Steps are read from their batches (``step_batches``) and from the one-row-per-step
        form a sidecar before packing wrote (a step in both: the packed one)."""
        rows: dict[int, tuple[float, bytes | str]] = {
            step: (at, series) for step, at, series in self._select(
                "SELECT step, time, series FROM history WHERE run_id=? AND incarnation=? "
                "AND kind=? ORDER BY step", (*life, kind))}
        if kind == "step":
            rows.update((step, (at, kept)) for step, at, kept in self._packed_steps(life))
        return [(step, at, history.stored_figures(at, series))
                for step, (at, series) in sorted(rows.items())]
