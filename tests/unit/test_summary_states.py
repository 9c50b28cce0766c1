"""Verdict states and order in the run summary: what the gate prints comes from these.

A verdict still firing when the run ended reads "firing at end", never "resolved" (also when
the end itself is what cleared it in the sidecar's state); "resolved" only when it cleared
while the run was live. Root causes lead their symptoms.
"""

from __future__ import annotations

from deadweight.proto import run_summary
from deadweight.sidecar.ingest.summary_service import summary_state as verdict_state
from deadweight.sidecar.model.finding import Finding
from deadweight.sidecar.verdicts import causes_first

ENDED_AT = 1000.0


def _finding(firing: bool, resolved_at: float = 0.0) -> Finding:
    return Finding("frozen_weights", "critical", "page", firing=firing, fired_at=900.0,
                   resolved_at=resolved_at, incidents=1)


def test_a_verdict_firing_on_a_live_run_is_firing() -> None:
    assert verdict_state(_finding(True), ended=False, ended_at=0.0) == run_summary.FIRING


def test_a_verdict_standing_at_the_end_is_firing_at_end_never_resolved() -> None:
    assert verdict_state(_finding(True), True, ENDED_AT) == run_summary.FIRING_AT_END
    # The sidecar closed it because the run ended: the end is no recovery.
    closed_by_end = _finding(False, resolved_at=ENDED_AT + 0.01)
    assert verdict_state(closed_by_end, True, ENDED_AT) == run_summary.FIRING_AT_END


def test_a_verdict_that_cleared_while_the_run_was_live_is_resolved() -> None:
    recovered = _finding(False, resolved_at=950.0)
    assert verdict_state(recovered, True, ENDED_AT) == run_summary.RESOLVED
    assert verdict_state(recovered, False, 0.0) == run_summary.RESOLVED


def test_root_causes_come_before_their_symptoms() -> None:
    given = [("checkpoint_unchanged", "critical", 0), ("lora_lr_too_low", "warning", 0),
             ("frozen_weights", "critical", 3), ("empty_optimizer", "critical", 0)]
    ordered = [d for d, _, _ in causes_first(given, lambda v: v)]
    # a learning rate too low to move the adapter is one way its weights stay frozen
    assert ordered == ["empty_optimizer", "lora_lr_too_low", "frozen_weights",
                       "checkpoint_unchanged"]
