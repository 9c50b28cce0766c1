"""The sidecar's own page path when on-call silences a root cause (``deadweight silence``).

A real registry, store, action sink and on-call handler are fed a frozen run (an optimizer
built empty, frozen weights, two byte-identical checkpoints); a recording pager stands in for
Alertmanager. A silenced cause keeps inhibiting its symptoms while it fires: their pages are
held (journaled ``silenced`` by the cause), resolved when the silence begins after they went
out, and sent once nothing holds them any more: the cause cleared, or the last silence ended.
"""

from __future__ import annotations

import time

from deadweight.proto import pb
from deadweight.sidecar.actions.policy import Actions
from deadweight.sidecar.ingest.oncall import Oncall
from deadweight.sidecar.model.process import ProcessIdentity
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.support.raw_client import checkpoint_event, frozen_events, healthy_events, run_start
from tests.unit.test_store import RecordingPager

CAUSES = ("empty_optimizer", "frozen_weights")
SYMPTOM = "checkpoint_unchanged"  # inhibited by both causes
OPERATOR = ProcessIdentity(4242, 0, 0, 1, "boot")


class Run:
    """One run "r" on a registry with the real action sink."""

    def __init__(self) -> None:
        self.pager = RecordingPager()
        self.store = Store()
        self.actions = Actions(pager=self.pager, store=self.store)
        self.registry = Registry(self.actions, store=self.store)
        self.oncall = Oncall(self.registry, self.actions, attestor=None)
        self.seq = 1

    def feed(self, events: list[pb.Event]) -> None:
        answer = self.registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=events))
        assert not answer.error, answer.error

    def frozen(self) -> None:
        """The run starts with an empty optimizer; six frozen steps with two identical
        checkpoints: both causes and the symptom fire."""
        self.feed([pb.Event(seq=0, run_start=run_start())])
        for step in range(1, 7):
            self.feed(frozen_events(step, self.seq))
            self.seq += 2
            if step in (2, 4):
                self.feed([checkpoint_event(step, self.seq, "same")])
                self.seq += 1
        assert {d for d, f in self.registry.findings("r").items() if f.firing} == {
            *CAUSES, SYMPTOM}

    def moving(self) -> None:
        """The weights move again: frozen_weights clears (the latched start fact and the
        checkpoint verdict stay)."""
        for step in range(7, 12):
            self.feed(healthy_events(step, self.seq))
            self.seq += 2
        assert not self.registry.findings("r")["frozen_weights"].firing

    def silence(self, detector: str, seconds: float) -> None:
        self.oncall.silence(pb.SilenceRequest(run_id="r", detector=detector, seconds=seconds),
                            OPERATOR)

    def paged(self) -> list[str]:
        return [detector for _, detector, _ in self.pager.fired]

    def pages(self, detector: str) -> list[tuple[str, dict[str, object]]]:
        return [(a.result, a.detail) for a in self.store.actions("r", detector)
                if a.action == "page"]


def test_symptoms_of_a_silenced_cause_are_held_until_nothing_holds_them() -> None:
    run = Run()
    for cause in CAUSES:
        run.silence(cause, 600)
    run.frozen()
    assert run.paged() == []
    [(result, detail)] = run.pages(SYMPTOM)
    assert result == "silenced" and detail["by"] in CAUSES

    # frozen_weights clears; the symptom is still held by the other silenced cause.
    run.moving()
    assert run.paged() == []
    # The last silence ends: the cause pages, and so does the symptom nothing holds now
    # (Alertmanager inhibits it behind the cause; a webhook gets its one message).
    run.silence("empty_optimizer", 0.01)
    assert run.oncall.expire(now=time.time() + 1) == 1
    assert run.paged() == ["empty_optimizer", SYMPTOM]
    assert [r for r, _ in run.pages(SYMPTOM)] == ["silenced", "queued"]


def test_a_silenced_cause_that_clears_lets_its_symptom_page() -> None:
    run = Run()
    run.silence("frozen_weights", 600)
    run.silence("empty_optimizer", 600)
    run.frozen()
    run.silence("empty_optimizer", 0.01)
    run.oncall.expire(now=time.time() + 1)  # empty_optimizer pages; frozen_weights holds on
    assert run.paged() == ["empty_optimizer"]
    run.moving()  # the silenced cause clears while the symptom still fires: it pages now
    assert run.paged() == ["empty_optimizer", SYMPTOM]
    # A symptom silenced itself stays quiet however its causes fare (the control).
    other = Run()
    for detector in (*CAUSES, SYMPTOM):
        other.silence(detector, 600)
    other.frozen()
    other.moving()
    assert other.paged() == []


def test_silencing_the_causes_resolves_the_symptom_page_already_out() -> None:
    run = Run()
    run.frozen()
    assert sorted(run.paged()) == sorted([*CAUSES, SYMPTOM])
    run.silence("frozen_weights", 600)
    # The silenced cause's page resolves, and so does its symptom's (the rules leave the
    # symptom out too while a silenced cause of it fires); the other cause pages on.
    assert run.pager.resolved == [("r", "frozen_weights"), ("r", SYMPTOM)]
    # The silence ends: both pages are asserted again (same incidents, no new page).
    run.silence("frozen_weights", 0.01)
    run.oncall.expire(now=time.time() + 1)
    assert [r for r, _ in run.pages(SYMPTOM)] == ["queued", "reasserted"]
    assert [r for r, _ in run.pages("frozen_weights")] == ["queued", "reasserted"]


def test_silencing_the_first_cause_alone_quiets_the_frozen_weights_it_causes() -> None:
    # empty_optimizer -> frozen_weights -> checkpoint_unchanged (``symptom_of``): on-call
    # silenced the cause alone, and nothing of the chain pages while it fires.
    run = Run()
    run.silence("empty_optimizer", 600)
    run.frozen()
    assert run.paged() == []
    for symptom in ("frozen_weights", SYMPTOM):
        [(result, detail)] = run.pages(symptom)
        assert result == "silenced" and detail["by"] == "empty_optimizer", symptom
    # The control: nothing silenced, the same run pages all three (Alertmanager inhibits
    # the symptoms behind the cause; the sidecar's own page path sends each once).
    control = Run()
    control.frozen()
    assert sorted(control.paged()) == sorted([*CAUSES, SYMPTOM])
