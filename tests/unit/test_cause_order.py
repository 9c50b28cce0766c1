"""Causes before symptoms, and a one-sentence fix for every detector: the console, status,
report, summary and inspect all list verdicts through ``root_causes_first``."""

from __future__ import annotations

from deadweight.sidecar.detectors import ALL
from deadweight.sidecar.detectors.spec import CAUSES_FIRST, cause_rank, root_causes_first


def test_every_detector_has_exactly_one_place_in_the_order() -> None:
    assert sorted(CAUSES_FIRST) == sorted(d.id for d in ALL)
    assert len(set(CAUSES_FIRST)) == len(CAUSES_FIRST)


#: (inhibiting cause, detector) pairs read the other way round, on purpose (see CAUSES_FIRST).
CAUSES_OF_THEIR_INHIBITOR = {("frozen_weights", "grad_not_in_optimizer")}


def test_a_root_cause_precedes_every_detector_it_inhibits() -> None:
    for detector in ALL:
        for cause in detector.spec.inhibited_by:
            if (cause, detector.id) in CAUSES_OF_THEIR_INHIBITOR:
                assert cause_rank(detector.id) < cause_rank(cause)
            else:
                assert cause_rank(cause) < cause_rank(detector.id), (cause, detector.id)


def test_the_frozen_adapter_chain_reads_cause_first() -> None:
    fired = ["checkpoint_unchanged", "frozen_weights", "grad_not_in_optimizer",
             "empty_optimizer", "frozen_weights"]
    assert root_causes_first(fired) == ["empty_optimizer", "grad_not_in_optimizer",
                                        "frozen_weights", "checkpoint_unchanged"]


def test_unknown_ids_go_last_in_their_given_order() -> None:
    assert root_causes_first(["zz_new", "checkpoint_unchanged", "aa_new", "empty_optimizer"]) \
        == ["empty_optimizer", "checkpoint_unchanged", "zz_new", "aa_new"]


def test_every_detector_says_its_fix_in_one_sentence() -> None:
    for detector in ALL:
        fix = detector.spec.fix
        assert fix and not fix.endswith(".") and ". " not in fix, detector.id
        assert len(fix) <= 200, detector.id
