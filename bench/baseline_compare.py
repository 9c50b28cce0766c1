"""What comparing a run with its baseline costs the sidecar, beside what its detectors cost.

Nothing new runs on the training thread for a baseline: the callback sends the same step
reports and logs as before, plus the baseline's few kilobytes once in the RunStart. The cost is
the sidecar's: the seven ``baseline_*`` detectors at every evaluation of a run (a batch), and
the per-module movement a step's groups now keep when decoded. Measured here on a run whose
256-step window is full (a LoRA-like step with 8 module kinds, a log per step), healthy (the
detectors' walks stop at the newest step) and deviating on every figure (the walks run to
their streak's end), beside every other detector on the same run.

``python -m bench.baseline_compare``
"""

from __future__ import annotations

import math
import time

from deadweight.proto import pb
from deadweight.sidecar import detectors
from deadweight.sidecar.baseline.model import BINS, Band, Baseline, ModuleFacts
from deadweight.sidecar.model.run_state import RunState
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.model.step_point import StepGroups, StepPoint

STEPS = 256
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "lm_head")


def _report(step: int, scale: float) -> pb.StepReport:
    return pb.StepReport(
        step=step, learning_rate=2e-4, update_sq_sum=1e-6 * scale, param_sq_sum=4.0,
        watched_tensors=16, watched_params=100_000, optimizer_params=100_000,
        grad_sq_sum=0.25 * scale, grad_measured=True,
        groups=[pb.GroupUpdate(name=k, kind="module", update_sq_sum=1e-7 * scale, tensors=2,
                               elements=12_500, dtype="float32") for k in KINDS])


def _baseline() -> Baseline:
    flat = {"learning_rate": Band(2e-4, 2e-4, 2e-4), "update_rms": Band(3e-6, 3.2e-6, 3.4e-6),
            "grad_l2": Band(0.45, 0.5, 0.55), "relative_update": Band(4e-4, 5e-4, 6e-4),
            "loss": Band(1.0, 1.2, 1.4), "grad_norm": Band(0.45, 0.5, 0.55)}
    return Baseline(runs=("a",), steps=STEPS, fingerprint={"trainer": "T"},
                    # each kind's update over lr in _report: sqrt(1e-7 / 12500) / 2e-4
                    modules={k: ModuleFacts(1.0, 2, Band(0.013, 0.0141, 0.015)) for k in KINDS},
                    series={q: tuple(b for _ in range(BINS)) for q, b in flat.items()},
                    name="bench.baseline.json")


def _run(scale: float, baseline: bool) -> RunState:
    start = pb.RunStart(trainer="T", config={"learning_rate": 2e-4})
    if baseline:
        start.baseline, start.baseline_name = _baseline().to_json(), "bench.baseline.json"
    run = RunState("bench", start=start)
    rank = run.rank(0)
    for step in range(1, STEPS + 1):
        report = _report(step, scale)
        rank.steps.append(StepPoint.from_report(report, float(step), report.SerializeToString()))
        run.record_log(step, {"loss": 1.2 * math.sqrt(scale), "grad_norm": 0.5 * math.sqrt(scale)})
    rank.step = STEPS
    return run


def _per_evaluation(run: RunState, chosen: list[detectors.Detector], repeats: int) -> float:
    settings = DetectorSettings()
    for detector in chosen:  # warm: the baseline parsed, the newest groups decoded
        detector.evaluate(run, settings)
    best = math.inf
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(repeats):
            for detector in chosen:
                detector.evaluate(run, settings)
        best = min(best, (time.perf_counter() - began) / repeats)
    return best


def _decode(report: bytes, repeats: int = 20_000) -> float:
    began = time.perf_counter()
    for _ in range(repeats):
        StepGroups.encoded(report).modules  # noqa: B018 (the decode is what is timed)
    return (time.perf_counter() - began) / repeats


def main() -> None:
    ours = [d for d in detectors.ALL if d.id.startswith("baseline_")]
    others = [d for d in detectors.ALL if not d.id.startswith("baseline_")]
    print("baseline_compare: sidecar seconds per evaluation of one run (256 steps kept)")
    for words, scale in (("healthy", 1.0), ("deviating", 100.0)):
        run = _run(scale, baseline=True)
        mine = _per_evaluation(run, ours, 200)
        rest = _per_evaluation(run, others, 200)
        print(f"  {words:<10} baseline_* detectors {mine * 1e6:8.1f} us   every other detector "
              f"{rest * 1e6:8.1f} us   ratio {mine / rest:.2f}")
    plain = _run(1.0, baseline=False)
    print(f"  no baseline  baseline_* detectors {_per_evaluation(plain, ours, 200) * 1e6:8.1f} us")
    report = _report(1, 1.0).SerializeToString()
    print(f"  a step's groups decoded once (8 module kinds, with their movement): "
          f"{_decode(report) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
