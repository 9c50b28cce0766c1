"""A rank that joins a run after a finding fired does not split it into two incidents.

Unsharded, the lowest rank's steps stand for the run; sharded, only steps every rank
reported count. So a rank joining late leaves the detectors a window of a few fresh steps.
The finding is held until its detector confirms it or ``resume_hold_steps`` steps pass.
"""

from __future__ import annotations

import pytest

from deadweight.proto import pb
from deadweight.sidecar.registry import Registry

RUN = "late-rank"


def _start(sharded: bool) -> pb.Event:
    return pb.Event(seq=0, run_start=pb.RunStart(
        trainer="SFTTrainer", world_size=2, sharded=sharded,
        membership=pb.OptimizerMembership(optimizer_tensors=8, optimizer_params=1024,
                                          adapter_params=1024, adapter_tensors=8)))


def _send(registry: Registry, rank: int, *events: pb.Event) -> None:
    response = registry.ingest(pb.StreamRequest(run_id=RUN, rank=rank, events=list(events)))
    assert not response.error, response.error


def _steps(registry: Registry, rank: int, steps: range, update_sq: float) -> None:
    """One batch per step, each with its log (loss and a flowing gradient)."""
    for step in steps:
        report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=update_sq,
                               watched_params=1024, optimizer_params=1024, watched_tensors=8,
                               unchanged_tensors=8 if update_sq == 0 else 0)
        _send(registry, rank, pb.Event(seq=2 * step - 1, step=report),
              pb.Event(seq=2 * step, log=pb.LogReport(step=step,
                                                      values={"loss": 1.0, "grad_norm": 0.5})))


def _incidents(registry: Registry) -> tuple[bool, int]:
    finding = registry.findings(RUN)["frozen_weights"]
    return finding.firing, finding.incidents


@pytest.mark.parametrize("sharded", [False, True])
def test_a_frozen_run_stays_one_incident_when_rank_0_joins_late(sharded: bool) -> None:
    registry = Registry()
    _send(registry, 1, _start(sharded))
    _steps(registry, 1, range(1, 6), 0.0)  # rank 1 alone: frozen for 5 steps
    assert _incidents(registry) == (True, 1)

    _send(registry, 0, _start(sharded))  # rank 0 joins with an empty window
    registry.tick()
    assert _incidents(registry) == (True, 1)
    for step in range(1, 12):  # its first steps are too few to confirm or clear it
        _steps(registry, 0, range(step, step + 1), 0.0)
        _steps(registry, 1, range(step + 5, step + 6), 0.0)
        assert _incidents(registry) == (True, 1), f"after rank 0's step {step}"
    # confirmed on rank 0's own steps (combined steps end at rank 0's newest, both layouts)
    assert registry.findings(RUN)["frozen_weights"].evidence["step"] == "11"


def test_the_hold_ends_a_run_that_really_recovered() -> None:
    """Control: held findings still resolve once the run's steps show moving weights."""
    registry = Registry()
    _send(registry, 1, _start(False))
    _steps(registry, 1, range(1, 6), 0.0)
    _send(registry, 0, _start(False))
    hold = registry.resume_hold_steps
    _steps(registry, 0, range(1, hold), 1e-2)  # rank 0's weights move
    assert _incidents(registry) == (True, 1), "released before resume_hold_steps steps"
    _steps(registry, 0, range(hold, hold + 1), 1e-2)
    assert _incidents(registry) == (False, 1)


def test_a_rank_joining_a_quiet_run_holds_nothing() -> None:
    """Control: with nothing firing, a late rank changes nothing and a freeze still fires."""
    registry = Registry()
    _send(registry, 1, _start(False))
    _steps(registry, 1, range(1, 3), 0.0)
    _send(registry, 0, _start(False))
    assert "frozen_weights" not in registry.findings(RUN)
    _steps(registry, 0, range(1, 4), 0.0)
    assert _incidents(registry) == (True, 1)
