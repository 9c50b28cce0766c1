"""Baselines on real runs: a healthy run saved as a baseline, then the same recipe compared.

One sidecar (in this process, with a state database) watches every run of the module: the
baseline's run, healthy twins (another seed, another data order, another draw of the data, a
CPU hog beside the job) that must stay silent, and one run per fault that a ``baseline_*``
verdict must catch within 50 steps, naming the quantity, first as info, then as a warning
once the deviation has lasted ``baseline_escalate_steps`` points. Plain PyTorch loops under
``deadweight.watch`` (a few tenths of a second each), sending at most two events a batch so
the sidecar judges them at every step, as it does a real run whose steps take longer than the
client's flush; the RL recipe's ``beta`` change is a real GRPOTrainer run.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from deadweight.callbacks.stream_client import ClientSettings
from deadweight.sidecar.baseline.model import Baseline
from deadweight.sidecar.commands import cli
from deadweight.sidecar.model.finding import Finding
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from deadweight.sidecar.store.journal import Store
from tests.support import baseline_loops as loops
from tests.support.inprocess_sidecar import InProcessSidecar

pytestmark = pytest.mark.slow

#: Most steps a fault may run before its verdict.
DETECT_WITHIN = 50
#: The verdict each fault must draw, and the quantity (or module) it must name.
EXPECTED = {
    "frozen_stage_trains": ("baseline_modules_changed", "stage0"),
    "no_zero_grad": ("baseline_grad_norm", "grad_l2"),
    "warmup_stuck": ("baseline_learning_rate", "learning_rate"),
    "nll_on_logits": ("baseline_loss", "loss"),
    "same_batch": ("baseline_loss", "loss"),
    "head_lr_tiny": ("baseline_update_size", "head update ratio"),
}
HEALTHY = {"seed-1": dict(seed=1), "data-order-7": dict(data_seed=7),
           "seeds-2-3": dict(seed=2, data_seed=3), "other-data": dict(seed=1, dataset_seed=101)}
#: At most two events a batch: a step and its log, each batch judged on its own.
EACH_STEP = ClientSettings(batch_size=2)
SETTINGS = DetectorSettings()


@dataclass
class Results:
    state_dir: Path
    baseline: Path
    wide: Path
    sidecar: InProcessSidecar
    store: Store

    def baseline_verdicts(self, run_id: str) -> dict[str, Finding]:
        return {k: f for k, f in self.sidecar.fired(run_id).items()
                if k.startswith("baseline_")}

    def incidents(self, run_id: str, detector: str) -> list[tuple[str, int]]:
        """(severity, step) of each incident the detector opened on the run, oldest first
        (from the journal: a resolved info incident stays there)."""
        return [(i.severity, i.step) for i in self.store.incidents(run_id)
                if i.detector == detector]


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    folder = tmp_path_factory.mktemp("bl")
    state = folder / "state"
    state.mkdir()
    store = Store(state)
    sidecar = InProcessSidecar(folder / "dw.sock", registry=Registry(
        settings=SETTINGS, store=store)).start()
    try:
        loops.run("healthy-0", sidecar.address)
        loops.run("healthy-0b", sidecar.address, seed=5, data_seed=5)
        baseline, wide = folder / "recipe.baseline.json", folder / "wide.baseline.json"
        assert _cli("baseline", "save", "healthy-0", "--state-dir", str(state),
                    "--output", str(baseline))[0] == 0
        assert _cli("baseline", "save", "healthy-0", "healthy-0b", "--state-dir", str(state),
                    "--output", str(wide))[0] == 0
        for run_id, variation in HEALTHY.items():
            if run_id == "seeds-2-3":  # an unedited script: the environment names the baseline
                os.environ["DEADWEIGHT_BASELINE"] = str(baseline)
                try:
                    loops.run(run_id, sidecar.address, settings=EACH_STEP, **variation)
                finally:
                    del os.environ["DEADWEIGHT_BASELINE"]
            else:
                loops.run(run_id, sidecar.address, baseline=baseline, settings=EACH_STEP,
                          **variation)
        with loops.cpu_hog():
            loops.run("busy", sidecar.address, seed=4, data_seed=4, baseline=baseline,
                      settings=EACH_STEP)
        for fault in loops.FAULTS:
            loops.run(fault, sidecar.address, fault=fault, baseline=baseline,
                      settings=EACH_STEP)
        yield Results(state, baseline, wide, sidecar, store)
    finally:
        sidecar.stop()
        store.close()


def test_save_writes_a_small_versioned_readable_file(results: Results) -> None:
    document = json.loads(results.baseline.read_text())
    assert document["version"] == 2 and document["runs"] == ["healthy-0"]
    assert results.baseline.stat().st_size < 32 * 1024
    baseline = Baseline.from_json(results.baseline.read_text())
    assert baseline.steps == loops.STEPS
    # the frozen backbone never moved, so it is not among the kinds the optimizer moved
    assert {"stage1", "head"} <= {n for n, m in baseline.modules.items() if m.moved_share == 1}
    assert "stage0" not in baseline.modules
    for quantity in ("loss", "learning_rate", "update_rms", "grad_l2"):
        assert sum(b is not None for b in baseline.series[quantity]) == len(
            baseline.series[quantity]), quantity
    assert baseline.fingerprint["config.optimizer"] == "AdamW"
    assert baseline.trainable_share is not None and 0 < baseline.trainable_share.high < 1
    # the largest grad-norm jump over its recent level (version 2): a steady recipe's is small
    assert baseline.grad_norm_jump is not None and 1 < baseline.grad_norm_jump < 3


def test_show_prints_it(results: Results) -> None:
    code, out = _cli("baseline", "show", str(results.baseline))
    assert code == 0
    assert "runs: healthy-0" in out and "learning_rate:" in out and "stage1: moved 100%" in out
    assert "largest grad-norm jump over its recent level: " in out
    assert "slowest rank's own step time over the next rank's: -" in out  # one rank


def test_several_runs_widen_the_bands(results: Results) -> None:
    one = Baseline.from_json(results.baseline.read_text())
    two = Baseline.from_json(results.wide.read_text())
    assert two.runs == ("healthy-0", "healthy-0b")
    wider = 0
    for quantity in ("loss", "grad_l2"):
        for narrow, wide in zip(one.series[quantity], two.series[quantity], strict=True):
            assert narrow is not None and wide is not None
            assert wide.low <= narrow.low and wide.high >= narrow.high
            wider += wide.high - wide.low > narrow.high - narrow.low
    assert wider > 0


@pytest.mark.parametrize("run_id", [*HEALTHY, "busy"])
def test_healthy_runs_of_the_recipe_stay_silent(results: Results, run_id: str) -> None:
    """Judged at every step: no baseline verdict at all, info or warning."""
    assert len(results.sidecar.steps(run_id)) == loops.STEPS
    assert results.baseline_verdicts(run_id) == {}


@pytest.mark.parametrize("fault", loops.FAULTS)
def test_each_fault_is_caught_naming_the_quantity(results: Results, fault: str) -> None:
    detector, named = EXPECTED[fault]
    fired = results.baseline_verdicts(fault)
    assert detector in fired, f"{fault}: fired {sorted(fired)}"
    finding = fired[detector]
    assert finding.step <= DETECT_WITHIN
    assert named in finding.summary and "baseline" in finding.summary


@pytest.mark.parametrize("fault", [f for f in loops.FAULTS if f != "frozen_stage_trains"])
def test_each_trajectory_fault_is_info_first_and_a_warning_once_it_persists(
        results: Results, fault: str) -> None:
    """The fault's verdict opens as info within 50 steps, resolves as it steps up, and
    re-opens as a warning at least ``baseline_escalate_steps - baseline_steps`` points
    later; never critical."""
    detector, _ = EXPECTED[fault]
    opened = results.incidents(fault, detector)
    assert [severity for severity, _ in opened] == ["info", "warning"], opened
    (_, info_step), (_, warning_step) = opened
    assert info_step <= DETECT_WITHIN
    assert warning_step - info_step >= SETTINGS.baseline_escalate_steps - SETTINGS.baseline_steps
    finding = results.baseline_verdicts(fault)[detector]
    assert finding.severity == "warning" and "persistent" in finding.summary


def test_a_module_the_baseline_never_moved_is_a_warning_at_once(results: Results) -> None:
    """A frozen stage that trains is no trajectory out of a band that other data could move:
    its verdict is a warning from its first step."""
    opened = results.incidents("frozen_stage_trains", "baseline_modules_changed")
    assert opened and opened[0][0] == "warning" and opened[0][1] <= DETECT_WITHIN


def test_the_frozen_stage_names_the_module_and_its_update_ratio(results: Results) -> None:
    finding = results.baseline_verdicts("frozen_stage_trains")["baseline_modules_changed"]
    assert "stage0" in finding.evidence["modules"] and "stem" in finding.evidence["modules"]
    assert float(finding.evidence["update_ratio"]) > 0
    assert "never moved" in finding.summary
    # the recipe changed too (more parameters train): one info line says what differs
    info = results.baseline_verdicts("frozen_stage_trains")["baseline_recipe_changed"]
    assert "optimizer_params" in info.summary


def test_status_names_the_baseline(results: Results) -> None:
    from deadweight.sidecar.commands import status

    for run_id in ("seed-1", "seeds-2-3"):  # named by baseline=, and by DEADWEIGHT_BASELINE
        text = status.render(results.sidecar.registry.status(run_id))
        assert f"judged against baseline {results.baseline.name} (runs healthy-0;" in text
    assert "judged against" not in status.render(results.sidecar.registry.status("healthy-0"))


def test_status_json_names_the_baseline(results: Results) -> None:
    """``deadweight status --json`` over the sidecar's socket: each run's ``baseline`` key
    names the file and its runs as the text does, null for a run that names none."""
    from deadweight.sidecar.commands import status_json

    code, out = _cli("status", "--address", results.sidecar.address, "--json")
    assert code == 0
    runs = {r["run_id"]: r for r in json.loads(out)["runs"]}
    for run_id in ("seed-1", "seeds-2-3", "no_zero_grad"):
        assert tuple(runs[run_id]) == status_json.RUN_KEYS
        assert runs[run_id]["baseline"].startswith(
            f"{results.baseline.name} (runs healthy-0;"), runs[run_id]["baseline"]
    assert runs["healthy-0"]["baseline"] is None


def test_a_baseline_calibrates_negligible_updates(results: Results, tmp_path: Path) -> None:
    """A recipe whose healthy steps move its large weights by ~1e-7 of their norm: without a
    baseline negligible_updates fires on it; with one it stays silent (and so do the
    baseline_* detectors), while the same recipe at lr 1e-9 still fires."""
    sidecar = results.sidecar
    loops.large_weights_run("large-0", sidecar.address, lr=1e-5)
    assert "negligible_updates" in sidecar.fired("large-0")  # the fixed floor pages
    baseline = tmp_path / "large.baseline.json"
    assert _cli("baseline", "save", "large-0", "--state-dir", str(results.state_dir),
                "--output", str(baseline))[0] == 0
    loops.large_weights_run("large-1", sidecar.address, lr=1e-5, seed=1, baseline=baseline)
    assert sidecar.fired("large-1") == {}
    loops.large_weights_run("large-tiny-lr", sidecar.address, lr=1e-9, seed=1,
                            baseline=baseline)
    assert "negligible_updates" in sidecar.fired("large-tiny-lr")


def test_a_baseline_calibrates_grad_norm_spike(results: Results, tmp_path: Path) -> None:
    """A recipe whose healthy grad norm jumps ~20x its recent level every tenth batch (a
    shard of larger inputs): grad_norm_spike fires on it without a baseline; with one saved
    from a healthy run, another seed stays silent, while a corrupt batch that jumps further
    than any healthy one still fires, at its step."""
    sidecar = results.sidecar
    loops.spiky_run("spiky-0", sidecar.address)
    assert "grad_norm_spike" in sidecar.fired("spiky-0")  # the fixed bar fires at its batches
    baseline = tmp_path / "spiky.baseline.json"
    assert _cli("baseline", "save", "spiky-0", "--state-dir", str(results.state_dir),
                "--output", str(baseline))[0] == 0
    saved = Baseline.from_json(baseline.read_text())
    assert saved.grad_norm_jump is not None and saved.grad_norm_jump > 10
    loops.spiky_run("spiky-1", sidecar.address, seed=1, baseline=baseline)
    assert sidecar.fired("spiky-1") == {}
    loops.spiky_run("spiky-outlier", sidecar.address, seed=1, baseline=baseline,
                    outlier_step=25, settings=EACH_STEP)
    spikes = [i for i in results.store.incidents("spiky-outlier")
              if i.detector == "grad_norm_spike"]
    assert [i.step for i in spikes] == [25], spikes
    assert float(spikes[0].evidence["baseline_jump"]) == pytest.approx(
        saved.grad_norm_jump * (1 + SETTINGS.baseline_margin), rel=1e-4)


GRPO_STEPS = 24


def _grpo(results: Results, tiny: tuple[Path, Path], run_id: str, folder: Path, beta: float,
          seed: int, baseline: Path | None) -> None:
    from transformers import AutoModelForCausalLM

    from deadweight.demo import runs

    model_dir, _ = tiny
    runs.grpo_trainer(AutoModelForCausalLM.from_pretrained(model_dir), model_dir,
                      folder / run_id, [results.sidecar.callback(run_id, baseline=baseline,
                                                                 settings=EACH_STEP)],
                      beta=beta, steps=GRPO_STEPS, save_steps=GRPO_STEPS, seed=seed,
                      per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, peft_config=runs.lora_config()).train()


def test_grpo_beta_changed_to_zero_is_caught(results: Results, tiny: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    """GRPO's beta 0.04 (the recipe) changed to 0: kl is no longer logged; a healthy twin
    with another seed stays silent."""
    _grpo(results, tiny, "grpo-0", tmp_path, 0.04, 0, None)
    baseline = tmp_path / "grpo.baseline.json"
    assert _cli("baseline", "save", "grpo-0", "--state-dir", str(results.state_dir),
                "--output", str(baseline))[0] == 0
    assert "kl" in Baseline.from_json(baseline.read_text()).series
    _grpo(results, tiny, "grpo-seed-1", tmp_path, 0.04, 1, baseline)
    assert results.baseline_verdicts("grpo-seed-1") == {}
    _grpo(results, tiny, "grpo-beta-0", tmp_path, 0.0, 0, baseline)
    fired = results.baseline_verdicts("grpo-beta-0")
    assert "baseline_rl_signals" in fired, sorted(fired)
    finding = fired["baseline_rl_signals"]
    assert "kl" in finding.summary
    # info from the baseline_steps-th log without kl, a warning from the escalate_steps-th
    opened = results.incidents("grpo-beta-0", "baseline_rl_signals")
    assert [severity for severity, _ in opened] == ["info", "warning"], opened
    assert opened[0][1] <= DETECT_WITHIN and finding.severity == "warning"
    assert opened[1][1] - opened[0][1] >= (SETTINGS.baseline_escalate_steps
                                           - SETTINGS.baseline_steps)
    assert "config.beta: 0.04 -> 0" in fired["baseline_recipe_changed"].summary
    # the run summary beside its checkpoint says which baseline it was judged against
    _, out = _cli("inspect", str(tmp_path / "grpo-beta-0" / f"checkpoint-{GRPO_STEPS}"))
    assert "was judged against baseline grpo.baseline.json (runs grpo-0;" in out, out


def test_the_report_draws_the_baseline_behind_the_run(results: Results) -> None:
    from deadweight.sidecar.commands import report

    store = Store(results.state_dir)
    try:
        page = report.render(report.load(store, "no_zero_grad"))
        plain = report.render(report.load(store, "healthy-0"))
    finally:
        store.close()
    assert f"Compared with baseline {results.baseline.name}" in page
    section = page[page.index("id=baseline"):]
    assert "the band healthy runs of this recipe showed" in section
    assert section.index("<svg") < section.index("<h2")  # the overlay is drawn in it
    assert "baseline_grad_norm" in page
    assert "Compared with baseline" not in plain  # the baseline's own run named none
