"""The words the report (and every other place a verdict is told) takes from the specs: the
fix sentence of each detector, and causes before their symptoms."""

from __future__ import annotations

import re

from deadweight.sidecar.detectors import BY_ID, fix_sentence
from deadweight.sidecar.detectors.spec import root_causes_first


def test_every_detector_has_a_one_sentence_fix_from_its_spec() -> None:
    for detector in BY_ID:
        fix = fix_sentence(detector)
        assert fix.endswith(".") and len(fix) > 20, (detector, fix)
        assert "\n" not in fix and "](" not in fix and not fix.startswith("-"), (detector, fix)
        # One sentence: no full stop followed by a new capitalised sentence outside code.
        prose = re.sub(r"`[^`]*`", "", fix)
        assert not re.search(r"\.\s+[A-Z]", prose), (detector, fix)
    assert "is_trainable=True" in fix_sentence("empty_optimizer")
    assert "is_trainable=True" in fix_sentence("frozen_weights")
    assert fix_sentence("README") == "" and fix_sentence("no_such_detector") == ""


def test_root_causes_first() -> None:
    alphabetical = sorted(["frozen_weights", "checkpoint_unchanged", "empty_optimizer",
                           "grad_not_in_optimizer"])
    assert root_causes_first(alphabetical) == [
        "empty_optimizer", "grad_not_in_optimizer", "frozen_weights", "checkpoint_unchanged"]
    # A cause reached only through the table's closure still leads; unrelated ids keep
    # their order; duplicates appear once.
    assert root_causes_first(["kl_stuck_zero", "stalled", "zero_reward_variance",
                              "stalled"]) == ["zero_reward_variance", "stalled", "kl_stuck_zero"]
    assert root_causes_first([]) == []
    assert root_causes_first(["nonfinite_loss", "stalled"]) == ["nonfinite_loss", "stalled"]


def test_a_verdict_closed_by_the_run_end_reads_firing_at_end() -> None:
    from deadweight.sidecar import verdicts as verdict_order
    from deadweight.sidecar.store.journal import StoredIncident, StoredRun

    def incident(resolved_at: float | None) -> StoredIncident:
        return StoredIncident("r", "frozen_weights", 1, "critical", "page", 3, "s", {}, 100.0,
                              resolved_at, "none")

    live = StoredRun("r", "SFTTrainer", None, 90.0, False, "", 0.0)
    ended = StoredRun("r", "SFTTrainer", None, 90.0, True, "completed", 200.0)
    assert verdict_order.state(incident(None), live) == "firing"
    assert verdict_order.state(incident(150.0), live) == "resolved"
    assert verdict_order.state(incident(150.0), ended) == "resolved"  # cleared while live
    assert verdict_order.state(incident(200.0), ended) == "firing at end"  # closed by the end
    assert verdict_order.state(incident(None), ended) == "firing at end"


def test_a_run_without_a_step_is_not_called_healthy() -> None:
    from deadweight.sidecar.commands import report
    from deadweight.sidecar.store.journal import StoredRun

    run = StoredRun("r", "SFTTrainer", None, 90.0, True, "completed", 95.0)
    empty = report.RunRecord(run=run, steps=[], logs=[], incidents=[], actions=[],
                             checkpoints=[])
    top = report.headline(empty)
    assert top.css == "warn" and "NO OPTIMIZER STEP RECORDED" in top.title
    moved = report.RunRecord(run=run, steps=[(1, 91.0, {"update_norm": 1e-3})], logs=[],
                             incidents=[], actions=[], checkpoints=[])
    assert report.headline(moved).title.startswith("HEALTHY: the weights moved at 1 of 1")
