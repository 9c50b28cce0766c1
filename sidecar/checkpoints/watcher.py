"""Watch each run's output folder and inspect every checkpoint once it is complete.

A checkpoint folder (``checkpoint-<step>``) is complete when the callback reported it (its
``on_save`` fires after the files are on disk) or when its files kept the same names, sizes
and modification times for ``settle_seconds``. watchdog events make the watcher react at
once; a periodic scan of the watched folders covers missed events and folders that did not
exist yet when the run registered (the Trainer creates ``output_dir`` at its first save).

Every path comes from a client, so none is trusted: a checkpoint is read only when its folder
and every file in it belong to the uid the kernel named for the run (the run's process could
read them anyway, so the sidecar reads nothing on its behalf that its own uid could not
write), and, where the operator gave ``--watch-root`` folders, only while its resolved path
lies under one of them. A run that did not attest has no uid to check: its checkpoints are
read only under a ``--watch-root`` (the checks are ``access``'s, shared with ``SignSummary``).
Refusals reach the sink as findings. One watchdog observer serves every run; each scheduled
folder costs it one kernel watch thread, so at most ``max_watches`` folders get one (the
others are polled by the scan), and a run may name at most ``max_folders_per_run`` folders.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import structlog
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import ObservedWatch

from ..model.inspection import CheckpointInspection
from . import access
from .inspector import (
    ADAPTER_FILE,
    CheckpointRefused,
    NotACheckpoint,
    inspect_path,
)

log = structlog.get_logger("deadweight.checkpoints")

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
#: Give up on a folder that never becomes a complete checkpoint after this long.
PENDING_TIMEOUT_SECONDS = 600.0
#: Folders that get a kernel watch (one observer thread each); more are polled by the scan.
MAX_WATCHES = 64
#: Output folders one run may name (a run has one; a client naming thousands is refused).
MAX_FOLDERS_PER_RUN = 4


class InspectionSink(Protocol):
    def record_inspection(self, run_id: str, inspection: CheckpointInspection,
                          step: int = 0, incarnation: int | None = None) -> bool: ...


@dataclass
class _Pending:
    run_id: str
    path: Path
    since: float
    trusted: bool = False
    signature: tuple[tuple[str, int, int], ...] = ()
    stable_since: float = 0.0
    #: The life of the run id that reported or owns the folder: its inspection goes to that
    #: life only (one found after a relaunch is not the new life's).
    incarnation: int = 1


@dataclass
class _Watched:
    run_id: str
    folder: Path
    owner_uid: int | None = None
    #: The life of the run id that named the folder last (a relaunch names it again).
    incarnation: int = 1
    #: The folder exists and belongs to the run's uid (checked once it exists).
    owner_checked: bool = False
    #: Its refusal was reported (once).
    refused: bool = False
    watch: ObservedWatch | None = None
    seen: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)


def _signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    try:
        entries = sorted(folder.iterdir())
        return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in entries
                     if p.is_file())
    except OSError:
        return ()


def adapter_folder(path: Path, adapter: str) -> Path:
    """Where a checkpoint holds the run's active adapter: PEFT saves an adapter not named
    "default" into a subfolder of its name (the folder itself then holds the "default"
    adapter, if any), and the callback's digests are of the active adapter. An adapter
    name is the client's word: only a plain folder name is followed."""
    if adapter in ("", "default", ".", "..") or Path(adapter).name != adapter:
        return path
    named = path / adapter
    return named if (named / ADAPTER_FILE).is_file() else path


def _step(path: Path) -> int:
    match = CHECKPOINT_DIR.match(path.name)
    return int(match.group(1)) if match else 0


class _Handler(FileSystemEventHandler):  # type: ignore[misc]
    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.wake.set()


