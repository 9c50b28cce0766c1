"""Verdict states after a run ends: firing, resolved (cleared while live), firing at end.

A registry with a real store and the real action sink is fed wire events; status, the report's
data, /metrics and the page path must all read the same state. A run's end never resolves a
verdict; its expiry from memory resolves the page, and the journal keeps "firing at end".
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from pathlib import Path

from deadweight.proto import pb
from deadweight.sidecar.actions.policy import Actions
from deadweight.sidecar.commands import report, status
from deadweight.sidecar.detectors import ALL, BY_ID
from deadweight.sidecar.detectors.base import Detector, Policy, Severity, SpecDetector, Verdict
from deadweight.sidecar.detectors.spec import root_causes_first
from deadweight.sidecar.exposition.collector import DeadweightCollector
from deadweight.sidecar.model.run_state import RunState
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.files import DB_NAME
from deadweight.sidecar.store.journal import Store
from tests.support.raw_client import checkpoint_event, frozen_events, healthy_events, run_start
from tests.unit.test_store import RecordingPager

TTL = 60.0


def _sidecar(state: Path, pager: RecordingPager,
             policies: dict[str, Policy] | None = None) -> tuple[Registry, Actions]:
    store = Store(state)
    actions = Actions(pager=pager, store=store)
    return Registry(actions, store=store, ended_ttl_seconds=TTL, policies=policies), actions


def _feed(registry: Registry, events: list[pb.Event], run_id: str = "r") -> None:
    answer = registry.ingest(pb.StreamRequest(run_id=run_id, rank=0, events=events))
    assert not answer.error, answer.error


def _frozen_run(registry: Registry, steps: int = 6, run_id: str = "r") -> int:
    """A run whose weights never move; returns the next seq."""
    _feed(registry, [pb.Event(seq=0, run_start=run_start())], run_id)
    for step in range(1, steps + 1):
        _feed(registry, frozen_events(step, 2 * step - 1), run_id)
    return 2 * steps + 1


def _end(registry: Registry, seq: int, run_id: str = "r") -> None:
    _feed(registry, [pb.Event(seq=seq, run_end=pb.RunEnd(step=6, reason="completed"))], run_id)


def _finding(registry: Registry, detector: str, run_id: str = "r") -> pb.Finding:
    [run] = registry.status(run_id).runs
    return next(f for f in run.findings if f.detector == detector)


def _firing_metric(registry: Registry, actions: Actions, detector: str) -> tuple[float, float]:
    """(deadweight_detector_firing, deadweight_run_active) of run r, from the collector."""
    values = {}
    for family in DeadweightCollector(registry, actions, tuple(ALL)).collect():
        for sample in family.samples:
            if sample.labels.get("run_id") != "r":
                continue
            if sample.name == "deadweight_detector_firing" and \
                    sample.labels["detector"] == detector:
                values["firing"] = sample.value
            if sample.name == "deadweight_run_active":
                values["active"] = sample.value
    return values["firing"], values["active"]


def test_a_run_that_ends_firing_reads_firing_at_end_everywhere(tmp_path: Path) -> None:
    pager = RecordingPager()
    registry, actions = _sidecar(tmp_path, pager)
    seq = _frozen_run(registry)
    live = _finding(registry, "frozen_weights")
    assert live.state == "firing" and live.evidence_at_firing["frozen_steps"] == "3"
    _end(registry, seq)

    # Status: still firing, as "firing at end", with the evidence at firing and the latest.
    finding = _finding(registry, "frozen_weights")
    assert finding.firing and finding.state == "firing at end"
    assert finding.evidence_at_firing["frozen_steps"] == "3"
    assert finding.evidence["frozen_steps"] == "6"
    text = status.render(registry.status())
    # The root cause (an optimizer built empty, from run_start) leads its symptom.
    assert "ended (completed); FIRING AT END empty_optimizer,frozen_weights" in text
    assert "  FIRING AT END frozen_weights [critical" in text
    assert "frozen_steps = 3 (latest 6)" in text
    assert "resolved" not in text
    # /metrics and the rules see it: firing 1 on an ended run; the page was not resolved.
    assert _firing_metric(registry, actions, "frozen_weights") == (1.0, 0.0)
    assert ("r", "frozen_weights") not in pager.resolved
    # The report's data: the incident stayed open, its state and evidence as status shows.
    record = report.load(registry.store, "r")
    [incident] = [i for i in record.incidents if i.detector == "frozen_weights"]
    assert incident.resolved_at is None
    assert report.incident_state(record, incident) == "firing at end"
    assert incident.evidence == dict(finding.evidence_at_firing)
    assert incident.latest_evidence == dict(finding.evidence)
    assert "frozen_steps=3 (latest 6)" in report.evidence_text(incident)

    # Expiry from the sidecar's memory resolves the page; the journal still says it stood.
    registry.tick(now=time.time() + TTL + 1)
    assert registry.runs() == []
    assert ("r", "frozen_weights") in pager.resolved
    record = report.load(registry.store, "r")
    [incident] = [i for i in record.incidents if i.detector == "frozen_weights"]
    assert report.incident_state(record, incident) == "firing at end"


def test_a_verdict_that_cleared_while_live_reads_resolved(tmp_path: Path) -> None:
    pager = RecordingPager()
    registry, actions = _sidecar(tmp_path, pager)
    seq = _frozen_run(registry, steps=3)
    for step in range(4, 8):  # the weights move again: recovered while live
        _feed(registry, healthy_events(step, seq))
        seq += 2
    assert pager.resolved == [("r", "frozen_weights")]
    _end(registry, seq)
    finding = _finding(registry, "frozen_weights")
    assert not finding.firing and finding.state == "resolved"
    assert _firing_metric(registry, actions, "frozen_weights") == (0.0, 0.0)
    record = report.load(registry.store, "r")
    [incident] = [i for i in record.incidents if i.detector == "frozen_weights"]
    assert report.incident_state(record, incident) == "resolved"
    # The latest evidence is the one at resolution: status and report agree on it.
    assert incident.latest_evidence == dict(finding.evidence)
    assert incident.evidence == dict(finding.evidence_at_firing)
    assert pager.resolved == [("r", "frozen_weights")]  # not again at the end
    # The empty optimizer (latched: a start fact) never cleared: it stood at the end.
    assert _finding(registry, "empty_optimizer").state == "firing at end"
    registry.tick(now=time.time() + TTL + 1)
    assert pager.resolved == [("r", "frozen_weights"), ("r", "empty_optimizer")]


def test_a_restarted_sidecar_reads_back_firing_at_end_and_keeps_the_page(
        tmp_path: Path) -> None:
    stop = {"frozen_weights": Policy.STOP}
    pager = RecordingPager()
    registry, actions = _sidecar(tmp_path, pager, stop)
    _end(registry, _frozen_run(registry))
    actions.store.close()  # the sidecar dies after the run ended

    pager2 = RecordingPager()
    registry2, actions2 = _sidecar(tmp_path, pager2, stop)
    assert registry2.resume() == 1
    finding = _finding(registry2, "frozen_weights")
    assert finding.state == "firing at end"
    assert finding.evidence_at_firing["frozen_steps"] == "3"
    assert finding.evidence["frozen_steps"] == "6"
    # The page is held again (same start time, no new page journaled) until the run expires.
    assert sorted(f[:2] for f in pager2.fired) == [("r", "empty_optimizer"),
                                                   ("r", "frozen_weights")]
    journal = [(a.action, a.result) for a in actions2.store.actions("r", "frozen_weights")]
    # Only the page: STOP is not queued again for a run that has ended.
    assert journal == [("page", "queued"), ("stop", "sent"), ("page", "reasserted")]
    registry2.tick(now=time.time() + TTL + 1)
    assert sorted(pager2.resolved) == [("r", "empty_optimizer"), ("r", "frozen_weights")]


def _healthy_start() -> pb.RunStart:
    start = run_start()
    start.membership.optimizer_params = start.membership.optimizer_tensors = 4
    start.membership.trainable_params = start.membership.adapter_params
    return start


def test_a_run_restarted_healthy_under_its_id_resolves_the_old_page(tmp_path: Path) -> None:
    pager = RecordingPager()
    registry, _ = _sidecar(tmp_path, pager)
    _end(registry, _frozen_run(registry))
    _feed(registry, [pb.Event(seq=0, run_start=_healthy_start())])  # a new incarnation
    assert pager.resolved == []  # not yet: a restart alone proves nothing
    for step in range(1, registry.resume_hold_steps):
        _feed(registry, healthy_events(step, 2 * step - 1))
    assert pager.resolved == []
    step = registry.resume_hold_steps
    _feed(registry, healthy_events(step, 2 * step - 1))  # enough healthy steps
    assert sorted(pager.resolved) == [("r", "empty_optimizer"), ("r", "frozen_weights")]
    [run] = registry.status().runs
    assert not run.ended and not [f for f in run.findings if f.firing]


def test_a_run_restarted_still_frozen_keeps_its_one_page(tmp_path: Path) -> None:
    pager = RecordingPager()
    registry, _ = _sidecar(tmp_path, pager)
    _end(registry, _frozen_run(registry))
    _frozen_run(registry)  # the same mistake again under the same id
    assert pager.resolved == []  # never resolved in between: Alertmanager sees one alert
    assert _finding(registry, "frozen_weights").state == "firing"
    incidents = [i.incident for i in registry.store.incidents("r")
                 if i.detector == "frozen_weights"]
    assert incidents == [1, 2]  # journaled as the new incarnation's own incident
    _end(registry, 13)
    registry.tick(now=time.time() + TTL + 1)  # expiry resolves it, once
    assert sorted(pager.resolved) == [("r", "empty_optimizer"), ("r", "frozen_weights")]


def test_root_causes_come_before_their_symptoms() -> None:
    # One order for every list (the causal graph; tests/unit/test_cause_order.py pins it):
    # what was set up wrong, then what the steps show, the frozen weights, what the run wrote;
    # information that causes none of them (no_kl_anchor) after what is wrong.
    ids = ["checkpoint_unchanged", "no_kl_anchor", "frozen_weights", "empty_optimizer"]
    assert root_causes_first(ids) == [
        "empty_optimizer", "frozen_weights", "checkpoint_unchanged", "no_kl_anchor"]
    # A cause leads even when the link between them (frozen_weights) is not in the list.
    assert root_causes_first(["adapter_never_trained", "empty_optimizer"]) == [
        "empty_optimizer", "adapter_never_trained"]
    assert root_causes_first([]) == []


def test_status_and_report_list_the_root_cause_first(tmp_path: Path) -> None:
    registry, _ = _sidecar(tmp_path, RecordingPager())
    seq = _frozen_run(registry, steps=4)
    _feed(registry, [checkpoint_event(2, seq, "same"), checkpoint_event(4, seq + 1, "same")])
    _end(registry, seq + 2)
    [run] = registry.status().runs
    order = [f.detector for f in run.findings]
    assert "checkpoint_unchanged" in order, order
    assert order.index("frozen_weights") < order.index("checkpoint_unchanged")
    assert "FIRING AT END empty_optimizer,frozen_weights,checkpoint_unchanged" in \
        status.render(registry.status())
    record = report.load(registry.store, "r")
    listed = [i.detector for i in report.verdicts_of(record)]
    assert listed.index("frozen_weights") < listed.index("checkpoint_unchanged")
    top = report.headline(record)
    sentence = " ".join(i.detector for i in [top.root, *top.others] if i is not None)
    assert sentence.index("frozen_weights") < sentence.index("checkpoint_unchanged"), sentence


def test_a_journal_from_before_the_latest_evidence_column_opens(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute(
        "CREATE TABLE incidents (run_id TEXT NOT NULL, detector TEXT NOT NULL, incident "
        "INTEGER NOT NULL, severity TEXT NOT NULL, policy TEXT NOT NULL, step INTEGER NOT "
        "NULL, summary TEXT NOT NULL, evidence TEXT NOT NULL, fired_at REAL NOT NULL, "
        "resolved_at REAL, enforcement TEXT NOT NULL DEFAULT 'none', "
        "PRIMARY KEY (run_id, detector, incident))")
    db.execute("INSERT INTO incidents VALUES ('old', 'frozen_weights', 1, 'critical', 'page', "
               "3, 's', '{\"frozen_steps\": \"3\"}', 1.0, NULL, 'none')")
    db.commit()
    db.close()
    store = Store(tmp_path)
    [incident] = store.incidents("old")
    assert incident.latest_evidence == {"frozen_steps": "3"} and incident.last_evidence == {}
    store.note_evidence("old", "frozen_weights", 1, {"frozen_steps": "9"})
    [incident] = store.incidents("old")
    assert incident.latest_evidence == {"frozen_steps": "9"}


class _SteppingDetector(SpecDetector):
    """Fires from step 2 at warning and steps up to critical from step 5: the shape of a
    deviation that persists (``Verdict.severity``)."""

    spec = dataclasses.replace(BY_ID["frozen_weights"].spec, id="stepping_probe")

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.step < 2:
            return Verdict(False, step=run.step)
        return Verdict(True, step=run.step, summary=f"probe at {run.step}",
                       severity=Severity.WARNING if run.step < 5 else Severity.CRITICAL)


def _severities(registry: Registry, actions: Actions, detectors: tuple[Detector, ...]
                ) -> dict[str, float]:
    return {sample.labels["severity"]: sample.value
            for family in DeadweightCollector(registry, actions, detectors).collect()
            for sample in family.samples
            if sample.name == "deadweight_detector_firing"
            and sample.labels["detector"] == "stepping_probe"}


def test_a_verdict_that_steps_up_opens_a_new_incident_at_the_higher_severity(
        tmp_path: Path) -> None:
    """The lower incident resolves (its page with it) and a new one pages at the higher
    severity; /metrics carries the verdict's severity, not the spec's; it never steps down."""
    pager = RecordingPager()
    store = Store(tmp_path)
    actions = Actions(pager=pager, store=store)
    probe = (_SteppingDetector(),)
    registry = Registry(actions, store=store, active_detectors=probe,
                        policies={"stepping_probe": Policy.PAGE})
    _feed(registry, [pb.Event(seq=0, run_start=run_start())])
    for step in range(1, 4):
        _feed(registry, frozen_events(step, 2 * step - 1))
    assert _finding(registry, "stepping_probe").severity == "warning"
    assert _severities(registry, actions, probe) == {"warning": 1.0}
    assert [d for _, d, _ in pager.fired] == ["stepping_probe"] and not pager.resolved
    for step in range(4, 7):
        _feed(registry, frozen_events(step, 2 * step - 1))
    stepped = _finding(registry, "stepping_probe")
    assert (stepped.severity, stepped.step) == ("critical", 5)
    assert _severities(registry, actions, probe) == {"critical": 1.0}
    assert [d for _, d, _ in pager.fired] == ["stepping_probe"] * 2
    assert pager.resolved == [("r", "stepping_probe")]
    rows = sqlite3.connect(tmp_path / DB_NAME).execute(
        "SELECT incident, severity, resolved_at IS NULL FROM incidents "
        "WHERE detector='stepping_probe' ORDER BY incident").fetchall()
    assert rows == [(1, "warning", 0), (2, "critical", 1)]


class _InfoFirstDetector(SpecDetector):
    """Info from step 2, a warning from step 5: a baseline deviation that persists."""

    spec = dataclasses.replace(BY_ID["baseline_loss"].spec, id="info_first_probe")

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.step < 2:
            return Verdict(False, step=run.step)
        return Verdict(True, step=run.step, summary=f"probe at {run.step}",
                       severity=Severity.INFO if run.step < 5 else None)


def test_an_info_verdict_is_shown_but_never_paged_its_warning_is(tmp_path: Path) -> None:
    """Info is worth knowing, nothing wrong by itself: under a page policy it still pages
    nobody (no page, no resolution sent); once it steps up to a warning it pages, once."""
    pager = RecordingPager()
    store = Store(tmp_path)
    actions = Actions(pager=pager, store=store)
    registry = Registry(actions, store=store, active_detectors=(_InfoFirstDetector(),),
                        policies={"info_first_probe": Policy.PAGE})
    _feed(registry, [pb.Event(seq=0, run_start=run_start())])
    for step in range(1, 4):
        _feed(registry, frozen_events(step, 2 * step - 1))
    info = _finding(registry, "info_first_probe")
    assert info.firing and info.severity == "info"
    assert pager.fired == [] and pager.resolved == []
    for step in range(4, 7):
        _feed(registry, frozen_events(step, 2 * step - 1))
    assert _finding(registry, "info_first_probe").severity == "warning"
    assert [d for _, d, _ in pager.fired] == ["info_first_probe"]
    assert pager.resolved == []  # the info stage was never paged: nothing to resolve
