"""The ``deadweight`` command as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess

CLI = [sys.executable, "-m", "deadweight.sidecar.cli"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_status_shows_runs_and_verdicts(sidecar: SidecarProcess) -> None:
    from deadweight.proto import pb
    from deadweight.sidecar.status import render
    from tests.faults import Pipe

    pipe = Pipe(sidecar.address)  # a live run at step 3 that the command must list
    try:
        for event in (pb.Event(run_start=pb.RunStart(trainer="SFTTrainer")),
                      pb.Event(seq=1, step=pb.StepReport(step=3, learning_rate=1e-4))):
            assert not pipe.send(pb.StreamRequest(run_id="cli-status", events=[event])).error
        result = _run("status", "--address", sidecar.address)
    finally:
        pipe.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split() == ["RUN", "TRAINER", "RANKS", "STEP", "SEEN",
                                                     "STATE"]
    # A start without optimizer membership reads as an empty optimizer: a live verdict.
    assert re.search(r"^cli-status +SFTTrainer +1 +3 +\d+s  running FIRING empty_optimizer$",
                     result.stdout, re.MULTILINE), result.stdout
    assert "  FIRING   empty_optimizer [critical, policy page] step 0: " in result.stdout
    assert "      optimizer_params = 0\n" in result.stdout
    text = render(pb.StatusResponse(runs=[pb.RunStatus(
        run_id="r1", trainer="SFTTrainer", ranks=[0], step=7, findings=[pb.Finding(
            detector="frozen_weights", severity="critical", firing=True, step=3,
            summary="weights unchanged", evidence={"update_norm": "0"}, policy="page")])]))
    assert "r1" in text and "FIRING frozen_weights" in text and "update_norm = 0" in text


def test_status_against_a_dead_socket_is_a_clear_error(tmp_path: Path) -> None:
    result = _run("status", "--address", f"unix://{tmp_path}/absent.sock")
    assert result.returncode == 2
    assert "cannot reach the sidecar" in result.stderr


@pytest.mark.parametrize(
    ("policy", "message"),
    [("frozen_weights", "expected DETECTOR=ACTION"), ("nope=page", "unknown detector"),
     ("frozen_weights=explode", "unknown action")],
)
def test_bad_policy_flags_are_rejected(policy: str, message: str, tmp_path: Path) -> None:
    result = _run("serve", "--socket", str(tmp_path / "s.sock"), "--policy", policy)
    assert result.returncode == 2
    assert message in result.stderr


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.startswith("deadweight ")


@pytest.mark.slow
def test_demo_catches_the_frozen_run_and_spares_the_control(tmp_path: Path) -> None:
    result = _run("demo", "--workdir", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RESULT: frozen run caught and stopped" in result.stdout
    assert "frozen_weights [critical, policy stop]" in result.stdout
    assert "differs from the initial adapter: False" in result.stdout
