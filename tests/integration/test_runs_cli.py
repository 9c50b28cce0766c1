"""``deadweight runs`` and ``deadweight status --json`` against a real sidecar over its real
socket, and ``deadweight runs`` on a copy of its state database with no sidecar running.

The runs are real SFT trainings: one with its adapter loaded frozen (``is_trainable`` left
False), one healthy control. Each command runs as its own process, as on-call runs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.commands import runs_listing, status_json

FROZEN, HEALTHY = "runs-frozen", "runs-healthy"


def _deadweight(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", *args],
                          capture_output=True, text=True, timeout=60)


def _json(*args: str) -> Any:
    done = _deadweight(*args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _train(tiny: tuple[Path, Path], sidecar: SidecarProcess, run_id: str, out: Path,
           trainable: bool) -> None:
    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=trainable)
    callback = DeadweightCallback(address=sidecar.address, run_id=run_id)
    runs.sft_trainer(model, model_dir, out, [callback], steps=6, save_steps=3).train()


def _detectors(verdicts: list[dict[str, Any]]) -> list[str]:
    return [v["detector"] for v in verdicts if v["severity"] == "critical"]


@pytest.mark.slow
def test_runs_and_status_json_live_and_from_a_copied_state_db(tiny: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "sidecar", extra_args=["--state-dir", str(state)]) as sc:
        _train(tiny, sc, FROZEN, tmp_path / "frozen", trainable=False)
        _train(tiny, sc, HEALTHY, tmp_path / "healthy", trainable=True)

        status = _json("status", "--address", sc.address, "--json")
        assert status["schema"] == status_json.SCHEMA and status["omitted_runs"] == 0
        runs = {r["run_id"]: r for r in status["runs"]}
        assert runs.keys() == {FROZEN, HEALTHY}
        for run in runs.values():
            assert tuple(run) == status_json.RUN_KEYS
            assert run["trainer"] == "SFTTrainer" and run["ended"] is True
            assert run["end_reason"] == "completed" and run["ranks"] == [0]
            assert run["baseline"] is None  # neither names one
            for finding in run["findings"]:
                assert tuple(finding) == status_json.FINDING_KEYS
                assert finding["state"] in ("firing", "firing at end", "resolved")
                assert isinstance(finding["evidence"], dict)
            for action in run["actions"]:
                assert tuple(action) == status_json.ACTION_KEYS
        frozen = _detectors(runs[FROZEN]["findings"])
        assert frozen[0] == "empty_optimizer" and "frozen_weights" in frozen
        assert frozen.index("frozen_weights") < frozen.index("checkpoint_unchanged")
        assert not _detectors(runs[HEALTHY]["findings"])
        # The text form lists them in the same order: the cause first.
        text = _deadweight("status", "--address", sc.address)
        assert text.returncode == 0, text.stderr
        assert (text.stdout.index(" empty_optimizer [") < text.stdout.index(" frozen_weights [")
                < text.stdout.index(" checkpoint_unchanged ["))

        live = _json("runs", "--address", sc.address, "--json")
        assert live["schema"] == runs_listing.SCHEMA and live["source"] == "sidecar"
        listed = {r["run_id"]: r for r in live["runs"]}
        assert listed.keys() == {FROZEN, HEALTHY}
        for run in listed.values():  # the live sidecar knows when each run began and ended
            assert 0 < run["started_at"] <= run["ended_at"] <= time.time()
            assert runs[run["run_id"]]["started_at"] == run["started_at"]
        assert listed[FROZEN]["ended_at"] <= listed[HEALTHY]["started_at"]
        assert _detectors(listed[FROZEN]["verdicts"])[0] == "empty_optimizer"
        text = _deadweight("runs", "--address", sc.address)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].split()[:2] == ["RUN", "TRAINER"]
        frozen_line = next(line for line in lines if line.startswith(FROZEN))
        assert "SFTTrainer" in frozen_line and "empty_optimizer (critical" in frozen_line
        assert "—" not in frozen_line  # a start and an end, both known
        assert "no verdict" in next(line for line in lines if line.startswith(HEALTHY))

    # No sidecar now: a copy of its database, elsewhere, is all on-call has.
    copy = tmp_path / "copied-state"
    copy.mkdir(mode=0o700)
    for path in state.glob("deadweight.db*"):
        shutil.copy2(path, copy / path.name)
    offline = _json("runs", "--state-dir", str(copy), "--json")
    assert offline["source"] == "state_dir"
    listed = {r["run_id"]: r for r in offline["runs"]}
    assert [r["run_id"] for r in offline["runs"]] == [FROZEN, HEALTHY]  # oldest first
    for run in listed.values():
        assert run["trainer"] == "SFTTrainer" and run["end_reason"] == "completed"
        assert run["started_at"] <= run["ended_at"]
    assert listed[FROZEN]["ended_at"] <= listed[HEALTHY]["started_at"]
    verdicts = listed[FROZEN]["verdicts"]
    assert _detectors(verdicts)[:2] == ["empty_optimizer", "frozen_weights"]
    # The run ended with its verdicts standing: the listing never calls them resolved.
    assert {v["state"] for v in verdicts if v["severity"] == "critical"} == {"firing at end"}
    assert not _detectors(listed[HEALTHY]["verdicts"])
    text = _deadweight("runs", "--state-dir", str(copy))
    assert text.returncode == 0, text.stderr
    frozen_line = next(line for line in text.stdout.splitlines() if line.startswith(FROZEN))
    assert "empty_optimizer (critical, firing at end)" in frozen_line
    assert "completed" in frozen_line

    # Clear errors, exit 2: no database there, no sidecar there.
    missing = _deadweight("runs", "--state-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no state database" in missing.stderr
    gone = _deadweight("runs", "--address", sc.address)
    assert gone.returncode == 2 and "cannot reach the sidecar" in gone.stderr
    gone = _deadweight("status", "--address", sc.address, "--json")
    assert gone.returncode == 2 and not gone.stdout


def test_status_json_counts_the_runs_a_bounded_answer_left_out() -> None:
    from deadweight.proto import pb
    from deadweight.sidecar.registry.status_report import bounded

    answer = pb.StatusResponse(runs=[
        pb.RunStatus(run_id=f"run-{n:03d}" + "x" * 400, trainer="SFTTrainer")
        for n in range(100)])
    cut = status_json.document(bounded(answer, limit=8 * 1024))
    assert 0 < len(cut["runs"]) < 100
    assert len(cut["runs"]) + cut["omitted_runs"] == 100
    assert all(not r["run_id"].startswith("(omitted)") for r in cut["runs"])
    assert status_json.document(answer)["omitted_runs"] == 0
