"""A sharded run's combined steps, kept between asks, are the steps built afresh each time.

``reference`` is how ``RunState.combined_steps`` built them before (every rank's window
grouped by step at every ask). Random reports from up to four ranks (steps skipped, windows
short enough to slide, ranks joining late) must give the same steps after every report.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from deadweight.proto import pb
from deadweight.sidecar.model.run_state import RankState, RunState
from deadweight.sidecar.model.sharded_steps import combine
from deadweight.sidecar.model.step_point import StepGroups, StepPoint
from deadweight.sidecar.registry import Registry

WINDOW = 6


def reference(run: RunState) -> list[StepPoint]:
    """Every step that every rank's window holds, combined (the former implementation)."""
    ordered = sorted(run.ranks)
    by_step: dict[int, list[StepPoint]] = {}
    for rank in ordered:
        for point in run.ranks[rank].steps:
            by_step.setdefault(point.step, []).append(point)
    return [combine(step, points) for step, points in sorted(by_step.items())
            if len(points) == len(ordered)]


def _point(rank: int, step: int) -> StepPoint:
    return StepPoint(step=step, time=float(step), learning_rate=1e-4 * (rank + 1),
                     update_sq_sum=float(rank + step), param_sq_sum=1.0, watched_tensors=1,
                     watched_params=10 + rank, optimizer_params=10, unchanged_tensors=rank % 2,
                     nonfinite_update_tensors=0, grad_not_in_optimizer_tensors=0,
                     grad_not_in_optimizer_params=0, sampled=False,
                     groups=StepGroups(modules=(("q_proj", "float32", 100, rank),)))


#: One report: which rank (0-3) and how far past its newest step (1: the next one).
REPORTS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(reports=REPORTS, first_ranks=st.integers(1, 4))
def test_kept_combined_steps_equal_the_steps_built_afresh(
        reports: list[tuple[int, int]], first_ranks: int) -> None:
    run = RunState("sharded")
    run.start = pb.RunStart(trainer="SFTTrainer", world_size=4, sharded=True)
    for rank in range(first_ranks):
        run.ranks[rank] = RankState(rank, steps=deque(maxlen=WINDOW))
    newest = dict.fromkeys(range(4), 0)
    for rank, ahead in reports:
        if rank not in run.ranks:  # a rank joining late
            run.ranks[rank] = RankState(rank, steps=deque(maxlen=WINDOW))
        newest[rank] += ahead
        run.ranks[rank].steps.append(_point(rank, newest[rank]))
        expected = reference(run)
        assert run.combined_steps() == expected
        assert run.newest_combined_step() == (expected[-1] if expected else None)


def test_a_sharded_run_of_eight_ranks_combines_each_step_once() -> None:
    """Through the registry: the figures are the sums of the eight shards, step by step."""
    registry = Registry()
    start = pb.RunStart(trainer="SFTTrainer", world_size=8, sharded=True)
    for rank in range(8):
        registry.ingest(pb.StreamRequest(run_id="fsdp", rank=rank,
                                         events=[pb.Event(run_start=start)]))
    for step in range(1, 41):
        for rank in range(8):
            report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=1.0 + rank,
                                   watched_params=10, optimizer_params=10)
            response = registry.ingest(pb.StreamRequest(run_id="fsdp", rank=rank, events=[
                pb.Event(seq=step, step=report)]))
            assert not response.error, response.error
    run = registry.run("fsdp")
    assert run is not None
    combined = run.combined_steps()
    assert [p.step for p in combined] == list(range(1, 41))
    assert {(p.update_sq_sum, p.optimizer_params) for p in combined} == {(36.0, 80)}
    assert combined == reference(run)
