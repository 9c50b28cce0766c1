"""Property-based tests of ``Registry.ingest`` over the whole wire schema (in process, fast).

Whatever a client sends, the registry answers (an ack or a clear error), never raises, keeps
every collection under its cap, and the exporter still renders a page Prometheus can parse
with bounded label values. Together with the server fuzz test these run over 10,000 cases.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deadweight.proto import pb
from deadweight.sidecar.exposition.collector import DeadweightCollector
from deadweight.sidecar.model import limits
from deadweight.sidecar.model.run_state import (
    CHECKPOINT_WINDOW,
    LOG_WINDOW,
    MAX_LOG_KEYS,
    STEP_WINDOW,
)
from deadweight.sidecar.registry import MAX_RUN_ID_LENGTH, Peer, Registry
from tests.support import wire_strategies as ws

#: Random examples every run (conftest.py draws the seed and prints it on a failure; pass
#: ``--hypothesis-seed=N`` to replay a run); a failing example also prints its
#: ``@reproduce_failure`` blob and is kept in the local example database. No deadline and no
#: too_slow check: the batches are large by design and the CI machine is a loaded two-core
#: box, so time says nothing about the code; every other health check stays on.
FUZZ = settings(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
MAX_RUNS = 4
#: Batches each shared registry below must have taken: its test ran at least this many
#: examples (hypothesis may stop early once a small search space is exhausted).
EXAMPLES_PER_REGISTRY = 100


@pytest.fixture(autouse=True, scope="module")
def _quiet_registry() -> Iterator[None]:
    """Thousands of refused batches would each print a warning; keep errors only."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    yield
    structlog.configure(**old)


def _start(run_id: str, rank: int = 0, seq: int = 0) -> pb.StreamRequest:
    start = pb.RunStart(trainer="SFTTrainer", config={"learning_rate": 1e-4})
    return pb.StreamRequest(run_id=run_id, rank=rank, events=[pb.Event(seq=seq, run_start=start)])


def _page(registry: Registry) -> str:
    collector = CollectorRegistry(auto_describe=False)
    collector.register(DeadweightCollector(registry, None, registry.detectors))
    return generate_latest(collector).decode()


class CountingRegistry(Registry):
    """The real registry, counting the batches it was handed (for the soak check)."""

    batches = 0

    def ingest(self, request: pb.StreamRequest, peer: Peer | None = None) -> pb.StreamResponse:
        self.batches += 1
        return super().ingest(request, peer)


class Cases:
    """One registry shared by a test's examples, a fresh run id per example.

    Building a registry per example would cost more than the example; ending the previous
    run lets the full registry evict it, which exercises the eviction path thousands of times.
    """

    def __init__(self) -> None:
        self.registry = CountingRegistry(max_runs=1)
        self.count = 0

    def fresh_run(self) -> str:
        if self.count:
            end = pb.Event(seq=2**63, run_end=pb.RunEnd(reason="case over"))
            self.registry.ingest(pb.StreamRequest(run_id=f"case-{self.count}", events=[end]))
        self.count += 1
        run_id = f"case-{self.count}"
        assert not self.registry.ingest(_start(run_id)).error
        return run_id


def check_bounded(registry: Registry) -> None:
    """Every per-run collection is under its cap; exported labels are short and printable."""
    runs = registry.runs()
    assert len(runs) <= registry.max_runs
    for run, _ in runs:
        assert len(run.run_id) <= MAX_RUN_ID_LENGTH
        assert len(run.ranks) <= limits.MAX_RANKS_PER_RUN
        assert len(run.log_history) <= MAX_LOG_KEYS
        assert all(len(k) <= limits.MAX_LOG_KEY_LENGTH for k in run.log_history)
        assert all(len(h) <= LOG_WINDOW for h in run.log_history.values())
        assert len(run.checkpoints) <= CHECKPOINT_WINDOW
        assert all(len(r.steps) <= STEP_WINDOW for r in run.ranks.values())
        assert len(run.trainer) <= limits.MAX_LABEL_LENGTH and run.trainer.isprintable()


def check_exported(registry: Registry) -> None:
    """The /metrics page parses and no label value is longer than the run id cap."""
    for family in text_string_to_metric_families(_page(registry)):
        for sample in family.samples:
            for value in sample.labels.values():
                assert len(value) <= MAX_RUN_ID_LENGTH, (family.name, value[:60])


