"""The baseline file, its comparison rule and the client's reading of it, piece by piece."""

from __future__ import annotations

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


def _baseline(**series: tuple[Band | None, ...]) -> Baseline:
    return Baseline(runs=("a",), steps=BINS, fingerprint={"trainer": "T"},
                    modules={"head": ModuleFacts(1.0, 2, Band(0.5, 1.0, 1.5))}, series=series,
                    name="b.json")


def test_the_file_round_trips_and_says_its_version() -> None:
    original = _baseline(loss=tuple(Band(1.0, 1.5, 2.0) for _ in range(BINS)))
    text = original.to_json()
    document = json.loads(text)
    assert document["version"] == 1 and document["kind"] == "deadweight.baseline"
    again = Baseline.from_json(text, name="b.json")
    assert again == original


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
