"""Step numbers under attack, against a real ``deadweight serve`` over its unix socket.

One StepReport with step 2^62 used to make every later step look old: each was acked and
dropped, a frozen run never fired, and nothing said so. Now a step far beyond the rank's
newest is refused and counted, the run's real steps keep counting, and the frozen run still
fires; step reports that go backwards again and again raise ``step_out_of_order`` instead of
vanishing as duplicates. The healthy control reports in order and nothing fires.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from tests.support.faults import Pipe, metric_value
from tests.support.raw_client import frozen_events, healthy_events, run_start


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Pipe]]:
    with SidecarProcess(tmp_path_factory.mktemp("trust-steps")) as process:
        pipe = Pipe(process.address)
        yield process, pipe
        pipe.close()


def _firing(process: SidecarProcess, run_id: str) -> dict[str, pb.Finding]:
    status = process.run_status(run_id)
    assert status is not None
    return {f.detector: f for f in status.findings if f.firing}


def _send(pipe: Pipe, run_id: str, events: list[pb.Event]) -> pb.StreamResponse:
    response = pipe.send(pb.StreamRequest(run_id=run_id, events=events))
    assert not response.error, response.error
    return response


def test_a_step_of_2_to_the_62_is_refused_and_the_frozen_run_still_fires(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    process, pipe = sidecar
    run_id = "huge-step"
    before = metric_value(process.metrics(), "deadweight_steps_refused_total",
                          reason="too_far") or 0.0
    _send(pipe, run_id, [pb.Event(seq=0, run_start=run_start())])
    _send(pipe, run_id, frozen_events(1, 1))
    response = _send(pipe, run_id, [pb.Event(seq=3, step=pb.StepReport(
        step=2**62, learning_rate=1e-4, update_sq_sum=0.0, param_sq_sum=1.0,
        watched_tensors=4, watched_params=1000, optimizer_params=0, unchanged_tensors=4))])
    assert response.ack_seq == 3  # acked, so the client does not send it again
    seq = 4
    for step in range(2, 7):
        _send(pipe, run_id, frozen_events(step, seq))
        seq += 2
    status = process.run_status(run_id)
    assert status is not None and status.step == 6  # the real steps counted, not 2^62
    firing = _firing(process, run_id)
    assert "frozen_weights" in firing
    assert firing["step_out_of_order"].evidence["reason"] == "too_far"
    assert firing["step_out_of_order"].evidence["step"] == str(2**62)
    after = metric_value(process.metrics(), "deadweight_steps_refused_total", reason="too_far")
    assert after == before + 1


def test_repeated_backward_steps_raise_a_finding(sidecar: tuple[SidecarProcess, Pipe]) -> None:
    process, pipe = sidecar
    run_id = "backward-steps"
    _send(pipe, run_id, [pb.Event(seq=0, run_start=run_start())])
    seq = 1
    for step in range(1, 6):
        _send(pipe, run_id, healthy_events(step, seq))
        seq += 2
    assert "step_out_of_order" not in _firing(process, run_id)
    for step in (2, 2, 3):  # new sequence numbers, old steps: a broken counter, not re-sends
        _send(pipe, run_id, healthy_events(step, seq))
        seq += 2
    finding = _firing(process, run_id)["step_out_of_order"]
    assert finding.evidence["reason"] == "out_of_order"
    assert finding.evidence["newest"] == "5"
    assert "3 step report(s) out of order" in finding.summary


def test_resent_batches_after_a_reconnect_are_not_out_of_order(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    """The control: re-sends carry their old sequence numbers, and a first step of a run
    resumed at step 90,000 is not too far."""
    process, pipe = sidecar
    run_id = "resent-steps"
    _send(pipe, run_id, [pb.Event(seq=0, run_start=run_start())])
    seq = 1
    for step in range(90_000, 90_006):
        events = healthy_events(step, seq)
        _send(pipe, run_id, events)
        _send(pipe, run_id, events)  # the same batch again, as after a reconnect
        seq += 2
    firing = _firing(process, run_id)
    assert "step_out_of_order" not in firing and "frozen_weights" not in firing
    status = process.run_status(run_id)
    assert status is not None and status.step == 90_005


def _absurd_step(step: int, seq: int) -> pb.Event:
    return pb.Event(seq=seq, step=pb.StepReport(
        step=step, learning_rate=1e-4, update_sq_sum=0.0, param_sq_sum=1.0, watched_tensors=4,
        watched_params=1000, optimizer_params=0, unchanged_tensors=4))


@pytest.mark.parametrize(("case", "first_real", "absurd", "reason"), [
    ("ahead", 1, 999_999 + 3, "outlier"),  # inside the jump bound from step 3
    ("first", None, 99_999_999, "outlier"),  # inside the first-step bound
    ("negative", 1, -2**62, "negative"),
])
def test_one_absurd_step_inside_the_bounds_does_not_blind_a_frozen_run(
    sidecar: tuple[SidecarProcess, Pipe], case: str, first_real: int | None, absurd: int,
    reason: str,
) -> None:
    """A step 999,999 ahead, a first step of 99,999,999 or a step of -2^62 used to make every
    later real step "out of order": the frozen run never got frozen_weights (or its STOP),
    only a no_optimizer_step page with the wrong cause. Now the negative step is refused and
    the outliers are dropped once the real reports go on from below them."""
    process, pipe = sidecar
    run_id = f"absurd-{case}"
    _send(pipe, run_id, [pb.Event(seq=0, run_start=run_start())])
    seq, step = 1, 1
    if first_real is not None:
        for step in range(1, 4):
            _send(pipe, run_id, frozen_events(step, seq))
            seq += 2
        step += 1
    _send(pipe, run_id, [_absurd_step(absurd, seq)])
    seq += 1
    last = step + 9
    for real in range(step, last + 1):
        _send(pipe, run_id, frozen_events(real, seq))
        seq += 2
    status = process.run_status(run_id)
    assert status is not None and status.step == last, status
    firing = _firing(process, run_id)
    assert "frozen_weights" in firing, sorted(firing)
    assert "no_optimizer_step" not in firing
    finding = firing["step_out_of_order"]
    assert finding.evidence["reason"] == reason, dict(finding.evidence)
    assert finding.evidence["step"] == str(absurd)


def test_a_healthy_run_with_one_outlier_step_keeps_counting_and_stays_quiet(
    sidecar: tuple[SidecarProcess, Pipe],
) -> None:
    """The control: the same outlier in a healthy run leaves only the reporting finding; the
    steps after it count again and no step verdict fires."""
    process, pipe = sidecar
    run_id = "outlier-healthy"
    start = run_start()
    start.membership.optimizer_params = start.membership.trainable_params = 1000
    start.membership.optimizer_tensors = 4
    _send(pipe, run_id, [pb.Event(seq=0, run_start=start)])
    seq = 1
    for step in range(1, 4):
        _send(pipe, run_id, healthy_events(step, seq))
        seq += 2
    _send(pipe, run_id, [_absurd_step(1_000_002, seq)])
    seq += 1
    for step in range(4, 14):
        _send(pipe, run_id, healthy_events(step, seq))
        seq += 2
    status = process.run_status(run_id)
    assert status is not None and status.step == 13
    assert set(_firing(process, run_id)) == {"step_out_of_order"}