class RegistryUnderFire(RuleBasedStateMachine):
    """Random batches, clock jumps and expiry against one registry, checked after each."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = Registry(max_runs=MAX_RUNS, ended_ttl_seconds=30.0)
        self.clock = time.time()

    @rule(request=ws.requests)
    def ingest(self, request: pb.StreamRequest) -> None:
        response = self.registry.ingest(request)
        assert isinstance(response, pb.StreamResponse)
        if response.error:
            assert not response.directives and response.ack_seq == 0

    @rule(request=ws.requests)
    def ingest_after_start(self, request: pb.StreamRequest) -> None:
        """Register the id first, so the hostile batch reaches a live run's state."""
        self.registry.ingest(_start(request.run_id[:MAX_RUN_ID_LENGTH] or "r", request.rank))
        self.registry.ingest(request)

    @rule(seconds=st.floats(0.0, 100.0))
    def tick(self, seconds: float) -> None:
        self.clock += seconds
        self.registry.tick(self.clock)

    @invariant()
    def bounded(self) -> None:
        check_bounded(self.registry)

    @rule()
    def exported(self) -> None:
        check_exported(self.registry)

    @invariant()
    def detectors_hold(self) -> None:
        """No detector raises on whatever state the batches left behind."""
        for run, _ in self.registry.runs():
            for detector in self.registry.detectors:
                detector.evaluate(run, self.registry.settings)


TestRegistryUnderFire = RegistryUnderFire.TestCase
TestRegistryUnderFire.settings = settings(FUZZ, max_examples=10, stateful_step_count=20)


@settings(FUZZ, max_examples=600)
@given(request=ws.requests)
def test_any_batch_gets_an_answer(request: pb.StreamRequest) -> None:
    registry = Registry(max_runs=MAX_RUNS)
    registry.ingest(_start(request.run_id[:MAX_RUN_ID_LENGTH] or "r", request.rank))
    response = registry.ingest(request)
    if not response.error:  # the ack is the highest sequence number applied (the start had 0)
        assert response.ack_seq == max((e.seq for e in request.events), default=0)
    check_bounded(registry)


OVERSIZED = {
    "run_start.trainer": lambda n: pb.Event(run_start=pb.RunStart(trainer="t" * n)),
    "run_start.output_dir": lambda n: pb.Event(run_start=pb.RunStart(output_dir="/" * n)),
    "run_start.config": lambda n: pb.Event(
        run_start=pb.RunStart(config={f"k{i}": 1.0 for i in range(n)})),
    "run_start.initial_adapter.combined": lambda n: pb.Event(
        run_start=pb.RunStart(initial_adapter=pb.AdapterDigest(combined="d" * n))),
    "log.values": lambda n: pb.Event(seq=1, log=pb.LogReport(values={"k" * n: 1.0})),
    "checkpoint.path": lambda n: pb.Event(seq=1, checkpoint=pb.CheckpointReport(path="p" * n)),
    "run_end.reason": lambda n: pb.Event(seq=1, run_end=pb.RunEnd(reason="r" * n)),
    "step.groups": lambda n: pb.Event(seq=1, step=pb.StepReport(
        step=1, groups=[pb.GroupUpdate(name="g")] * n)),
}
OVER = {
    "run_start.trainer": limits.MAX_TEXT_LENGTH,
    "run_start.output_dir": limits.MAX_TEXT_LENGTH,
    "run_start.config": limits.MAX_MAP_ENTRIES,
    "run_start.initial_adapter.combined": limits.MAX_DIGEST_LENGTH,
    "log.values": limits.MAX_LOG_KEY_LENGTH,
    "checkpoint.path": limits.MAX_TEXT_LENGTH,
    "run_end.reason": limits.MAX_TEXT_LENGTH,
    "step.groups": limits.MAX_LIST_ENTRIES,
}


CAPS = Cases()


@settings(FUZZ, max_examples=1600)
@given(field=st.sampled_from(sorted(OVERSIZED)), extra=st.integers(1, 200))
def test_a_field_over_its_cap_is_refused_by_name(field: str, extra: int) -> None:
    registry, run_id = CAPS.registry, CAPS.fresh_run()
    cap = OVER[field]
    event = OVERSIZED[field](cap + extra)
    response = registry.ingest(pb.StreamRequest(run_id=run_id, events=[event]))
    assert field in response.error and str(cap) in response.error, response.error
    assert response.ack_seq == 0
    at_cap = registry.ingest(pb.StreamRequest(run_id=run_id, events=[OVERSIZED[field](cap)]))
    assert not at_cap.error, at_cap.error  # the cap itself is allowed


UNKNOWN = Cases()


