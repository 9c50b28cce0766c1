"""The per-step history in the state database: written a batch at a time, bounded, read back
as figures whatever form a row was kept in."""

from __future__ import annotations

from pathlib import Path

import pytest

from deadweight.proto import pb
from deadweight.sidecar.model.step_point import StepPoint
from deadweight.sidecar.store import history_tables
from deadweight.sidecar.store.journal import Store


def _row(step: int) -> tuple[int, float, bytes]:
    report = pb.StepReport(step=step, learning_rate=1e-4, update_sq_sum=float(step),
                           watched_tensors=2, watched_params=10)
    return step, float(step), report.SerializeToString()


def test_history_stays_bounded_over_restarts_and_keeps_its_whole_span(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 50
    monkeypatch.setattr(history_tables, "MAX_HISTORY_ROWS", limit)
    store = Store(tmp_path)
    for first in range(1, 301, 30):
        store.add_step_history("run", [_row(s) for s in range(first, first + 30)])
    store.add_history("run", "log", 3, {"loss": 1.5}, 3.0)
    store.close()
    store = Store(tmp_path)  # a restarted sidecar counts the rows it finds
    store.add_step_history("run", [_row(s) for s in range(301, 331)])
    rows = store.history("run", "step")
    steps = [step for step, _, _ in rows]
    assert len(rows) <= limit + 30
    assert steps[0] == 1 and steps[-1] == 330 and steps == sorted(steps)
    _, at, figures = rows[-1]
    point = StepPoint.from_report(pb.StepReport.FromString(_row(330)[2]), at)
    assert figures["update_norm"] == point.update_norm and figures["watched_tensors"] == 2.0
    assert store.history("run", "log") == [(3, 3.0, {"loss": 1.5})]
    for step in range(4, 4 + 2 * limit):  # logs are thinned the same way, a row a step
        store.add_history("run", "log", step, {"loss": float(step)}, float(step))
    logs = [step for step, _, _ in store.history("run", "log")]
    assert len(logs) <= limit and logs[0] == 3 and logs[-1] == 3 + 2 * limit


def test_a_batch_of_steps_is_one_row_and_reads_back_step_by_step(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.add_step_history("run", [_row(s) for s in range(1, 257)])
    store.add_step_history("run", [(257, 257.0, '{"update_norm": 2.5}')])  # a sharded step
    (rows,) = store._read("SELECT COUNT(*) FROM step_batches WHERE run_id='run'")
    assert rows == (2,)
    steps = store.history("run", "step")
    assert [s for s, _, _ in steps] == list(range(1, 258))
    assert steps[9][1] == 10.0 and steps[9][2]["watched_tensors"] == 2.0
    assert steps[-1] == (257, 257.0, {"update_norm": 2.5})


def test_rows_of_an_older_sidecar_and_a_damaged_row_still_read(tmp_path: Path) -> None:
    store = Store(tmp_path)
    old = pb.StepReport(step=1, update_sq_sum=4.0, watched_tensors=1).SerializeToString()
    insert = "INSERT INTO history (run_id, kind, step, time, series) VALUES "
    store._write(insert + "('run', 'step', 1, 1.0, ?)", (old,))
    store._write(insert + "('run', 'step', 2, 2.0, ?)", ('{"update_norm": 1.0}',))
    store.add_step_history("run", [_row(3), _row(4)])
    store.add_step_history("run", [_row(5), _row(6)])
    store._write("UPDATE step_batches SET packed = substr(packed, 1, length(packed) - 5) "
                 "WHERE first_step = 5")
    steps = store.history("run", "step")
    assert [s for s, _, _ in steps] == [1, 2, 3, 4, 5]  # step 6 was cut short
    assert steps[0][2]["update_norm"] == 2.0 and steps[1][2] == {"update_norm": 1.0}


def test_a_negative_sum_of_squares_is_kept_as_nan_not_refused(tmp_path: Path) -> None:
    """A client's report with a negative group sum (no tensor gives one) still goes to the
    history, its module norm as NaN; it used to raise from a complex square root."""
    import math

    from deadweight.sidecar.store import history

    report = pb.StepReport(step=1, learning_rate=1e-4, update_sq_sum=1e-6, groups=[
        pb.GroupUpdate(name="q_proj", kind="module", update_sq_sum=-1.0, tensors=2),
        pb.GroupUpdate(name="v_proj", kind="module", update_sq_sum=4.0, tensors=2)])
    series = history.step_series(StepPoint.from_report(report, 1.0), report)
    assert math.isnan(series["module/q_proj/update_norm"])
    assert series["module/v_proj/update_norm"] == 2.0
    store = Store(tmp_path)
    store.add_step_history("run", [(1, 1.0, history.encode_step(
        StepPoint.from_report(report, 1.0), report, False))])
    [(step, _, figures)] = store.history("run", "step")
    assert step == 1 and math.isnan(figures["module/q_proj/update_norm"])
