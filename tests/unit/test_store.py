"""The state store: what a restarted sidecar reads back, and how the registry resumes from it."""

from __future__ import annotations

import os
from pathlib import Path

from deadweight.proto import pb
from deadweight.sidecar.actions.policy import Actions
from deadweight.sidecar.detectors.base import Policy
from deadweight.sidecar.model.process import ProcessIdentity, boot_id
from deadweight.sidecar.model.run_state import CheckpointPoint
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.files import DB_NAME
from deadweight.sidecar.store.journal import Store
from tests.support.raw_client import checkpoint_event, frozen_events, healthy_events, run_start


class RecordingPager:
    """Keeps what it was asked to page (a stand-in for the Alertmanager pusher)."""

    def __init__(self) -> None:
        self.fired: list[tuple[str, str, float | None]] = []
        self.resolved: list[tuple[str, str]] = []

    def fire(self, run_id: str, detector: str, severity: str, summary: str,
             description: str, evidence: dict[str, str],
             starts_at: float | None = None, on_result: object = None,
             reassert: bool = False) -> None:
        self.fired.append((run_id, detector, starts_at))

    def resolve(self, run_id: str, detector: str, severity: str) -> None:
        self.resolved.append((run_id, detector))


def test_everything_survives_a_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    assert (tmp_path / "state" / DB_NAME).exists()
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    start = run_start(attestation="secret-nonce")
    store.upsert_run("r1", "SFTTrainer", start)
    store.upsert_run("r2", "GRPOTrainer", start)
    store.end_run("r2", "completed", at=100.0)
    identity = ProcessIdentity(1234, 1000, 1000, 98765, boot_id())
    store.bind("r1", 0, identity)
    point = CheckpointPoint(3, "/out/checkpoint-3", "abc", {"lora_A": "abc"}, 4096, 50.0)
    store.add_checkpoint("r1", point)
    store.open_incident("r1", "frozen_weights", 1, "critical", "kill", 5, "frozen",
                        {"update_norm": "0"}, 60.0, enforce=True)
    store.open_incident("r1", "empty_optimizer", 1, "critical", "page", 0, "empty", {}, 55.0,
                        enforce=False)
    store.resolve_incident("r1", "empty_optimizer", 1, at=70.0)
    pending = store.add_action("r1", "SFTTrainer", "frozen_weights", 1, "sigterm", "pending",
                               rank=0, pid=1234, detail={"step": 9})
    store.close()

    again = Store(tmp_path / "state")
    runs = {r.run_id: r for r in again.runs(ended_since=0.0)}
    assert runs["r1"].start is not None and not runs["r1"].ended
    assert runs["r1"].start.attestation == ""  # a redeemed nonce is not kept
    assert runs["r1"].start.config["learning_rate"] == 1e-4
    assert runs["r2"].ended and runs["r2"].end_reason == "completed"
    assert [r.run_id for r in again.runs(ended_since=101.0)] == ["r1"]
    assert again.bindings("r1") == {0: identity}
    assert again.checkpoints("r1") == [point]
    incidents = {i.detector: i for i in again.incidents("r1")}
    assert incidents["frozen_weights"].resolved_at is None
    assert incidents["empty_optimizer"].resolved_at == 70.0
    assert [i.detector for i in again.open_enforcements()] == ["frozen_weights"]
    (row,) = again.actions("r1")
    assert (row.id, row.action, row.result, row.rank, row.pid, row.detail) == (
        pending, "sigterm", "pending", 0, 1234, {"step": 9})
    assert again.has_action("r1", "frozen_weights", 1, "sigterm")
    assert not again.has_action("r1", "frozen_weights", 2, "sigterm")
    again.close_enforcement("r1", "frozen_weights", 1, "killed")
    assert again.open_enforcements() == []
    assert again.prune(ended_before=100.0) == 0  # r2 ended at 100.0: not before
    again.add_step_history("r2", [(1, 1.0, pb.StepReport(step=1).SerializeToString())])
    assert again.history("r2", "step")
    assert again.prune(ended_before=100.5) == 1
    assert again.history("r2", "step") == []  # its steps went with it
    assert [r.run_id for r in again.runs()] == ["r1"]  # a live run is never pruned
    assert again.bindings("r1") and again.actions("r1")
    assert oct(os.stat(tmp_path / "state").st_mode & 0o777) == "0o700"


def _sidecar(state: Path, pager: RecordingPager) -> tuple[Registry, Actions]:
    store = Store(state)
    actions = Actions(pager=pager, store=store)
    registry = Registry(actions, policies={"frozen_weights": Policy.STOP}, store=store)
    return registry, actions


def _feed(registry: Registry, events: list[pb.Event]) -> pb.StreamResponse:
    return registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=events))