@settings(FUZZ, max_examples=1600)
@given(run_id=st.text(st.characters(categories=["L", "N", "P", "S"], include_characters=" "),
                      min_size=1,
                      max_size=MAX_RUN_ID_LENGTH),
       kinds=st.lists(st.sampled_from(["step", "log", "checkpoint", "heartbeat", "run_end"]),
                      min_size=1, max_size=4),
       seq=ws.seqs)
def test_unknown_run_id_is_refused(run_id: str, kinds: list[str], seq: int) -> None:
    registry = UNKNOWN.registry
    bodies: dict[str, Any] = {
        "step": pb.StepReport(step=1), "log": pb.LogReport(values={"loss": 1.0}),
        "checkpoint": pb.CheckpointReport(path="/c"), "heartbeat": pb.Heartbeat(),
        "run_end": pb.RunEnd(),
    }
    events = [pb.Event(seq=seq, **{kind: bodies[kind]}) for kind in kinds]
    response = registry.ingest(pb.StreamRequest(run_id=run_id, events=events))
    assert "unknown run_id" in response.error and "run_start first" in response.error
    assert registry.runs() == []


ORDER = Cases()


def _kept_steps(order: list[int]) -> tuple[list[int], int]:
    """The step rules, as a person states them: (the steps a rank keeps, how many reports
    were no newer than its newest). A negative step is refused. A step no newer than the
    newest is held back; once ``REANCHOR_REPORTS`` held reports in a row each go on from the
    one before and outnumber the kept steps at or above the first of them, those kept steps
    were an outlier: they are dropped and the held reports kept."""
    kept: list[int] = []
    behind: list[int] = []
    old = 0
    for step in order:
        if step < 0:
            continue
        if kept and step <= kept[-1]:
            old += 1
            if behind and step <= behind[-1]:
                behind = []
            behind.append(step)
            outliers = sum(1 for k in kept if k >= behind[0])
            if len(behind) >= limits.REANCHOR_REPORTS and outliers <= len(behind):
                kept = [k for k in kept if k < behind[0]] + behind
                behind = []
            continue
        behind = []
        kept.append(step)
    return kept, old


@settings(FUZZ, max_examples=4800)
@given(order=st.lists(st.integers(-5, 30), max_size=12))
def test_steps_in_any_order_follow_the_step_rules(order: list[int]) -> None:
    registry, run_id = ORDER.registry, ORDER.fresh_run()
    duplicates = registry.duplicate_events
    for seq, step in enumerate(order, start=1):
        event = pb.Event(seq=seq, step=pb.StepReport(step=step, update_sq_sum=1.0,
                                                      learning_rate=1e-4))
        assert not registry.ingest(pb.StreamRequest(run_id=run_id, events=[event])).error
    kept, old = _kept_steps(order)
    run = registry.run(run_id)
    assert run is not None
    assert [p.step for p in run.ranks[0].steps] == kept
    assert run.step == (kept[-1] if kept else 0)
    assert registry.duplicate_events - duplicates == old


NONFINITE = Cases()


@settings(FUZZ, max_examples=1200)
@given(values=st.lists(ws.doubles, min_size=14, max_size=14),
       counts=st.lists(ws.counts, min_size=6, max_size=6))
def test_nonfinite_values_everywhere_are_stored_and_exported(
    values: list[float], counts: list[int]
) -> None:
    registry, run_id = NONFINITE.registry, NONFINITE.fresh_run()
    step = pb.StepReport(step=1, learning_rate=values[0], update_sq_sum=values[1],
                         param_sq_sum=values[2], grad_sq_sum=values[3],
                         watched_tensors=counts[0], watched_params=counts[1],
                         optimizer_params=counts[2], unchanged_tensors=counts[3],
                         nonfinite_update_tensors=counts[4],
                         grad_not_in_optimizer_params=counts[5])
    log = pb.LogReport(step=1, values=dict(zip(ws.LOG_KEYS, values[4:], strict=False)))
    response = registry.ingest(pb.StreamRequest(run_id=run_id, events=[
        pb.Event(seq=1, step=step), pb.Event(seq=2, log=log)]))
    assert not response.error and response.ack_seq == 2
    run = registry.run(run_id)
    assert run is not None
    loss = run.log_value("loss")
    assert loss is not None and (loss == values[4] or math.isnan(values[4]))
    for detector in registry.detectors:
        detector.evaluate(run, registry.settings)
    page = _page(registry)  # renders (the page's syntax is parsed in the stateful test)
    if math.isnan(values[4]):
        assert f'deadweight_loss{{run_id="{run_id}",trainer="SFTTrainer"}} NaN' in page


