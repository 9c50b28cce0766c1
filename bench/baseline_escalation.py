"""When a baseline catches each acceptance fault, at info and at warning, and what healthy
runs of the same recipe draw: the figures ``baseline_escalate_steps`` was chosen from.

Real runs against one in-process sidecar with a state database (as
``tests/integration/test_baseline.py``): the plain PyTorch recipe of
``tests/support/baseline_loops.py`` saved as a baseline from one run, then healthy twins
(other seeds and data orders, a CPU hog beside the job, another draw of the data) and one run
per fault; GRPO (tiny Qwen2, LoRA) with beta 0.04 saved as a baseline, healthy seeds, and
beta 0. For each run: every ``baseline_*`` incident (severity and step, from the journal),
and for the healthy ones the longest run of consecutive points each compared quantity lay
outside its band (what a healthy run does; the escalation must lie above it). The loops
send at most two events a batch, so the sidecar judges them at every step (by default a fast
loop's steps arrive many a batch, and a verdict's first evaluation can already be a warning).

``python -m bench.baseline_escalation [--seeds N] [--grpo-steps N]``
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
from collections.abc import Iterable
from contextlib import redirect_stdout
from pathlib import Path

from deadweight.callbacks.stream_client import ClientSettings
from deadweight.sidecar.baseline.live import deviation
from deadweight.sidecar.baseline.model import Baseline
from deadweight.sidecar.baseline.quantities import (
    LOG_QUANTITIES,
    MARGIN_SCALE,
    step_values,
)
from deadweight.sidecar.commands import cli
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.support import baseline_loops as loops
from tests.support.inprocess_sidecar import InProcessSidecar


def _save(state: Path, out: Path, *runs: str) -> Path:
    with redirect_stdout(io.StringIO()):
        code = cli.main(["baseline", "save", *runs, "--state-dir", str(state),
                         "--output", str(out)])
    assert code == 0, f"baseline save {runs} failed"
    return out


def longest_outside(store: Store, run_id: str, baseline: Baseline,
                    settings: DetectorSettings) -> dict[str, int]:
    """Per compared quantity, the longest run of consecutive points outside its band, as the
    detectors walk them (a streak on one side; the walk capped at its 64 points)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for step, _, figures in store.history(run_id, "step"):
        for quantity, value in step_values(figures).items():
            series.setdefault(quantity, []).append((step, value))
    for step, _, values in store.history(run_id, "log"):
        for quantity in LOG_QUANTITIES:
            if quantity in values:
                series.setdefault(quantity, []).append((step, values[quantity]))
    longest: dict[str, int] = {}
    for quantity, points in sorted(series.items()):
        if quantity not in baseline.series:
            continue
        relative = settings.baseline_margin * MARGIN_SCALE.get(quantity, 1.0)
        best = 0
        for end in range(1, len(points) + 1):
            found = deviation(baseline, quantity, reversed(points[:end]), baseline.steps, 1,
                              relative)
            best = max(best, found.points if found else 0)
        longest[quantity] = best
    return longest


def incidents(store: Store, run_id: str) -> list[tuple[str, str, int]]:
    """(detector, severity, step) of the run's baseline_* incidents, in the order opened."""
    return [(i.detector, i.severity, i.step) for i in store.incidents(run_id)
            if i.detector.startswith("baseline_") and i.detector != "baseline_recipe_changed"]


