"""Opening the state database: a private folder, private files, and damage moved aside.

The journal decides whether the sidecar pages or kills again after a restart, so whoever can
rewrite it can steer enforcement. The state dir is created 0700; an existing one with group or
other bits is tightened (loudly); one owned by another uid is refused; the database files are
0600. A database that SQLite cannot read is renamed ``deadweight.db.corrupt-<time>-<pid>``
with an error log line, and a fresh one is started: the sidecar watches runs again at once,
without the old journal. A full disk or a lock is never mistaken for damage.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("deadweight.store")

DB_NAME = "deadweight.db"
SCHEMA_VERSION = 1

#: SQLite's primary result codes for a damaged file and for a file that is no database.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


class StateDirUnsafe(PermissionError):
    """The state dir belongs to another uid: whoever owns it could rewrite the journal."""


class _Corrupt(sqlite3.DatabaseError):
    """SQLite's own check found damaged pages."""


@dataclass(frozen=True)
class OpenedDb:
    connection: sqlite3.Connection
    #: The database file; None when the state lives in memory only.
    path: Path | None
    #: Where a damaged database was moved (None: it was sound or new).
    moved_aside: Path | None


def open_state_db(state_dir: Path | None, schema: str) -> OpenedDb:
    """The state database in state_dir (or in memory), checked, private and with schema."""
    if state_dir is None:
        return OpenedDb(_connect(":memory:", schema), None, None)
    _private_dir(state_dir)
    path = state_dir / DB_NAME
    moved_aside = None
    _create_private(path)
    try:
        connection = _connect(str(path), schema)
    except sqlite3.DatabaseError as err:
        if not _is_corrupt(err):
            raise
        moved_aside = _move_aside(path, str(err))
        _create_private(path)
        connection = _connect(str(path), schema)
    _private_files(path)
    return OpenedDb(connection, path, moved_aside)


def _connect(target: str, schema: str) -> sqlite3.Connection:
    """Connect, check that SQLite can read every page, and create the schema."""
    db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=10.0)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # durable across a crash of the process
        check = db.execute("PRAGMA quick_check").fetchone()
        if check is None or check[0] != "ok":
            raise _Corrupt(f"quick_check: {check[0] if check else 'no answer'}")
        db.executescript(schema)
        db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                   (str(SCHEMA_VERSION),))
    except sqlite3.DatabaseError:
        db.close()
        raise
    return db


def _is_corrupt(err: sqlite3.DatabaseError) -> bool:
    """True for damage; False for a full disk, a lock or permissions (never moved aside)."""
    code = getattr(err, "sqlite_errorcode", None)
    return isinstance(err, _Corrupt) or (code is not None and code & 0xFF in (
        _SQLITE_CORRUPT, _SQLITE_NOTADB))


def _private_dir(folder: Path) -> None:
    """Create folder 0700, or make an existing one of ours 0700; refuse another uid's."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if info.st_uid != os.geteuid():
        raise StateDirUnsafe(f"state dir {folder} is owned by uid {info.st_uid}, not by this "
                             f"sidecar's uid {os.geteuid()}; refusing to use it")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        os.chmod(folder, 0o700)
        log.error("state_dir_tightened", folder=str(folder), was=oct(mode), now="0o700",
                  reason="other users could read or replace the journal")


def _create_private(db: Path) -> None:
    """Create the database file 0600 before SQLite does (it would follow the umask)."""
    if not db.exists():
        os.close(os.open(db, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600))


def _private_files(db: Path) -> None:
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        try:
            if stat.S_IMODE(path.stat().st_mode) != 0o600:
                os.chmod(path, 0o600)
        except FileNotFoundError:
            pass


def _move_aside(db: Path, why: str) -> Path:
    """Rename a database SQLite cannot use (and its WAL) out of the way; say so loudly."""
    aside = db.with_name(f"{db.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{db}{suffix}")
        if source.exists():
            os.replace(source, Path(f"{aside}{suffix}"))
    log.error("state_db_corrupt", path=str(db), moved_to=str(aside), error=why,
              note="a fresh state database was started; the old journal is kept aside")
    return aside