def test_many_runs_at_once_are_capped_and_ended_runs_make_room() -> None:
    registry = Registry(max_runs=MAX_RUNS)
    for i in range(MAX_RUNS):
        assert not registry.ingest(_start(f"r{i}")).error
    refused = registry.ingest(_start("one-too-many"))
    assert f"already tracks {MAX_RUNS} live runs" in refused.error
    registry.ingest(pb.StreamRequest(run_id="r1", events=[pb.Event(seq=1, run_end=pb.RunEnd())]))
    assert not registry.ingest(_start("one-too-many")).error
    assert sorted(r.run_id for r, _ in registry.runs()) == ["one-too-many", "r0", "r2", "r3"]


def test_ranks_per_run_are_capped() -> None:
    registry = Registry()
    for rank in range(limits.MAX_RANKS_PER_RUN):
        assert not registry.ingest(_start("wide", rank=rank)).error
    refused = registry.ingest(_start("wide", rank=limits.MAX_RANKS_PER_RUN))
    assert f"{limits.MAX_RANKS_PER_RUN} ranks" in refused.error


def test_trainer_label_is_cut_and_printable() -> None:
    registry = Registry()
    start = pb.Event(run_start=pb.RunStart(trainer="Evil\n" + "x" * 3000))
    assert not registry.ingest(pb.StreamRequest(run_id="label", events=[start])).error
    run = registry.run("label")
    assert run is not None and run.trainer == "Evil?" + "x" * (limits.MAX_LABEL_LENGTH - 5)
    assert 'trainer="Evil?xxx' in _page(registry)


def test_log_keys_per_run_are_capped() -> None:
    registry = Registry()
    registry.ingest(_start("keys"))
    for batch in range(3):
        values = {f"m{batch}/{i}": 1.0 for i in range(limits.MAX_MAP_ENTRIES)}
        event = pb.Event(seq=batch + 1, log=pb.LogReport(values=values))
        assert not registry.ingest(pb.StreamRequest(run_id="keys", events=[event])).error
    run = registry.run("keys")
    assert run is not None and len(run.log_history) == MAX_LOG_KEYS
    assert run.dropped_log_keys == 3 * limits.MAX_MAP_ENTRIES - MAX_LOG_KEYS


def test_ended_runs_expire_after_the_ttl() -> None:
    registry = Registry(ended_ttl_seconds=60.0)
    registry.ingest(_start("done"))
    registry.ingest(pb.StreamRequest(run_id="done", events=[pb.Event(seq=1, run_end=pb.RunEnd())]))
    registry.tick(time.time() + 30)
    assert 'run_id="done"' in _page(registry)
    registry.tick(time.time() + 61)
    assert registry.run("done") is None and 'run_id="done"' not in _page(registry)


def test_the_shared_registries_stayed_bounded_after_every_batch() -> None:
    """The registries above took every batch of their tests (tens of thousands in all):
    still within every cap, still exporting a parseable page."""
    shared = (CAPS, UNKNOWN, ORDER, NONFINITE)
    batches = [c.registry.batches for c in shared]
    print(f"{sum(batches)} batches into {len(shared)} shared registries")
    # Each test above ran its examples through its registry: at least one batch apiece.
    assert all(count >= EXAMPLES_PER_REGISTRY for count in batches), batches
    for cases in shared:
        check_bounded(cases.registry)
        check_exported(cases.registry)
        assert len(cases.registry.runs()) <= 1


def test_a_group_text_over_the_text_cap_is_refused() -> None:
    # A step report smaller than the cap is accepted without looking inside it; a larger one
    # is checked group by group.
    registry, run_id = CAPS.registry, CAPS.fresh_run()
    cap = limits.MAX_TEXT_LENGTH
    for field in ("name", "kind", "dtype"):
        long = pb.GroupUpdate(**{field: "g" * (cap + 1)})
        response = registry.ingest(pb.StreamRequest(run_id=run_id, events=[
            pb.Event(seq=1, step=pb.StepReport(step=1, groups=[pb.GroupUpdate(name="a"), long]))
        ]))
        assert "step.groups" in response.error and str(cap) in response.error, response.error
        at_cap = pb.GroupUpdate(**{field: "g" * cap})
        accepted = registry.ingest(pb.StreamRequest(run_id=run_id, events=[
            pb.Event(seq=1, step=pb.StepReport(step=1, groups=[at_cap]))]))
        assert not accepted.error, accepted.error