def test_registry_resumes_without_repeating_an_action(tmp_path: Path) -> None:
    pager = RecordingPager()
    registry, actions = _sidecar(tmp_path, pager)
    _feed(registry, [pb.Event(seq=0, run_start=run_start())])
    directives = []
    for step in range(1, 5):
        directives += _feed(registry, frozen_events(step, 2 * step - 1)).directives
    _feed(registry, [checkpoint_event(4, 9, "digest-4")])
    assert [d.action for d in directives] == [pb.Directive.ACTION_STOP]
    fired_at = registry.findings("r")["frozen_weights"].fired_at
    assert ("r", "frozen_weights", fired_at) in pager.fired
    actions.store.close()  # the sidecar dies here

    pager2 = RecordingPager()
    registry2, actions2 = _sidecar(tmp_path, pager2)
    assert registry2.resume() == 1
    finding = registry2.findings("r")["frozen_weights"]
    assert finding.firing and finding.incidents == 1 and finding.fired_at == fired_at
    run = registry2.run("r")
    assert run is not None and [c.combined_digest for c in run.checkpoints] == ["digest-4"]
    # Re-asserted with the original start time: the same alert, not a new page.
    assert ("r", "frozen_weights", fired_at) in pager2.fired
    # The client reconnects: STOP is delivered again, and a few fresh frozen steps change
    # nothing (too few to re-fire, and the incident is still the same one).
    again = _feed(registry2, [pb.Event(seq=0, run_start=run_start())]).directives
    assert [d.action for d in again] == [pb.Directive.ACTION_STOP]
    for step in range(5, 7):
        assert not _feed(registry2, frozen_events(step, 2 * step - 1)).directives
    assert registry2.findings("r")["frozen_weights"].firing
    journal = [(a.action, a.result) for a in actions2.store.actions("r", "frozen_weights")]
    assert journal == [("page", "queued"), ("stop", "sent"),
                       ("page", "reasserted"), ("stop", "requeued")]

    # Healthy steps: held until enough fresh steps say so, then resolved.
    for step in range(7, 7 + registry2.resume_hold_steps):
        _feed(registry2, healthy_events(step, 2 * step - 1))
    assert not registry2.findings("r")["frozen_weights"].firing
    assert pager2.resolved == [("r", "frozen_weights")]
    (incident,) = [i for i in actions2.store.incidents("r") if i.detector == "frozen_weights"]
    assert incident.resolved_at is not None


def test_a_restored_finding_re_confirmed_is_still_one_incident(tmp_path: Path) -> None:
    pager = RecordingPager()
    registry, actions = _sidecar(tmp_path, pager)
    _feed(registry, [pb.Event(seq=0, run_start=run_start())])
    for step in range(1, 5):
        _feed(registry, frozen_events(step, 2 * step - 1))
    actions.store.close()

    registry2, actions2 = _sidecar(tmp_path, RecordingPager())
    registry2.resume()
    for step in range(5, 20):
        _feed(registry2, frozen_events(step, 2 * step - 1))
    assert registry2.findings("r")["frozen_weights"].incidents == 1
    pages = [a for a in actions2.store.actions("r", "frozen_weights") if a.action == "page"]
    assert [a.result for a in pages] == ["queued", "reasserted"]


def test_a_run_id_used_again_gets_a_new_incident_and_a_new_page(tmp_path: Path) -> None:
    pager = RecordingPager()
    store = Store(tmp_path)
    registry = Registry(Actions(pager=pager, store=store), store=store, ended_ttl_seconds=0.0)
    for attempt in (1, 2):
        _feed(registry, [pb.Event(seq=0, run_start=run_start())])
        for step in range(1, 5):
            _feed(registry, frozen_events(step, 2 * step - 1))
        _feed(registry, [pb.Event(seq=9, run_end=pb.RunEnd(step=4, reason="completed"))])
        registry.tick(now=registry_end(registry) + 1.0)  # the ended run leaves memory
        assert registry.run("r") is None, attempt
    assert [i.incident for i in store.incidents("r") if i.detector == "frozen_weights"] == [1, 2]
    pages = [(a.incident, a.result) for a in store.actions("r", "frozen_weights")]
    assert pages == [(1, "queued"), (2, "queued")]
    assert [f[1] for f in pager.fired].count("frozen_weights") == 2


def registry_end(registry: Registry) -> float:
    run = registry.run("r")
    assert run is not None and run.ended
    return run.ended_at


def test_a_state_file_of_the_older_layout_is_migrated_to_incarnation_1(tmp_path: Path) -> None:
    """A journal written before rows carried their incarnation opens; what it held is
    incarnation 1 (bindings rekeyed, incidents and actions given the column)."""
    import sqlite3


    tmp_path.chmod(0o700)
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.executescript("""
CREATE TABLE bindings (
    run_id TEXT NOT NULL, rank INTEGER NOT NULL, pid INTEGER NOT NULL, uid INTEGER NOT NULL,
    gid INTEGER NOT NULL, start_time INTEGER NOT NULL, boot_id TEXT NOT NULL,
    bound_at REAL NOT NULL, PRIMARY KEY (run_id, rank));
INSERT INTO bindings VALUES ('old', 0, 42, 7, 7, 1234, 'boot', 1.0);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, trainer TEXT NOT NULL, start BLOB, created REAL NOT NULL,
    ended INTEGER NOT NULL DEFAULT 0, end_reason TEXT NOT NULL DEFAULT '', ended_at REAL);
INSERT INTO runs VALUES ('old', 'SFTTrainer', NULL, 1.0, 0, '', NULL);
""")
    (tmp_path / DB_NAME).chmod(0o600)
    store = Store(tmp_path)
    try:
        assert store.bindings("old", 1) == {0: ProcessIdentity(42, 7, 7, 1234, "boot")}
        assert store.bindings("old") == store.bindings("old", 1)
        assert store.bindings("old", 2) == {}
        assert [r.incarnation for r in store.runs()] == [1]
        assert store.last_incarnation("old") == 1
    finally:
        store.close()


