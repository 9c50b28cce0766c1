"""StepPoint.from_report: the sidecar's hottest constructor fills every field and stays frozen."""

from __future__ import annotations

import json

import pytest

from deadweight.proto import pb
from deadweight.sidecar.model.run_state import STEP_WINDOW
from deadweight.sidecar.model.step_point import MAX_ADAPTERS_PER_STEP, NO_GROUPS, StepPoint
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store import history


def _report() -> pb.StepReport:
    report = pb.StepReport(step=7, learning_rate=2e-4, update_sq_sum=4e-6, param_sq_sum=3.0,
                           watched_tensors=4, watched_params=100, optimizer_params=100,
                           unchanged_tensors=1, nonfinite_update_tensors=5, sampled=True,
                           grad_not_in_optimizer_tensors=2, grad_not_in_optimizer_params=30,
                           optimizer_step_skipped=True, adalora_rank_pattern_set=False)
    report.groups.add(name="q_proj", kind="module", update_sq_sum=1e-6, tensors=2,
                      unchanged_tensors=1)
    report.groups.add(name="default", kind="adapter", update_sq_sum=4e-6, tensors=4,
                      unchanged_tensors=1)
    return report


def test_from_report_sets_every_field_like_the_constructor() -> None:
    point = StepPoint.from_report(_report(), 12.5)
    assert len(point) == len(StepPoint._fields)  # a new field must be read in from_report too
    rebuilt = StepPoint(**point._asdict())
    assert rebuilt == point and hash(rebuilt) == hash(point)
    assert (point.learning_rate, point.update_sq_sum, point.param_sq_sum, point.watched_tensors,
            point.watched_params, point.optimizer_params, point.unchanged_tensors,
            point.nonfinite_update_tensors, point.grad_not_in_optimizer_tensors,
            point.grad_not_in_optimizer_params, point.sampled) == (2e-4, 4e-6, 3.0, 4, 100, 100,
                                                                   1, 5, 2, 30, True)
    assert point.adapter_updates == (("default", 4e-6, 1, 4),)
    assert (point.step, point.time, point.skipped, point.adalora_allocated) == (7, 12.5, True,
                                                                                False)
    assert StepPoint.from_report(pb.StepReport(step=1), 0.0).adalora_allocated is None
    with pytest.raises(AttributeError):
        point.step = 8  # type: ignore[misc]


def test_a_stored_step_reads_back_as_the_figures_of_its_combined_point() -> None:
    report = _report()
    point = StepPoint.from_report(report, 1.0)
    kept = history.encode_step(point, report, same=True)
    assert isinstance(kept, bytes)
    same = history.decode_step(kept, 1.0)
    assert same == history.step_series(point, report)
    # a sharded step: the run-wide sums replace the reporting rank's own
    summed = point._replace(update_sq_sum=9e-6, watched_tensors=8,
                                 watched_params=200, optimizer_params=200, unchanged_tensors=2)
    stored = history.encode_step(summed, report, same=False)
    assert isinstance(stored, str)
    figures = json.loads(stored)
    assert figures == history.step_series(summed, report)
    assert figures["watched_tensors"] == 8.0 and figures["update_norm"] == pytest.approx(3e-3)


def test_an_oversized_step_report_is_kept_as_its_bounded_figures() -> None:
    report = _report()
    for i in range(200):
        report.groups.add(name=f"m{i}-" + "n" * 100, kind="module", update_sq_sum=float(i),
                          tensors=1)
    point = StepPoint.from_report(report, 1.0)
    stored = history.encode_step(point, report, same=True)
    assert isinstance(stored, str) and len(stored) < history.MAX_STORED_STEP_BYTES * 2
    modules = {k.split("/")[1] for k in json.loads(stored) if k.startswith("module/")}
    assert len(modules) == history.MAX_MODULE_KINDS + 1 and "other" in modules


def test_groups_are_read_off_the_report_when_first_asked_and_capped() -> None:
    report = _report()
    report.groups.add(name="v_proj", kind="module", update_sq_sum=2e-6, tensors=2,
                      elements=64, unchanged_elements=40, dtype="bfloat16")
    for i in range(MAX_ADAPTERS_PER_STEP + 5):
        report.groups.add(name=f"extra{i}", kind="adapter", update_sq_sum=0.0, tensors=1,
                          unchanged_tensors=1)
    point = StepPoint.from_report(report, 1.0)
    assert not point.groups.decoded  # kept as bytes until a detector asks
    assert point.module_elements == (("v_proj", "bfloat16", 64, 40),)  # q_proj has no counts
    assert point.groups.decoded
    assert len(point.adapter_updates) == MAX_ADAPTERS_PER_STEP
    assert point.adapter_updates[0] == ("default", 4e-6, 1, 4)
    assert StepPoint.from_report(pb.StepReport(step=2), 0.0).groups is NO_GROUPS


def test_the_detectors_read_the_groups_of_the_newest_steps_only() -> None:
    """256 steps kept per rank, evaluated after every batch: only the newest few are decoded
    (reading every step's groups was the largest cost of ingest)."""
    registry = Registry()
    request = pb.StreamRequest(run_id="lazy", rank=0)
    start = request.events.add(seq=0).run_start
    start.trainer, start.world_size = "SFTTrainer", 1
    start.membership.layout = "module"
    assert not registry.ingest(request).error
    for first in range(1, 257, 64):
        batch = pb.StreamRequest(run_id="lazy", rank=0)
        for step in range(first, first + 64):
            event = batch.events.add(seq=step)
            event.step.CopyFrom(_report())
            event.step.step = step
            event.step.groups.add(name="v_proj", kind="module", update_sq_sum=1e-6, tensors=2,
                                  elements=64, unchanged_elements=1, dtype="float32")
        assert not registry.ingest(batch).error
    steps = registry.run("lazy").ranks[0].steps  # type: ignore[union-attr]
    decoded = sum(point.groups.decoded for point in steps)
    assert len(steps) == STEP_WINDOW and 0 < decoded <= 4 * 16
    assert steps[-1].groups.decoded  # the newest step was looked at
