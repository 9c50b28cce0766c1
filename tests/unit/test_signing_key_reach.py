"""When trainers of the sidecar's own uid may report, they can read its signing key: the
sidecar says so at start, and every ``deadweight status`` (table and JSON) repeats it."""

from __future__ import annotations

import os

import pytest

from deadweight.proto import pb
from deadweight.sidecar.commands import status, status_json
from deadweight.sidecar.serve import key_within_trainers_reach

OWN = os.geteuid()
OTHER = OWN + 4242


@pytest.mark.parametrize(("trainer_uids", "within"), [
    (frozenset(), True),  # no trainer uid named: any uid may report, the sidecar's own too
    (frozenset({OWN}), True),
    (frozenset({OWN, OTHER}), True),
    (frozenset({OTHER}), False),  # the trainers run as another uid: the key is out of reach
])
def test_the_key_is_within_trainers_reach_when_the_sidecars_uid_may_report(
        trainer_uids: frozenset[int], within: bool) -> None:
    assert key_within_trainers_reach(trainer_uids) is within


WARNING = "trainers of this uid can read the signing key: ..."


def test_status_shows_the_sidecars_warnings_before_its_runs() -> None:
    run = pb.RunStatus(run_id="r1", trainer="SFTTrainer", ranks=[0], step=3)
    table = status.render(pb.StatusResponse(runs=[run], warnings=[WARNING])).splitlines()
    assert table[0] == f"WARNING: {WARNING}"
    assert table[1].startswith("RUN ") and table[2].startswith("r1 ")
    assert status.render(pb.StatusResponse(warnings=[WARNING])).splitlines() == [
        f"WARNING: {WARNING}", "no runs"]
    # Without a warning, the table is as it was.
    assert status.render(pb.StatusResponse(runs=[run])).splitlines()[0].startswith("RUN ")
    assert status.render(pb.StatusResponse()) == "no runs"


def test_status_json_carries_the_warnings() -> None:
    assert status_json.document(pb.StatusResponse(warnings=[WARNING]))["warnings"] == [WARNING]
    assert status_json.document(pb.StatusResponse())["warnings"] == []
