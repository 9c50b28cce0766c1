"""The baseline file, its comparison rule and the client's reading of it, piece by piece."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deadweight.callbacks import baseline_file
from deadweight.proto import pb
from deadweight.sidecar.baseline import fingerprint as prints
from deadweight.sidecar.baseline.live import MAX_WALK, deviation, label, parsed, side
from deadweight.sidecar.baseline.model import (
    BINS,
    MAX_BASELINE_BYTES,
    Band,
    Baseline,
    BaselineError,
    ModuleFacts,
    bin_of,
)
from deadweight.sidecar.baseline.quantities import jump, largest_jump
from deadweight.sidecar.model.settings import DetectorSettings
from deadweight.sidecar.registry import Registry
from tests.support.detector_feed import MEMBERSHIP, Feed


def _baseline(**series: tuple[Band | None, ...]) -> Baseline:
    return Baseline(runs=("a",), steps=BINS, fingerprint={"trainer": "T"},
                    modules={"head": ModuleFacts(1.0, 2, Band(0.5, 1.0, 1.5))}, series=series,
                    name="b.json")


def test_the_file_round_trips_and_says_its_version() -> None:
    original = _baseline(loss=tuple(Band(1.0, 1.5, 2.0) for _ in range(BINS)))
    text = original.to_json()
    document = json.loads(text)
    assert document["version"] == 2 and document["kind"] == "deadweight.baseline"
    again = Baseline.from_json(text, name="b.json")
    assert again == original
    jumpy = dataclasses.replace(original, grad_norm_jump=18.5)
    assert Baseline.from_json(jumpy.to_json()).grad_norm_jump == 18.5


def test_a_version_1_file_still_reads_without_the_figures_version_2_added() -> None:
    document = json.loads(_baseline(loss=tuple(Band(1.0, 1.5, 2.0) for _ in range(BINS))
                                    ).to_json())
    document["version"] = 1
    del document["grad_norm_jump"]
    old = Baseline.from_json(json.dumps(document))
    assert old.version == 1 and old.grad_norm_jump is None and old.series["loss"][0] == Band(
        1.0, 1.5, 2.0)
    document["grad_norm_jump"] = -3
    with pytest.raises(BaselineError, match="damaged"):
        Baseline.from_json(json.dumps(document))


def test_a_jump_is_a_value_over_the_geometric_mean_of_the_five_before() -> None:
    values = [1.0, 4.0, 1.0, 4.0, 1.0, 8.0, 2.0]
    assert jump(values, 4) is None  # fewer than five before it
    assert jump(values, 5) == pytest.approx(8.0 / 2 ** (4 / 5))
    assert largest_jump(values) == pytest.approx(8.0 / 2 ** (4 / 5))
    assert largest_jump(values[:5]) is None


def _spike_feed(baseline_jump: float | None) -> Feed:
    """A raw loop's run whose measured gradient sits at 1.0 for ten steps, then jumps to 20
    (a spike by the fixed bar: z = ln 20 / 0.25 = 12), judged against a baseline whose
    healthy runs jumped baseline_jump at most (None: no baseline)."""
    named = {} if baseline_jump is None else {
        "baseline": Baseline(runs=("healthy",), steps=20, fingerprint={}, modules={},
                             series={}, grad_norm_jump=baseline_jump).to_json(),
        "baseline_name": "recipe.baseline.json"}
    feed = Feed(Registry(settings=DetectorSettings()), trainer="watch", **named)
    for step in range(1, 12):
        grad = 20.0 if step == 11 else 1.0
        feed.step(step, grad_sq_sum=grad * grad, grad_measured=True)
    return feed


@pytest.mark.parametrize(("baseline_jump", "fires"), [
    (None, True),  # the fixed bar
    (30.0, False),  # healthy runs of the recipe jumped 30x: 20x is theirs
    (17.0, False),  # 20x is within a quarter (baseline_margin) beyond their 17x
    (10.0, True),  # 20x is beyond anything healthy runs did
    (1.01, True),  # a steady recipe's baseline never makes the detector more sensitive
])
def test_a_baseline_quiets_grad_norm_spike_only_where_healthy_runs_jumped_as_far(
        baseline_jump: float | None, fires: bool) -> None:
    assert ("grad_norm_spike" in _spike_feed(baseline_jump).fired()) is fires


def test_a_baseline_never_makes_grad_norm_spike_fire_where_the_fixed_bar_does_not() -> None:
    """A 2x jump of a steady norm is under the fixed bar (z = ln 2 / 0.25 = 2.8 < 4): a
    baseline whose healthy jumps were tiny does not make it a spike."""
    feed = Feed(Registry(settings=DetectorSettings()), trainer="watch",
                baseline=Baseline(runs=("h",), steps=20, fingerprint={}, modules={},
                                  series={}, grad_norm_jump=1.01).to_json(),
                baseline_name="b.json")
    for step in range(1, 12):
        grad = 2.0 if step == 11 else 1.0
        feed.step(step, grad_sq_sum=grad * grad, grad_measured=True)
    assert "grad_norm_spike" not in feed.fired()


@pytest.mark.parametrize(("text", "words"), [
    ("[]", "not a deadweight baseline"),
    ('{"kind": "deadweight.baseline", "version": 99}', "version 99"),
    ("{", "not JSON"),
    ('{"kind": "deadweight.baseline", "version": 1, "series": {"loss": [[1, 2]]}}', "damaged"),
])
def test_a_bad_file_is_refused_with_words(text: str, words: str) -> None:
    with pytest.raises(BaselineError, match=words):
        Baseline.from_json(text)


def test_an_oversized_file_is_refused() -> None:
    with pytest.raises(BaselineError, match="more than"):
        Baseline.from_json(" " * (MAX_BASELINE_BYTES + 1))


def test_steps_are_binned_by_their_share_of_the_run() -> None:
    assert bin_of(1, 60) == 0 and bin_of(60, 60) == BINS - 1
    assert bin_of(30, 60) == bin_of(15, 30)  # normalised: half-way is half-way
    assert bin_of(500, 60) == BINS - 1  # past the baseline's end: its last band


def test_a_value_is_out_only_beyond_the_widened_band() -> None:
    band = Band(1.0, 1.2, 1.4)
    assert side(1.7, band, 0.25) == 0  # within the band's width above it
    assert side(1.9, band, 0.25) == 1 and side(0.5, band, 0.25) == -1
    flat = Band(1e-3, 1e-3, 1e-3)  # one deterministic value (a learning rate)
    assert side(1.1e-3, flat, 0.25) == 0 and side(1e-4, flat, 0.25) == -1


def test_a_single_noisy_step_never_deviates_a_persistent_one_does() -> None:
    baseline = _baseline(grad_l2=tuple(Band(1.0, 1.2, 1.4) for _ in range(BINS)))
    healthy = [(s, 1.2) for s in range(1, 11)]
    spike = [*healthy[:5], (6, 50.0), *healthy[6:]]
    assert deviation(baseline, "grad_l2", spike[::-1], BINS, 5, 0.25) is None
    assert deviation(baseline, "grad_l2", spike[5::-1], BINS, 5, 0.25) is None
    growing = healthy[:4] + [(s, 2.0 * s) for s in range(5, 12)]
    found = deviation(baseline, "grad_l2", growing[::-1], BINS, 5, 0.25)
    assert found is not None
    assert (found.first_step, found.reached_step, found.step, found.points) == (5, 9, 11, 7)
    assert "grad_l2" in found.words() and "above the baseline's band since step 5" in \
        found.words()
    assert deviation(baseline, "loss", growing[::-1], BINS, 5, 0.25) is None  # not in the baseline


def test_a_run_alternating_above_and_below_is_no_streak() -> None:
    baseline = _baseline(loss=tuple(Band(1.0, 1.2, 1.4) for _ in range(BINS)))
    zigzag = [(s, 9.0 if s % 2 else 0.01) for s in range(1, 12)]
    assert deviation(baseline, "loss", zigzag[::-1], BINS, 5, 0.25) is None


def test_the_fingerprint_leaves_the_seed_out_and_names_differences() -> None:
    start = pb.RunStart(trainer="GRPOTrainer", world_size=1,
                        config={"beta": 0.04, "seed": 1, "learning_rate": 2e-4})
    other = pb.RunStart()
    other.CopyFrom(start)
    other.config["seed"] = 2
    assert prints.fingerprint(start) == prints.fingerprint(other)
    other.config["beta"] = 0.0
    lines = prints.differences(prints.fingerprint(start), prints.fingerprint(other))
    assert lines == ["config.beta: 0.04 -> 0"]
    assert prints.common([prints.fingerprint(start), prints.fingerprint(other)]).get(
        "config.beta") is None


def test_a_run_start_carries_its_baseline_and_a_damaged_one_is_named() -> None:
    start = pb.RunStart(baseline=_baseline().to_json(), baseline_name="b.json")
    found = parsed(start)
    assert isinstance(found, Baseline) and parsed(start) is found  # parsed once
    assert label(start).startswith("b.json (runs a;")
    broken = pb.RunStart(baseline="{", baseline_name="x.json")
    assert isinstance(parsed(broken), BaselineError)
    assert "unreadable" in label(broken)
    assert parsed(pb.RunStart()) is None and label(pb.RunStart()) == ""


def test_the_client_reads_the_named_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    file = tmp_path / "r.baseline.json"
    file.write_text("{}")
    assert baseline_file.read(file) == ("{}", "r.baseline.json")
    monkeypatch.setenv(baseline_file.BASELINE_ENV, str(file))
    assert baseline_file.read(None) == ("{}", "r.baseline.json")
    monkeypatch.delenv(baseline_file.BASELINE_ENV)
    assert baseline_file.read(None) is None
    assert baseline_file.read(tmp_path / "missing.json") is None
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (baseline_file.MAX_BASELINE_BYTES + 1))
    assert baseline_file.read(big) is None
    assert "cannot be read" in caplog.text and "larger than" in caplog.text


def test_a_long_deviation_is_walked_back_a_bounded_way() -> None:
    baseline = _baseline(loss=tuple(Band(1.0, 1.2, 1.4) for _ in range(BINS)))
    far = [(s, 9.0) for s in range(1, 201)]
    found = deviation(baseline, "loss", far[::-1], 200, 5, 0.25)
    assert found is not None and found.points == MAX_WALK
    assert found.step == 200 and found.first_step == 200 - MAX_WALK + 1


def test_a_deviation_knows_when_it_became_persistent() -> None:
    baseline = _baseline(loss=tuple(Band(1.0, 1.2, 1.4) for _ in range(BINS)))
    out = [(s, 1.2) for s in range(1, 4)] + [(s, 9.0) for s in range(4, 21)]
    short = deviation(baseline, "loss", out[:12][::-1], BINS, 5, 0.25, escalate=15)
    assert short is not None and short.points == 9 and short.escalated_step is None
    long = deviation(baseline, "loss", out[::-1], BINS, 5, 0.25, escalate=15)
    assert long is not None and long.points == 17
    assert (long.reached_step, long.escalated_step) == (8, 18)
    far = [(s, 9.0) for s in range(1, 201)]  # past the walk's bound it stays persistent
    found = deviation(baseline, "loss", far[::-1], 200, 5, 0.25, escalate=MAX_WALK + 10)
    assert found is not None and found.escalated_step == 200


def _loss_feed(steps: int) -> tuple[Feed, DetectorSettings]:
    """A run judged against a baseline whose loss sat at 2.0 at every point of its
    ``steps`` steps; nothing else in the baseline to compare."""
    recipe = pb.RunStart(trainer="SFTTrainer", config={"learning_rate": 1e-4},
                         membership=MEMBERSHIP)
    baseline = Baseline(runs=("healthy",), steps=steps, fingerprint=prints.fingerprint(recipe),
                        modules={}, series={"loss": tuple(Band(2.0, 2.0, 2.0)
                                                          for _ in range(BINS))})
    settings = DetectorSettings()
    feed = Feed(Registry(settings=settings), trainer="SFTTrainer",
                config={"learning_rate": 1e-4}, baseline=baseline.to_json(),
                baseline_name="recipe.baseline.json")
    return feed, settings


def _loss_verdict(feed: Feed) -> tuple[str, int, int] | None:
    """(severity, step, incidents) of baseline_loss while it fires, None while it does not."""
    finding = feed.registry.findings(feed.run_id).get("baseline_loss")
    if finding is None or not finding.firing:
        return None
    return finding.severity, finding.step, finding.incidents


def test_a_deviation_shorter_than_the_escalation_stays_info_and_clears() -> None:
    """Out of the band for fewer than ``baseline_escalate_steps`` points: info from the
    ``baseline_steps``-th point (one noisy step draws nothing), never warning; back in the
    band, it resolves."""
    feed, settings = _loss_feed(60)
    assert settings.baseline_steps < settings.baseline_escalate_steps
    seen: list[tuple[str, int, int] | None] = []
    for step in range(1, 41):
        out = 3 <= step < 3 + settings.baseline_escalate_steps - 1 or step == 30
        feed.log(step, loss=9.0 if out else 2.0)
        seen.append(_loss_verdict(feed))
    info_from = 3 + settings.baseline_steps - 1
    assert all(v is None for v in seen[:info_from - 1])
    last_out = 3 + settings.baseline_escalate_steps - 2
    assert all(v == ("info", info_from, 1) for v in seen[info_from - 1:last_out]), seen
    assert all(v is None for v in seen[last_out:])  # cleared, and step 30 alone draws nothing
    assert feed.registry.findings(feed.run_id)["baseline_loss"].incidents == 1


def test_a_deviation_that_persists_steps_up_to_warning_and_never_critical() -> None:
    """The same deviation, lasting: the info incident resolves and a warning one opens at the
    point it reached ``baseline_escalate_steps``; it stays a warning however long it lasts."""
    feed, settings = _loss_feed(60)
    seen = []
    for step in range(1, 61):
        feed.log(step, loss=9.0 if step >= 3 else 2.0)
        seen.append(_loss_verdict(feed))
    info_from = 3 + settings.baseline_steps - 1
    warning_from = 3 + settings.baseline_escalate_steps - 1
    assert seen[info_from - 2] is None and seen[info_from - 1] == ("info", info_from, 1)
    assert seen[warning_from - 2] == ("info", info_from, 1)
    assert seen[warning_from - 1] == ("warning", warning_from, 2)
    assert seen[-1] == ("warning", warning_from, 2)
    finding = feed.registry.findings(feed.run_id)["baseline_loss"]
    assert "persistent" in finding.summary and finding.evidence["points_outside"] == "58"


def test_a_persistent_signal_is_not_hidden_behind_a_younger_ones_info() -> None:
    """kl out of its band from the first log, reward only for the last six: the verdict is
    kl's warning, not reward's info (the first quantity the detector walks)."""
    baseline = Baseline(runs=("healthy",), steps=40, fingerprint={}, modules={}, series={
        "reward": tuple(Band(0.5, 0.5, 0.5) for _ in range(BINS)),
        "kl": tuple(Band(0.01, 0.01, 0.01) for _ in range(BINS))})
    feed = Feed(Registry(settings=DetectorSettings()), trainer="GRPOTrainer",
                baseline=baseline.to_json(), baseline_name="grpo.baseline.json")
    for step in range(1, 21):
        feed.log(step, reward=5.0 if step > 14 else 0.5, kl=1.0)
    finding = feed.registry.findings(feed.run_id)["baseline_rl_signals"]
    assert finding.firing and finding.severity == "warning"
    assert finding.evidence["quantity"] == "kl" and finding.evidence["points_outside"] == "20"
