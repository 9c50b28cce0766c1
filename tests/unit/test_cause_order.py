"""One causal graph (each spec's ``symptom_of``) orders every list of verdicts: the console,
status, report, summary and inspect all list them through ``root_causes_first``; and a
one-sentence fix for every detector."""

from __future__ import annotations

import pytest

from deadweight.sidecar.detectors import ALL, BY_ID, GRAPH, root_causes_of
from deadweight.sidecar.detectors.causes import CausalGraph
from deadweight.sidecar.detectors.spec import (
    PHASE_ORDER,
    DetectorSpec,
    Severity,
    cause_rank,
    root_causes_first,
)


def test_every_detector_has_exactly_one_place_in_the_phase_order() -> None:
    assert sorted(PHASE_ORDER) == sorted(d.id for d in ALL)
    assert len(set(PHASE_ORDER)) == len(PHASE_ORDER)
    assert sorted(GRAPH.order) == sorted(d.id for d in ALL)


def test_the_graph_is_acyclic_and_every_cause_reads_before_its_symptoms() -> None:
    assert GRAPH.edges(), "no detector names a cause"
    for cause, symptom in GRAPH.edges():
        assert cause in BY_ID and cause != symptom
        assert cause_rank(cause) < cause_rank(symptom), (cause, symptom)
        # A cause is never among its own causes, however far up: no cycle.
        assert cause not in GRAPH.symptoms_of(symptom)
        assert symptom not in GRAPH.causes_of(cause)
    for detector in GRAPH.order:
        assert detector not in GRAPH.causes_of(detector)


def test_the_order_a_person_reads_is_the_phase_order_where_the_graph_allows() -> None:
    # The phase order agrees with every edge, so the graph keeps it as it is.
    assert GRAPH.order == PHASE_ORDER


def test_an_edge_against_the_phase_order_moves_the_symptom_after_its_cause() -> None:
    specs = [d.spec for d in ALL]
    early = BY_ID["zero_gradient"].spec
    moved = DetectorSpec(**{**early.__dict__, "symptom_of": ("pickle_checkpoint",)})
    graph = CausalGraph([moved if s.id == early.id else s for s in specs])
    assert graph.rank("pickle_checkpoint") < graph.rank("zero_gradient")
    for symptom in graph.symptoms_of("zero_gradient"):  # its own symptoms follow it
        assert graph.rank("zero_gradient") < graph.rank(symptom)
    # Ties still go by phase: what the new edge does not reach keeps its order.
    reached = {"zero_gradient", *graph.symptoms_of("zero_gradient")}
    assert [d for d in graph.order if d not in reached] == [
        d for d in PHASE_ORDER if d not in reached]


def test_a_cycle_or_an_unknown_cause_is_refused() -> None:
    specs = {d.id: d.spec for d in ALL}
    cause = specs["frozen_weights"]
    looped = DetectorSpec(**{**specs["empty_optimizer"].__dict__,
                             "symptom_of": ("checkpoint_unchanged",)})
    with pytest.raises(ValueError, match="cycle"):
        CausalGraph([looped if s.id == "empty_optimizer" else s for s in specs.values()])
    unknown = DetectorSpec(**{**cause.__dict__, "symptom_of": ("no_such_detector",)})
    with pytest.raises(ValueError, match="no_such_detector"):
        CausalGraph([unknown if s.id == cause.id else s for s in specs.values()])


def test_the_frozen_adapter_chain_reads_cause_first() -> None:
    fired = ["checkpoint_unchanged", "frozen_weights", "grad_not_in_optimizer",
             "empty_optimizer", "frozen_weights"]
    assert root_causes_first(fired) == ["empty_optimizer", "grad_not_in_optimizer",
                                        "frozen_weights", "checkpoint_unchanged"]


def test_a_constant_reward_is_named_before_the_frozen_steps_it_causes() -> None:
    fired = ["checkpoint_unchanged", "negligible_updates", "frozen_weights", "zero_gradient",
             "decay_only_update", "zero_reward_variance"]
    assert root_causes_first(fired)[0] == "zero_reward_variance"
    for symptom in ("zero_gradient", "frozen_weights", "negligible_updates",
                    "decay_only_update", "checkpoint_unchanged"):
        assert "zero_reward_variance" in GRAPH.causes_of(symptom), symptom


def test_silencing_a_cause_reaches_every_symptom_down_the_graph() -> None:
    # empty_optimizer -> frozen_weights -> checkpoint_unchanged: both are quiet with it.
    assert "empty_optimizer" in root_causes_of("frozen_weights")
    assert "empty_optimizer" in root_causes_of("checkpoint_unchanged")
    assert {"frozen_weights", "checkpoint_unchanged", "kl_stuck_zero"} <= set(
        GRAPH.inhibits("empty_optimizer"))
    assert root_causes_of("empty_optimizer") == ()


def test_a_cause_inhibits_only_symptoms_no_more_severe_than_itself() -> None:
    specs = {d.id: d.spec for d in ALL}
    weak = DetectorSpec(**{**specs["empty_optimizer"].__dict__, "severity": Severity.INFO})
    graph = CausalGraph([weak if s.id == weak.id else s for s in specs.values()])
    assert "empty_optimizer" in graph.causes_of("frozen_weights")  # still read first
    assert "empty_optimizer" not in graph.inhibitors_of("frozen_weights")  # but never mutes it


def test_unknown_ids_go_last_in_their_given_order() -> None:
    assert root_causes_first(["zz_new", "checkpoint_unchanged", "aa_new", "empty_optimizer"]) \
        == ["empty_optimizer", "checkpoint_unchanged", "zz_new", "aa_new"]


def test_every_detector_says_its_fix_in_one_sentence() -> None:
    for detector in ALL:
        fix = detector.spec.fix
        assert fix and not fix.endswith(".") and ". " not in fix, detector.id
        assert len(fix) <= 200, detector.id


def test_a_list_leads_with_what_is_wrong_not_with_information() -> None:
    # no_kl_anchor (info) is read early in the phase order but causes nothing listed here.
    assert root_causes_first(["zero_gradient", "no_kl_anchor", "zero_reward_variance"]) == [
        "zero_reward_variance", "zero_gradient", "no_kl_anchor"]
    # Among notes alone, the graph's order stands.
    assert root_causes_first(["no_kl_anchor", "sharding_fallback"]) == [
        "sharding_fallback", "no_kl_anchor"]
