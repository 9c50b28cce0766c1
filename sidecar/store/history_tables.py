"""The run report's history in the state database: each run's steps packed a batch a row
(``step_batches``) and its logs a row each (``history``), both bounded per run.

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
#: (run, kind) pairs whose history row count is held in memory.
_MAX_COUNTED_HISTORIES = 10_000


class HistoryTables:
    """Writes and reads of the two history tables (the caller holds the store's lock, and a
    transaction for writes)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        #: History rows per (run, kind), once counted (see ``insert``).
        self._rows: dict[tuple[str, str], int] = {}

    def _select(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return list(self._db.execute(sql, args).fetchall())

    def insert_steps(self, run_id: str, rows: Sequence[history.StoredStep]) -> None:
        """In a transaction: one packed row of steps, the run's oldest thinned past the cap."""
        self._db.execute("INSERT OR REPLACE INTO step_batches VALUES (?, ?, ?, ?)",
                         (run_id, rows[0][0], len(rows), history.pack_steps(rows)))
        self._keep_bounded((run_id, PACKED_STEPS), len(rows), lambda: self._count_steps(run_id),
                           lambda: self._db.execute(
            "DELETE FROM step_batches WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
            "row_number() OVER (ORDER BY first_step) AS n, COUNT(*) OVER () AS total "
            "FROM step_batches WHERE run_id=?) WHERE n % 2 = 0 AND n < total)", (run_id,)))

    def _count_steps(self, run_id: str) -> int:
        (count,) = self._db.execute(
            "SELECT COALESCE(SUM(steps), 0) FROM step_batches WHERE run_id=?",
            (run_id,)).fetchone()
        return int(count)

    def _packed_steps(self, run_id: str) -> list[history.StoredStep]:
        """A run's packed steps, by step (a step kept twice: the later batch's)."""
        by_step: dict[int, history.StoredStep] = {}
        for (packed,) in self._select("SELECT packed FROM step_batches WHERE run_id=? "
                                      "ORDER BY first_step", (run_id,)):
            try:
                for stored in history.unpack_steps(packed):
                    by_step[stored[0]] = stored
            except ValueError as err:  # a damaged row: the steps before the damage are kept
                log.warning("history_row_damaged", run_id=run_id, error=str(err))
        return [by_step[step] for step in sorted(by_step)]

    def _keep_bounded(self, key: tuple[str, str], added: int, counted: Callable[[], int],
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

    def insert(self, run_id: str, kind: str,
               rows: Sequence[tuple[int, float, str | bytes]]) -> None:
        """In a transaction: insert rows; past MAX_HISTORY_ROWS for the run and kind, drop
        every other older row. The row count is kept in memory (counting in SQL at every
        write grew with it)."""
        self._db.executemany("INSERT OR REPLACE INTO history VALUES (?, ?, ?, ?, ?)",
                             [(run_id, kind, step, at, series) for step, at, series in rows])
        key = (run_id, kind)
        self._keep_bounded(key, len(rows), lambda: self._count_history(key), lambda: (
            self._db.execute(
                "DELETE FROM history WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
                "row_number() OVER (ORDER BY step) AS n, COUNT(*) OVER () AS total FROM "
                "history WHERE run_id=? AND kind=?) WHERE n % 2 = 0 AND n < total)",
                (run_id, kind))))

    def _count_history(self, key: tuple[str, str]) -> int:
        (count,) = self._db.execute(
            "SELECT COUNT(*) FROM history WHERE run_id=? AND kind=?", key).fetchone()
        return int(count)

    def read(self, run_id: str, kind: str) -> list[tuple[int, float, dict[str, float]]]:
        """(step, time, figures) of a run's history of one kind ("step" or "log"), by step.

        Steps are read from their batches (``step_batches``) and from the one-row-per-step
        form a sidecar before packing wrote (a step in both: the packed one)."""
        rows: dict[int, tuple[float, bytes | str]] = {
            step: (at, series) for step, at, series in self._select(
                "SELECT step, time, series FROM history WHERE run_id=? AND kind=? "
                "ORDER BY step", (run_id, kind))}
        if kind == "step":
            rows.update((step, (at, kept)) for step, at, kept in self._packed_steps(run_id))
        return [(step, at, history.stored_figures(at, series))
                for step, (at, series) in sorted(rows.items())]