def first(found: Iterable[tuple[str, str, int]], severity: str) -> str:
    steps = [(step, detector) for detector, sev, step in found if sev == severity]
    return "-" if not steps else "{} ({})".format(*min(steps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline_escalation")
    parser.add_argument("--seeds", type=int, default=8, help="healthy seeds of the loop")
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--no-grpo", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny GRPO model is built, never fetched
    import torch

    torch.set_num_threads(1)
    settings = DetectorSettings()
    folder = Path(tempfile.mkdtemp(prefix="dw-escalation-"))
    each_step = ClientSettings(batch_size=2)
    state = folder / "state"
    state.mkdir()
    store = Store(state)
    sidecar = InProcessSidecar(folder / "dw.sock", registry=Registry(
        settings=settings, store=store)).start()
    print(f"baseline_escalation: baseline_steps={settings.baseline_steps} "
          f"baseline_escalate_steps={settings.baseline_escalate_steps} "
          f"baseline_margin={settings.baseline_margin}; loop of {loops.STEPS} steps")
    try:
        loops.run("healthy-0", sidecar.address)
        baseline_file = _save(state, folder / "recipe.baseline.json", "healthy-0")
        baseline = Baseline.from_json(baseline_file.read_text())
        healthy: dict[str, dict[str, int]] = {
            f"seed-{s}": dict(seed=s, data_seed=s) for s in range(1, args.seeds + 1)}
        healthy["data-order-7"] = dict(data_seed=7)
        healthy |= {f"other-data-{s}": dict(seed=s, data_seed=s, dataset_seed=100 + s)
                    for s in range(1, 4)}
        for run_id, variation in healthy.items():
            loops.run(run_id, sidecar.address, baseline=baseline_file, settings=each_step,
                      **variation)
        for s in (1, 2):
            with loops.cpu_hog():
                loops.run(f"busy-{s}", sidecar.address, seed=10 + s, data_seed=10 + s,
                          baseline=baseline_file, settings=each_step)
            healthy[f"busy-{s}"] = {}
        for fault in loops.FAULTS:
            loops.run(fault, sidecar.address, fault=fault, baseline=baseline_file,
                      settings=each_step)
        print("\nhealthy twins (baseline healthy-0): incidents, and the longest streak "
              "outside the band per quantity")
        infos = warnings = 0
        for run_id in healthy:
            found = incidents(store, run_id)
            infos += sum(s == "info" for _, s, _ in found)
            warnings += sum(s == "warning" for _, s, _ in found)
            streaks = longest_outside(store, run_id, baseline, settings)
            print(f"  {run_id:<14} incidents {found or 'none'}; longest outside: " + ", ".join(
                f"{q} {n}" for q, n in streaks.items()))
        print(f"  total over {len(healthy)} healthy runs: {infos} info, {warnings} warning")
        print("\nfaults: first info step (detector), first warning step (detector)")
        for fault in loops.FAULTS:
            found = incidents(store, fault)
            streaks = longest_outside(store, fault, baseline, settings)
            print(f"  {fault:<20} info {first(found, 'info'):<34} warning "
                  f"{first(found, 'warning'):<34} longest outside: " + ", ".join(
                      f"{q} {n}" for q, n in streaks.items() if n))
            print(f"  {'':<20} every incident: {found}")
        if not args.no_grpo:
            _grpo(sidecar, store, state, folder, args.grpo_steps)
    finally:
        sidecar.stop()
        store.close()


def _grpo(sidecar: InProcessSidecar, store: Store, state: Path, folder: Path,
          steps: int) -> None:
    from transformers import AutoModelForCausalLM

    from deadweight.demo import runs

    model_dir, _ = runs.prepare(folder / "models", "qwen2")

    def grpo(run_id: str, beta: float, seed: int, baseline: Path | None) -> None:
        runs.grpo_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir,
                          folder / run_id, [sidecar.callback(run_id, baseline=baseline)],
                          beta=beta, steps=steps, save_steps=steps, seed=seed,
                          per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, peft_config=runs.lora_config()).train()

    grpo("grpo-0", 0.04, 0, None)
    baseline = _save(state, folder / "grpo.baseline.json", "grpo-0")
    print(f"\nGRPO ({steps} steps, baseline grpo-0 at beta 0.04)")
    for seed in (1, 2, 3):
        grpo(f"grpo-seed-{seed}", 0.04, seed, baseline)
        print(f"  grpo-seed-{seed:<5} incidents {incidents(store, f'grpo-seed-{seed}') or 'none'}")
    grpo("grpo-beta-0", 0.0, 0, baseline)
    found = incidents(store, "grpo-beta-0")
    print(f"  grpo-beta-0     info {first(found, 'info'):<34} warning {first(found, 'warning')}"
          f"  (all: {found})")


if __name__ == "__main__":
    main()
