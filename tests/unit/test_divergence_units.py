"""loss_divergence and grad_norm_spike over recorded log series: GRPO's loss near 0, a warmup,
a noisy healthy grad norm stay silent; the series of the real failures fire."""

from __future__ import annotations

from deadweight.sidecar.detectors.divergence import GradNormSpike, LossDivergence
from deadweight.sidecar.model.run_state import RunState
from deadweight.sidecar.model.settings import DetectorSettings

SETTINGS = DetectorSettings()


def _run(key: str, values: list[float]) -> RunState:
    run = RunState("units")
    for step, value in enumerate(values, start=1):
        run.record_log(step, {key: value})
    return run


def _fires(detector: LossDivergence | GradNormSpike, key: str, values: list[float]) -> bool:
    verdict = detector.evaluate(_run(key, values), SETTINGS)
    return verdict is not None and verdict.firing


def test_loss_divergence_on_the_real_series_and_not_on_healthy_ones() -> None:
    # the too-high lr: 5.73 -> 185, finite all along
    assert _fires(LossDivergence(), "loss", [5.73, 9.1, 31.0, 64.0, 120.0, 185.0])
    verdict = LossDivergence().evaluate(_run("loss", [5.73, 9.1, 31.0, 64.0, 120.0]), SETTINGS)
    assert verdict is not None and verdict.step == 5  # the second log above 10x
    # GRPO: a loss around 0, signs changing, relative swings of 100x
    grpo = [0.0, 0.0021, -0.013, 0.04, -0.002, 0.11, -0.07, 0.0, 0.3, -0.2]
    assert not _fires(LossDivergence(), "loss", grpo)
    # warmup: the loss first rises a little, then falls
    assert not _fires(LossDivergence(), "loss", [5.7, 5.9, 6.4, 7.1, 6.0, 4.2, 3.1, 2.5])
    # one outlier log is not a divergence
    assert not _fires(LossDivergence(), "loss", [5.7, 5.5, 5.2, 80.0, 5.0, 4.9])


def test_grad_norm_spike_adapts_to_the_run_and_passes() -> None:
    noisy = [3.18, 10.6, 3.65, 19.7, 3.9, 2.67, 4.46, 11.2, 2.62, 3.36]  # a healthy SFT run
    assert not any(_fires(GradNormSpike(), "grad_norm", noisy[:n]) for n in range(1, 11))
    steady = [0.05, 0.052, 0.049, 0.051, 0.05, 0.05, 0.053, 0.048]
    assert not _fires(GradNormSpike(), "grad_norm", steady)
    assert _fires(GradNormSpike(), "grad_norm", [*steady, 0.6])  # 12x its level
    assert not _fires(GradNormSpike(), "grad_norm", [*steady, 0.6, 0.05])  # passed
    assert not _fires(GradNormSpike(), "grad_norm", [0.05, 0.06, 0.9])  # still warming up


def _stepped_run(updates: list[tuple[float, float]], losses: list[float]) -> RunState:
    """A run whose optimizer steps moved (update_sq_sum, param_sq_sum) over 1024 params."""
    from deadweight.proto import pb
    from deadweight.sidecar.model.step_point import StepPoint

    run = _run("loss", losses)
    rank = run.rank(0)
    for step, (update_sq, param_sq) in enumerate(updates, start=1):
        rank.steps.append(StepPoint.from_report(pb.StepReport(
            step=step, learning_rate=20.0, update_sq_sum=update_sq, param_sq_sum=param_sq,
            watched_params=1024, optimizer_params=1024, watched_tensors=8), 0.0))
    return run


def test_loss_divergence_names_steps_larger_than_any_weight() -> None:
    flat = [5.72, 5.79, 5.82, 5.81, 5.83]  # the loss of a LoRA at lr 20: no tenfold rise
    # 13 per element a step (1024 params), weights of norm 554..1317: an absurd rate
    blown = [(13.0 ** 2 * 1024, 554.0 ** 2), (13.0 ** 2 * 1024, 963.0 ** 2),
             (12.0 ** 2 * 1024, 1317.0 ** 2)]
    verdict = LossDivergence().evaluate(_stepped_run(blown, flat), SETTINGS)
    assert verdict is not None and verdict.firing and "far too high" in verdict.summary
    # the same steps while the loss improves: a verdict on the loss alone would be needed
    falling = [5.72, 5.1, 4.6, 4.0, 3.5]
    assert not LossDivergence().evaluate(_stepped_run(blown, falling), SETTINGS).firing
    # a zero-initialised tensor trained alone: each step is all of its norm, yet 1e-3 per
    # element (lr 1e-3): no weight is blown up
    small = [(1e-6 * 1024, (1e-3 * s) ** 2 * 1024) for s in (1, 2, 3)]
    assert not LossDivergence().evaluate(_stepped_run(small, flat), SETTINGS).firing