class CheckpointWatcher:
    """Finds complete checkpoints of registered runs and feeds their inspection to a sink."""

    def __init__(self, sink: InspectionSink, settle_seconds: float = 2.0,
                 scan_seconds: float = 1.0, roots: Iterable[str | Path] = (),
                 max_watches: int = MAX_WATCHES,
                 max_folders_per_run: int = MAX_FOLDERS_PER_RUN) -> None:
        self.sink = sink
        #: Resolved allowed roots; empty: no restriction beyond the run's own uid.
        self.roots = tuple(Path(os.path.realpath(r)) for r in roots)
        self.max_watches = max_watches
        self.max_folders_per_run = max_folders_per_run
        #: Paths refused (outside the roots, wrong owner, over a cap, not a regular file).
        self.refused = 0
        self.settle_seconds = settle_seconds
        self.scan_seconds = scan_seconds
        self.inspected = 0
        #: Completed passes of the worker (drain, scan, settle): lets a caller wait for the
        #: watcher to have looked again, rather than for a length of time.
        self.passes = 0
        self._requests: queue.Queue[tuple[str, str, str, int | None, int]] = queue.Queue()
        self._watched: dict[tuple[str, str], _Watched] = {}
        self._pending: dict[Path, _Pending] = {}
        self._done: dict[Path, tuple[tuple[str, int, int], ...]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._observer = Observer()
        self._handler = _Handler(self._wake)
        self._thread: threading.Thread | None = None

    # -- called by the registry (under its lock): never block ----------------------------

    def watch(self, run_id: str, output_dir: str, owner_uid: int | None = None,
              incarnation: int = 1) -> None:
        """Watch a run's output folder; owner_uid: the uid the kernel named for the run;
        incarnation: the life of the run id that named it (checkpoints found there go to it)."""
        self._requests.put(("watch", run_id, output_dir, owner_uid, incarnation))
        self._wake.set()

    def submit(self, run_id: str, path: str, incarnation: int = 1) -> None:
        """Inspect a checkpoint one life of the run reported (its inspection goes to it)."""
        self._requests.put(("submit", run_id, path, None, incarnation))
        self._wake.set()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._observer.start()
        self._thread = threading.Thread(target=self._loop, name="deadweight-checkpoints",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self._observer.stop()
        self._observer.join(10)

    # -- the worker ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.scan_seconds)
            self._wake.clear()
            try:
                self._drain()
                self._scan()
                self._settle()
            except Exception:  # the watcher must outlive one bad folder
                log.exception("checkpoint_watcher_failed")
            self.passes += 1

    def _refuse(self, run_id: str, path: Path, reason: str,
                incarnation: int | None = None) -> None:
        """Count, log and report a path that is not read; the run (that life of it, when
        known) gets a finding for it."""
        self.refused += 1
        log.warning("checkpoint_refused", run_id=run_id, path=str(path)[:512], reason=reason)
        record = getattr(self.sink, "record_refusal", None)
        if callable(record):
            record(run_id, str(path)[:512], reason, incarnation)

    def _outside(self, path: Path) -> str | None:
        """Why path may not be read (outside every root), or None."""
        return access.outside(path, self.roots)

    def _run_uids(self, run_id: str) -> set[int]:
        return {w.owner_uid for w in self._watched.values()
                if w.run_id == run_id and w.owner_uid is not None}

    def _active_adapter(self, run_id: str) -> str:
        """The adapter the run trains, as its start reported it ("" when unknown)."""
        known = getattr(self.sink, "run", None)
        run = known(run_id) if callable(known) else None
        start = getattr(run, "start", None)
        return str(start.preflight.active_adapter) if start is not None else ""

    def _foreign(self, run_id: str, path: Path, files: bool = True) -> str | None:
        """Why a folder (and, with files, every entry in it) is not the run's own
        (``access.foreign``)."""
        return access.foreign(path, self._run_uids(run_id), bool(self.roots), files)

    def _drain(self) -> None:
        while True:
            try:
                kind, run_id, where, owner_uid, life = self._requests.get_nowait()
            except queue.Empty:
                return
            path = Path(where)
            if not path.is_absolute():
                self._refuse(run_id, path, "not an absolute path", life)
                continue
            outside = self._outside(path)
            if outside is not None:
                self._refuse(run_id, path, outside, life)
                continue
            if kind == "watch":
                key = (run_id, str(path))
                known = self._watched.get(key)
                if known is not None:
                    if known.incarnation != life:  # a new life: its uid, checked afresh
                        known.incarnation, known.owner_uid = life, owner_uid
                        known.owner_checked = known.refused = False
                    continue
                folders = sum(1 for w in self._watched.values() if w.run_id == run_id)
                if folders >= self.max_folders_per_run:
                    self._refuse(run_id, path, f"the run already names {folders} output "
                                 f"folders (cap {self.max_folders_per_run})", life)
                    continue
                self._watched[key] = _Watched(run_id, path, owner_uid, life)
            else:
                pending = self._pending.setdefault(path, _Pending(run_id, path, time.time(),
                                                                  incarnation=life))
                pending.trusted = True
                pending.run_id, pending.incarnation = run_id, life  # the reporter's life

    def _forget_expired(self) -> None:
        """Stop watching folders of runs the registry no longer knows."""
        known = getattr(self.sink, "run", None)
        if not callable(known):
            return
        for key, watched in list(self._watched.items()):
            if known(watched.run_id) is None:
                if watched.watch is not None:
                    self._observer.unschedule(watched.watch)
                del self._watched[key]
                for path in [p for p in self._done if p.parent == watched.folder]:
                    del self._done[path]

    def _scan(self) -> None:
        self._forget_expired()
        watches = sum(1 for w in self._watched.values() if w.watch is not None)
        for watched in self._watched.values():
            folder = watched.folder
            if self._outside(folder) is not None:  # a symlink swapped in since registration
                continue
            if folder.is_dir() and not watched.owner_checked:
                foreign = self._foreign(watched.run_id, folder, files=False)
                if foreign is not None:  # not listed, not watched: another uid's folder
                    if not watched.refused:
                        watched.refused = True
                        self._refuse(watched.run_id, folder, foreign, watched.incarnation)
                    continue
                watched.owner_checked = True
            if watched.watch is None and folder.is_dir() and watches < self.max_watches:
                try:  # not recursive: new checkpoint folders wake us, their files are polled
                    watched.watch = self._observer.schedule(self._handler, str(folder),
                                                            recursive=False)
                    watches += 1
                except OSError as err:
                    log.warning("watch_failed", folder=str(folder), error=str(err))
            if not folder.is_dir():
                continue
            for child in folder.iterdir():
                if not CHECKPOINT_DIR.match(child.name) or not child.is_dir():
                    continue
                signature = _signature(child)
                if watched.seen.get(child.name) == signature:
                    continue
                watched.seen[child.name] = signature
                self._pending.setdefault(child, _Pending(watched.run_id, child, time.time(),
                                                         incarnation=watched.incarnation))

    def _settle(self) -> None:
        now = time.time()
        for path, pending in list(self._pending.items()):
            signature = _signature(path)
            if signature != pending.signature:
                pending.signature, pending.stable_since = signature, now
            complete = pending.trusted or (
                signature and now - pending.stable_since >= self.settle_seconds
            )
            if not complete:
                if now - pending.since > PENDING_TIMEOUT_SECONDS:
                    del self._pending[path]
                    log.warning("checkpoint_never_completed", path=str(path))
                continue
            del self._pending[path]
            if self._done.get(path) == signature:
                continue  # these exact files were inspected already
            self._done[path] = signature
            self._inspect(pending)

    def _inspect(self, pending: _Pending) -> None:
        life = pending.incarnation
        outside = self._outside(pending.path)
        if outside is not None:
            self._refuse(pending.run_id, pending.path, outside, life)
            return
        foreign = self._foreign(pending.run_id, pending.path)
        if foreign is not None:
            self._refuse(pending.run_id, pending.path, foreign, life)
            return
        escape = access.leaves_folder(pending.path)
        if escape is not None:
            log.warning("checkpoint_skipped", run_id=pending.run_id, path=str(pending.path),
                        reason=escape)
            return
        target = adapter_folder(pending.path, self._active_adapter(pending.run_id))
        if target != pending.path:  # the named adapter's own subfolder: the same checks
            foreign = self._foreign(pending.run_id, target)
            if foreign is not None:
                self._refuse(pending.run_id, target, foreign, life)
                return
            escape = access.leaves_folder(target)
            if escape is not None:
                log.warning("checkpoint_skipped", run_id=pending.run_id, path=str(target),
                            reason=escape)
                return
        try:
            inspection = inspect_path(target)
            if target != pending.path:  # it stands for the checkpoint the run reported
                inspection = replace(inspection, path=str(pending.path))
        except CheckpointRefused as err:
            self._refuse(pending.run_id, pending.path, str(err), life)
            return
        except (NotACheckpoint, OSError) as err:
            log.warning("checkpoint_not_inspected", path=str(pending.path), error=str(err))
            return
        self.inspected += 1
        for watched in self._watched.values():
            if watched.run_id == pending.run_id and pending.path.parent == watched.folder:
                watched.seen[pending.path.name] = _signature(pending.path)
        log.info("checkpoint_inspected", run_id=pending.run_id, path=str(pending.path),
                 digest=inspection.adapter_digest, bytes=inspection.tensor_bytes)
        self.sink.record_inspection(pending.run_id, inspection, _step(pending.path), life)
