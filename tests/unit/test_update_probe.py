"""The update probe: exact unchanged detection, correct norms, groups and sampling."""

from __future__ import annotations

import math

import pytest
import torch

from deadweight.callbacks.update.probe import UpdateProbe
from deadweight.callbacks.update.stats import TensorGroup


def _tensors(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8, 16), (4,), (32, 4)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_unchanged_step_is_exactly_zero() -> None:
    params = _tensors()
    probe = UpdateProbe(params)
    probe.before_step()
    stats = probe.after_step()
    assert stats is not None
    assert stats.update_sq_sum == 0.0
    assert stats.unchanged_tensors == len(params)
    assert stats.watched_params == sum(p.numel() for p in params)


def test_relative_update_of_one_ulp_in_one_element_is_seen() -> None:
    params = _tensors()
    probe = UpdateProbe(params)
    probe.before_step()
    with torch.no_grad():
        value = params[2][1]
        params[2][1] = torch.nextafter(value, value + 1)  # the smallest possible move
    stats = probe.after_step()
    assert stats is not None
    assert stats.update_sq_sum > 0
    assert stats.unchanged_tensors == len(params) - 1


def test_norms_match_a_per_tensor_reference() -> None:
    params = _tensors()
    probe = UpdateProbe(params)
    before = [p.detach().clone() for p in params]
    probe.before_step()
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_(torch.full_like(p, 1e-3 * (i + 1)))
    stats = probe.after_step()
    assert stats is not None
    expected = sum(
        float((p.detach() - b).double().square().sum())
        for p, b in zip(params, before, strict=True)
    )
    weights = sum(float(p.detach().double().square().sum()) for p in params)
    assert math.isclose(stats.update_sq_sum, expected, rel_tol=1e-5)
    assert math.isclose(stats.param_sq_sum, weights, rel_tol=1e-5)
    assert stats.unchanged_tensors == 0


def test_groups_sum_their_members_and_nonfinite_is_counted() -> None:
    params = _tensors()
    groups = [TensorGroup("a", "adapter", [0, 1]), TensorGroup("b", "module", [2, 3])]
    probe = UpdateProbe(params, groups)
    probe.before_step()
    with torch.no_grad():
        params[0].add_(1.0)
        params[3][0, 0] = float("nan")
    stats = probe.after_step()
    assert stats is not None
    by_name = {g.name: g for g in stats.groups}
    assert by_name["a"].update_sq_sum == pytest.approx(params[0].numel())
    assert by_name["a"].unchanged_tensors == 1
    assert by_name["b"].tensors == 2
    assert stats.nonfinite_update_tensors == 1
    assert math.isfinite(stats.update_sq_sum)


def test_sampled_mode_bounds_the_snapshot() -> None:
    params = [torch.nn.Parameter(torch.randn(1000, 100))]
    probe = UpdateProbe(params, max_full_elements=10_000, sample_per_tensor=500)
    assert probe.sampled
    probe.before_step()
    with torch.no_grad():
        params[0].add_(0.5)
    stats = probe.after_step()
    assert stats is not None and stats.sampled
    assert stats.update_sq_sum == pytest.approx(500 * 0.25, rel=1e-4)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_write_between_steps_through_a_parameter_is_seen_in_sampled_mode(path: str) -> None:
    """The probe reads version counters off the parameters, while its kernels read sampled
    views of them: the counters are shared, so a write between two steps (a callback editing
    weights) is copied into the snapshot, not counted as the next step's update."""
    param = torch.nn.Parameter(torch.zeros(1000, 100))
    probe = UpdateProbe([param], max_full_elements=10_000, sample_per_tensor=500,
                        path=path)  # type: ignore[arg-type]
    assert probe.sampled and probe._sources[0] is not param
    probe.before_step()
    with torch.no_grad():
        param.add_(1.0)
    assert probe.after_step() is not None
    with torch.no_grad():
        param.add_(5.0)  # between the steps
    probe.before_step()
    with torch.no_grad():
        param.add_(0.5)  # the step
    stats = probe.after_step()
    assert stats is not None
    assert stats.update_sq_sum == pytest.approx(500 * 0.25, rel=1e-4)


def test_after_step_without_snapshot_reports_nothing() -> None:
    assert UpdateProbe(_tensors()).after_step() is None


def test_the_step_record_carries_element_counts_and_dtypes_on_the_wire() -> None:
    # The training thread submits a pending result; the sender thread's to_event reads it.
    from deadweight.callbacks.wire import StepRecord, to_event
    from deadweight.proto import pb

    frozen = torch.ones(8, 4, dtype=torch.bfloat16)
    moving = torch.zeros(16)
    groups = [TensorGroup("default", "adapter", [0, 1]), TensorGroup("lora_A", "module", [0]),
              TensorGroup("lora_B", "module", [1])]
    probe = UpdateProbe([frozen, moving], groups)
    probe.before_step()
    with torch.no_grad():
        moving[:4] += 1.0
    pending = probe.after_step_deferred()
    assert pending is not None
    record = StepRecord(step=1, learning_rate=1e-4, stats=pending, optimizer_params=48,
                        grad_not_in_optimizer_tensors=0, grad_not_in_optimizer_params=0)
    wire = pb.Event.FromString(to_event("step", record).SerializeToString()).step
    assert wire.unchanged_elements == 32 + 12
    by_name = {g.name: g for g in wire.groups}
    assert (by_name["lora_A"].elements, by_name["lora_A"].unchanged_elements,
            by_name["lora_A"].dtype) == (32, 32, "bfloat16")
    assert (by_name["lora_B"].elements, by_name["lora_B"].unchanged_elements,
            by_name["lora_B"].dtype) == (16, 12, "float32")
    assert by_name["default"].dtype == "bfloat16,float32"
    assert len(wire.groups) == 3  # per group, never per tensor