def test_a_state_file_keyed_by_run_id_alone_is_rekeyed_and_a_second_life_stays_apart(
    tmp_path: Path,
) -> None:
    """The layout of the sidecar before this one (runs, checkpoints and history keyed by run
    id alone) opens with its rows as incarnation 1; a second incarnation's steps 1.. then
    neither replace nor join them, and each life's checkpoints and actions stay its own."""
    import sqlite3

    tmp_path.chmod(0o700)
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.executescript("""
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, trainer TEXT NOT NULL, start BLOB, created REAL NOT NULL,
    ended INTEGER NOT NULL DEFAULT 0, end_reason TEXT NOT NULL DEFAULT '', ended_at REAL,
    incarnation INTEGER NOT NULL DEFAULT 1);
INSERT INTO runs VALUES ('old', 'SFTTrainer', NULL, 1.0, 1, 'completed', 2.0, 1);
CREATE TABLE checkpoints (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL, digest TEXT NOT NULL,
    tensors TEXT NOT NULL, bytes INTEGER NOT NULL, time REAL NOT NULL);
CREATE INDEX checkpoints_run ON checkpoints (run_id, time);
INSERT INTO checkpoints VALUES ('old', 4, '/out/old-4', 'aaa', '{}', 64, 1.5);
CREATE TABLE history (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, step INTEGER NOT NULL, time REAL NOT NULL,
    series TEXT NOT NULL, PRIMARY KEY (run_id, kind, step));
INSERT INTO history VALUES ('old', 'log', 1, 1.1, '{"loss": 9.0}');
CREATE TABLE step_batches (
    run_id TEXT NOT NULL, first_step INTEGER NOT NULL, steps INTEGER NOT NULL,
    packed BLOB NOT NULL, PRIMARY KEY (run_id, first_step));
""")
    (tmp_path / DB_NAME).chmod(0o600)
    store = Store(tmp_path)
    try:
        store.add_step_history("old", [(1, 1.2, '{"update_norm": 0.0}')])  # incarnation 1
        assert [(r.incarnation, r.ended) for r in store.runs()] == [(1, True)]
        store.upsert_run("old", "DPOTrainer", run_start(), incarnation=2)  # used again
        store.add_step_history("old", [(1, 3.0, '{"update_norm": 5.0}')], incarnation=2)
        store.add_logs("old", [(1, 3.1, {"loss": 1.0})], incarnation=2)
        store.add_checkpoint("old", CheckpointPoint(4, "/out/new-4", "bbb", {}, 64, 3.5), 2)
        store.add_action("old", "DPOTrainer", "frozen_weights", 2, "page", "sent",
                         incarnation=2)
        assert store.history("old", "step", 1) == [(1, 1.2, {"update_norm": 0.0})]
        assert store.history("old", "log", 1) == [(1, 1.1, {"loss": 9.0})]
        assert store.history("old", "step") == [(1, 3.0, {"update_norm": 5.0})]  # the newest
        assert store.history("old", "log") == [(1, 3.1, {"loss": 1.0})]
        assert [c.path for c in store.checkpoints("old", 1)] == ["/out/old-4"]
        assert [c.path for c in store.checkpoints("old")] == ["/out/new-4"]
        assert store.actions("old", incarnation=1) == []
        assert [a.incident for a in store.actions("old", incarnation=2)] == [2]
        assert [(r.incarnation, r.trainer) for r in store.runs()] == [
            (1, "SFTTrainer"), (2, "DPOTrainer")]
        assert [r.incarnation for r in store.runs(newest=True)] == [2]
        assert store.run("old") is not None and store.run("old").incarnation == 2
        assert store.run("old", 1) is not None and store.run("old", 1).trainer == "SFTTrainer"
        assert store.incarnations("old") == [1, 2]
        # Pruning the first life leaves the second whole.
        assert store.prune(ended_before=2.5) == 1
        assert store.incarnations("old") == [2] and store.history("old", "step", 1) == []
        assert [c.path for c in store.checkpoints("old", 2)] == ["/out/new-4"]
    finally:
        store.close()
    reopened = Store(tmp_path)  # the rekeyed file opens as it is
    try:
        assert reopened.history("old", "log", 2) == [(1, 3.1, {"loss": 1.0})]
    finally:
        reopened.close()
