"""The registry and the two skeleton detectors, fed with wire events directly."""

from __future__ import annotations

import time

from deadweight.proto import pb
from deadweight.sidecar.registry import Registry


def _start(optimizer_tensors: int = 8, optimizer_params: int = 1024) -> pb.Event:
    return pb.Event(
        seq=0,
        run_start=pb.RunStart(
            trainer="GRPOTrainer",
            membership=pb.OptimizerMembership(
                optimizer_tensors=optimizer_tensors, optimizer_params=optimizer_params,
                adapter_params=1024, adapter_tensors=8,
            ),
        ),
    )


def _step(seq: int, step: int, lr: float, update_sq: float, optimizer_params: int = 1024
          ) -> pb.Event:
    return pb.Event(seq=seq, step=pb.StepReport(
        step=step, learning_rate=lr, update_sq_sum=update_sq, watched_params=1024,
        optimizer_params=optimizer_params, watched_tensors=8,
        unchanged_tensors=8 if update_sq == 0 else 0,
    ))


def _log(seq: int, step: int, **values: float) -> pb.Event:
    return pb.Event(seq=seq, log=pb.LogReport(step=step, values=values))


def _send(registry: Registry, *events: pb.Event, run_id: str = "r") -> pb.StreamResponse:
    return registry.ingest(pb.StreamRequest(run_id=run_id, rank=0, events=list(events)))


def test_frozen_fires_after_k_steps_and_resolves_on_movement() -> None:
    registry = Registry()
    _send(registry, _start())
    seq = 0
    for step in (1, 2):
        seq += 2
        _send(registry, _step(seq - 1, step, 1e-4, 0.0), _log(seq, step, loss=1.0, grad_norm=0.5))
    assert "frozen_weights" not in registry.findings("r")
    _send(registry, _step(5, 3, 1e-4, 0.0))
    finding = registry.findings("r")["frozen_weights"]
    assert finding.firing and finding.step == 3
    assert finding.evidence["frozen_steps"] == "3"
    _send(registry, _step(6, 4, 1e-4, 1e-6))
    assert not registry.findings("r")["frozen_weights"].firing


def test_lr_zero_steps_neither_count_nor_break_the_streak() -> None:
    registry = Registry()
    _send(registry, _start(), _log(1, 0, loss=1.0, grad_norm=0.5))
    _send(registry, _step(2, 1, 0.0, 0.0), _step(3, 2, 0.0, 0.0), _step(4, 3, 0.0, 0.0))
    assert "frozen_weights" not in registry.findings("r")


def test_zero_gradient_with_a_real_optimizer_is_not_frozen_weights() -> None:
    registry = Registry()
    _send(registry, _start(), _log(1, 0, loss=0.0, grad_norm=0.0))
    _send(registry, *[_step(i + 2, i + 1, 1e-4, 0.0) for i in range(4)])
    assert "frozen_weights" not in registry.findings("r")


def test_empty_optimizer_fires_at_run_start_only_when_empty() -> None:
    registry = Registry()
    _send(registry, _start(optimizer_tensors=0, optimizer_params=0), run_id="empty")
    _send(registry, _start(), run_id="full")
    assert registry.findings("empty")["empty_optimizer"].step == 0
    assert "empty_optimizer" not in registry.findings("full")


def test_duplicate_and_out_of_order_events_change_nothing() -> None:
    registry = Registry()
    _send(registry, _start(), _step(1, 1, 1e-4, 1e-6))
    response = _send(registry, _step(1, 1, 1e-4, 0.0), _step(2, 1, 1e-4, 0.0))
    assert response.ack_seq == 2
    run = registry.run("r")
    assert run is not None and len(run.ranks[0].steps) == 1
    assert registry.duplicate_events == 2


def test_unknown_run_and_bad_batches_get_clear_errors() -> None:
    registry = Registry()
    assert "send run_start first" in _send(registry, _step(1, 1, 1e-4, 0.0), run_id="x").error
    assert "run_id is empty" in _send(registry, _start(), run_id="").error
    long_id = "x" * 500
    assert "longer than" in _send(registry, _start(), run_id=long_id).error
    assert registry.runs() == []


def test_run_end_resolves_standing_verdicts() -> None:
    registry = Registry()
    _send(registry, _start(optimizer_tensors=0, optimizer_params=0))
    assert registry.findings("r")["empty_optimizer"].firing
    _send(registry, pb.Event(seq=1, run_end=pb.RunEnd(step=3, reason="completed")))
    assert not registry.findings("r")["empty_optimizer"].firing


def test_expired_runs_leave_the_action_counters() -> None:
    from deadweight.sidecar.actions.policy import Actions

    actions = Actions()
    registry = Registry(actions, ended_ttl_seconds=0.0)
    _send(registry, _start(optimizer_tensors=0, optimizer_params=0), run_id="gone")
    assert {key.run_id for key in actions.counts} == {"gone"}  # the page was counted
    _send(registry, pb.Event(seq=1, run_end=pb.RunEnd(step=1)), run_id="gone")
    registry.tick(now=time.time() + 1.0)
    assert registry.runs() == []
    assert not actions.counts


def test_a_batch_of_steps_reports_where_the_nonfinite_streak_began() -> None:
    registry = Registry()
    _send(registry, _start())
    nan = float("nan")
    _send(registry,  # one batch, as the client's timed flush delivers it
          _step(1, 1, 1e-4, 1e-6), _log(2, 1, loss=1.0, grad_norm=0.5),
          _step(3, 2, 1e-4, 1e-6), _log(4, 2, loss=nan, grad_norm=nan),
          _step(5, 3, 1e-4, 1e-6), _log(6, 3, loss=nan, grad_norm=nan))
    finding = registry.findings("r")["nonfinite_loss"]
    assert finding.firing and finding.step == 2


def test_frozen_weights_fires_at_the_step_the_streak_reached_k_even_in_one_batch() -> None:
    registry = Registry()
    _send(registry, _start(), _log(1, 0, loss=1.0, grad_norm=0.5))
    _send(registry, *[_step(i + 2, i + 1, 1e-4, 0.0) for i in range(6)])
    finding = registry.findings("r")["frozen_weights"]
    assert finding.firing and finding.step == 3
    assert finding.evidence["frozen_steps"] == "6" and finding.evidence["step"] == "6"
