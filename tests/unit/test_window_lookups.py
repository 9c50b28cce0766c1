"""The lookups detectors use at every batch instead of mapping the whole window.

``step_at``, ``steps_after`` and ``RunState.logged_at`` answer what a ``{step: point}`` map or
a filtered copy of the window answered, for a window in order and (logs) out of order; the
detectors built on them still fire and stay silent on the same feeds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deadweight.proto import pb
from deadweight.sidecar.detectors.base import step_at, steps_after
from deadweight.sidecar.model.run_state import RunState
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.model.step_point import StepPoint
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.unit.test_detectors_units import Feed


def _point(step: int) -> StepPoint:
    return StepPoint.from_report(pb.StepReport(step=step, learning_rate=1e-4), float(step))


def test_step_at_and_steps_after_match_a_map_and_a_filter() -> None:
    steps = [_point(s) for s in (1, 2, 4, 7, 8, 20)]
    by_step = {p.step: p for p in steps}
    for step in range(0, 23):
        assert step_at(steps, step) is by_step.get(step)
        assert list(steps_after(steps, step)) == [p for p in steps if p.step > step]
    assert step_at([], 3) is None and list(steps_after([], 3)) == []


def _last_finite(entries: list[tuple[int, float]], step: int) -> float | None:
    """What ``dict(finite_history(...)).get(step)`` answered."""
    return dict((s, v) for s, v in entries if math.isfinite(v)).get(step)


@pytest.mark.parametrize("steps", [
    [1, 2, 2, 2, 3, 5, 5, 9],          # in step order, repeats (an eval log at the same step)
    [1, 2, 5, 3, 5, 2, 9, 1],          # out of order: a log went back
], ids=["ordered", "unordered"])
def test_logged_at_is_the_last_finite_value_at_the_step(steps: list[int]) -> None:
    run = RunState("r")
    values = [0.5, math.nan, 0.0, math.inf, 1.5, 0.0, -math.inf, 2.0]
    entries = list(zip(steps, values, strict=True))
    for step, value in entries:
        run.record_log(step, {"grad_norm": value})
    assert ("grad_norm" in run.unordered_log_keys) == (steps != sorted(steps))
    for step in range(0, 11):
        assert run.logged_at("grad_norm", step) == _last_finite(entries, step)
    assert run.logged_at("loss", 1) is None
    assert run.last_logged("grad_norm") == entries[-1]


def test_config_is_read_again_for_a_new_run_start() -> None:
    run = RunState("r")
    assert dict(run.config) == {}
    run.start = pb.RunStart(config={"learning_rate": 1e-4})
    assert run.config["learning_rate"] == 1e-4
    assert run.config is run.config  # read once per RunStart
    run.start = pb.RunStart(config={"learning_rate": 2e-4, "warmup_steps": 3})
    assert dict(run.config) == {"learning_rate": 2e-4, "warmup_steps": 3}
    with pytest.raises(TypeError):
        run.config["learning_rate"] = 0.0  # type: ignore[index]


def test_zero_gradient_fires_and_stays_silent_with_logs_out_of_order() -> None:
    """grad_norm 0 for the newest logs fires even when an older log arrives late; a late
    non-zero log at an old step does not end the streak, a fresh one does."""
    registry = Registry(settings=DetectorSettings(zero_gradient_logs=3))
    feed = Feed(registry, trainer="SFTTrainer")
    for step in range(1, 7):
        feed.step(step)
    feed.log(5, grad_norm=0.0)
    feed.log(2, grad_norm=0.7)  # late, out of order
    feed.log(6, grad_norm=0.0)
    feed.log(6, grad_norm=math.nan)  # non-finite: neither counts nor breaks
    assert not _firing(registry, "zero_gradient")
    feed.log(6, grad_norm=0.0)
    # newest first: 0 (6), nan skipped, 0 (6), 0.7 (2) breaks: a streak of 2 < 3
    assert not _firing(registry, "zero_gradient")
    feed.step(7)
    feed.log(7, grad_norm=0.0)
    assert _firing(registry, "zero_gradient")
    feed.step(8)
    feed.log(8, grad_norm=0.4)
    assert not _firing(registry, "zero_gradient")


def _firing(registry: Registry, detector: str) -> bool:
    finding = registry.findings("r").get(detector)
    return finding is not None and finding.firing


def test_a_batch_of_logs_is_one_history_write(tmp_path: Path) -> None:
    """Every log of a batch reaches the history, in one transaction."""
    store = Store(tmp_path)
    registry = Registry(store=store)
    feed = Feed(registry, trainer="SFTTrainer")
    commits = []
    store._db.set_trace_callback(  # the statements the batch ran
        lambda sql: commits.append(sql) if sql.strip().upper() == "COMMIT" else None)
    events = [pb.Event(seq=feed.seq + 1 + i, log=pb.LogReport(step=i, values={"loss": 2.0 - i}))
              for i in range(6)]
    feed.seq += 6
    assert not registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=events)).error
    assert len(commits) == 1
    assert [step for step, _, _ in store.history("r", "log")] == list(range(6))
    assert [figures["loss"] for _, _, figures in store.history("r", "log")] == [
        2.0 - i for i in range(6)]

