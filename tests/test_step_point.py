"""StepPoint.from_report: the sidecar's hottest constructor fills every field and stays frozen."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deadweight.proto import pb
from deadweight.sidecar import history
from deadweight.sidecar.state import StepPoint


def _report() -> pb.StepReport:
    report = pb.StepReport(step=7, learning_rate=2e-4, update_sq_sum=4e-6, param_sq_sum=3.0,
                           watched_tensors=4, watched_params=100, optimizer_params=100,
                           unchanged_tensors=1, nonfinite_update_tensors=0, sampled=True,
                           optimizer_step_skipped=True, adalora_rank_pattern_set=False)
    report.groups.add(name="q_proj", kind="module", update_sq_sum=1e-6, tensors=2,
                      unchanged_tensors=1)
    report.groups.add(name="default", kind="adapter", update_sq_sum=4e-6, tensors=4,
                      unchanged_tensors=1)
    return report


def test_from_report_sets_every_field_like_the_dataclass_constructor() -> None:
    point = StepPoint.from_report(_report(), 12.5)
    names = {f.name for f in dataclasses.fields(StepPoint)}
    assert set(vars(point)) == names  # a new field must be read in from_report too
    rebuilt = StepPoint(**{name: getattr(point, name) for name in names})
    assert rebuilt == point and hash(rebuilt) == hash(point)
    assert point.adapter_updates == (("default", 4e-6, 1, 4),)
    assert (point.step, point.time, point.skipped, point.adalora_allocated) == (7, 12.5, True,
                                                                                False)
    assert StepPoint.from_report(pb.StepReport(step=1), 0.0).adalora_allocated is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        point.step = 8  # type: ignore[misc]


def test_a_stored_step_reads_back_as_the_figures_of_its_combined_point() -> None:
    report = _report()
    point = StepPoint.from_report(report, 1.0)
    kept = history.encode_step(point, report, same=True)
    assert isinstance(kept, bytes)
    same = history.decode_step(kept, 1.0)
    assert same == history.step_series(point, report)
    # a sharded step: the run-wide sums replace the reporting rank's own
    summed = dataclasses.replace(point, update_sq_sum=9e-6, watched_tensors=8,
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
