"""The ``deadweight`` command as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from deadweight.demo.sidecar_process import SidecarProcess

#: The installed ``deadweight`` script runs this entry point.
CLI = [sys.executable, "-m", "deadweight.cli"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_status_shows_runs_and_verdicts(sidecar: SidecarProcess) -> None:
    from deadweight.proto import pb
    from deadweight.sidecar.commands.status import render
    from tests.support.faults import Pipe

    pipe = Pipe(sidecar.address)  # a live run at step 3 that the command must list
    try:
        for event in (pb.Event(run_start=pb.RunStart(trainer="SFTTrainer")),
                      pb.Event(seq=1, step=pb.StepReport(step=3, learning_rate=1e-4))):
            assert not pipe.send(pb.StreamRequest(run_id="cli-status", events=[event])).error
        result = _run("status", "--address", sidecar.address)
    finally:
        pipe.close()
    assert result.returncode == 0, result.stderr
    # The session's sidecar runs as this uid, whose jobs may report: it says so first.
    warning, header = result.stdout.splitlines()[:2]
    assert warning.startswith("WARNING: trainers of this uid can read the signing key"), warning
    assert header.split() == ["RUN", "TRAINER", "RANKS", "STEP", "SEEN", "STATE"]
    # A start without optimizer membership reads as an empty optimizer: a live verdict.
    assert re.search(r"^cli-status +SFTTrainer +1 +3 +\d+s  running; FIRING empty_optimizer$",
                     result.stdout, re.MULTILINE), result.stdout
    assert ("  FIRING   empty_optimizer [critical, policy page] fired at step 0; latest: "
            in result.stdout)
    assert "      optimizer_params = 0\n" in result.stdout
    text = render(pb.StatusResponse(runs=[pb.RunStatus(
        run_id="r1", trainer="SFTTrainer", ranks=[0], step=7, wrapper="fsdp2", sharded=True,
        findings=[pb.Finding(
            detector="frozen_weights", severity="critical", firing=True, step=3,
            summary="weights unchanged", evidence={"update_norm": "0"}, policy="page")])]))
    assert "r1" in text and "FIRING frozen_weights" in text and "update_norm = 0" in text
    assert "wrapper fsdp2, sharded" in text
    # A verdict that fired at one checkpoint and still fires at a later one: the step it
    # fired at and the latest reading are told apart, never one "fired at step 10: ...
    # step 30" sentence.
    later = render(pb.StatusResponse(runs=[pb.RunStatus(
        run_id="r2", trainer="SFTTrainer", ranks=[0], step=30, findings=[pb.Finding(
            detector="checkpoint_unchanged", severity="critical", firing=True, step=10,
            summary="checkpoint at step 30 is byte-identical to the initial adapter",
            policy="page")])]))
    assert ("checkpoint_unchanged [critical, policy page] fired at step 10; latest: "
            "checkpoint at step 30 is byte-identical to the initial adapter") in later, later
    assert "fired at step 10: " not in later


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


@pytest.mark.parametrize(
    ("flag", "value", "hint"),
    [("--policy", "frozen_weight=stop", "(did you mean 'frozen_weights'?)"),
     ("--setting", "stalled_second=600", "(did you mean 'stalled_seconds'?)")],
)
def test_a_mistyped_name_gets_a_did_you_mean(flag: str, value: str, hint: str,
                                             tmp_path: Path) -> None:
    result = _run("serve", "--socket", str(tmp_path / "s.sock"), flag, value)
    assert result.returncode == 2
    assert f"unknown {'detector' if flag == '--policy' else 'setting'} " \
           f"{value.split('=')[0]!r} {hint}" in result.stderr, result.stderr
    # A name like no known one gets no guess, only the list.
    far = _run("serve", "--socket", str(tmp_path / "s.sock"), flag, "zzzz=1")
    assert far.returncode == 2 and "did you mean" not in far.stderr, far.stderr


def test_inspect_setting_gets_a_did_you_mean(tmp_path: Path) -> None:
    result = _run("inspect", str(tmp_path), "--setting", "adapter_bloat_ration=2")
    assert result.returncode == 2
    assert "(did you mean 'adapter_bloat_ratio'?)" in result.stderr, result.stderr


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_a_state_dir_that_is_a_file_is_a_clear_usage_error(where: str, tmp_path: Path) -> None:
    plain = tmp_path / "state.db"
    plain.write_text("not a folder")
    state = plain if where == "file" else plain / "state"
    result = _run("serve", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(state))
    assert result.returncode == 2, result.stderr
    assert "Errno" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "argument --state-dir" in result.stderr and "usage:" in result.stderr
    named = "it is" if where == "file" else f"{plain} is"
    assert (f"{state} cannot be the state folder: {named} a file, not a folder"
            in result.stderr), result.stderr


def test_a_sigterm_is_logged_with_the_live_runs_and_the_state_dir(tmp_path: Path) -> None:
    import json

    from deadweight.proto import pb
    from tests.support.faults import Pipe

    state = tmp_path / "state"
    sidecar = SidecarProcess(tmp_path / "sc", extra_args=["--state-dir", str(state)]).start()
    try:
        pipe = Pipe(sidecar.address)
        try:
            start = pb.Event(run_start=pb.RunStart(trainer="SFTTrainer"))
            assert not pipe.send(pb.StreamRequest(run_id="cli-sigterm", events=[start])).error
            sidecar.stop()  # SIGTERM, while the run is live
        finally:
            pipe.close()
    finally:
        sidecar.stop()
    assert sidecar.process is not None and sidecar.process.returncode == 0
    lines = [json.loads(x) for x in sidecar.log_path.read_text().splitlines()
             if '"sidecar_stopping"' in x]
    assert len(lines) == 1, sidecar.log_path.read_text()
    assert lines[0]["reason"] == "SIGTERM received"
    assert lines[0]["live_runs"] == 1 and lines[0]["state_dir"] == str(state)
    assert lines[0]["level"] == "warning"


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.startswith("deadweight ")


@pytest.mark.parametrize(
    ("absent", "message"),
    [("deadweight.demo", "this install holds no demo"), ("torch", "needs 'torch'")],
)
def test_demo_without_its_code_or_the_training_stack_says_what_it_needs(
    absent: str, message: str
) -> None:
    """As in the sidecar image: the demo (or torch) is missing, the command says so."""
    script = (f"import sys; sys.modules[{absent!r}] = None; "  # importing it now fails
              "from deadweight.cli import main; sys.exit(main(['demo']))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "pip install 'deadweight[train]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_sidecar_commands_alone_have_no_demo() -> None:
    result = subprocess.run([sys.executable, "-m", "deadweight.sidecar.commands.cli", "demo"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'demo'" in result.stderr
    assert "demo" in _run("--help").stdout


def test_the_script_runs_the_entry_point_with_the_demo() -> None:
    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert scripts["project"]["scripts"] == {"deadweight": "deadweight.cli:main"}


@pytest.mark.slow
def test_demo_catches_the_frozen_run_and_spares_the_control(tmp_path: Path) -> None:
    result = _run("demo", "--workdir", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RESULT: frozen run caught and stopped" in result.stdout
    assert "frozen_weights [critical, policy stop]" in result.stdout
    assert "differs from the initial adapter: False" in result.stdout
    out = result.stdout + result.stderr
    # What the user of run A reads: where it reports, the STOP with its root cause, in status too.
    assert "deadweight: run demo-frozen-adapter reports to the sidecar at unix://" in out
    assert "STOPPED run demo-frozen-adapter (stopping training), root cause empty_optimizer" in out
    assert "(STOP), root cause empty_optimizer, ended (stopped)" in out
    noise = [line for line in (result.stdout + result.stderr).splitlines()
             if "[WARNING]" in line or "Warning:" in line]
    assert not noise, noise  # a newcomer's first run prints only what the demo says


def test_serve_refuses_a_link_pattern_with_an_unknown_placeholder(tmp_path: Path) -> None:
    result = _run("serve", "--socket", str(tmp_path / "s.sock"),
                  "--runbook-url-pattern", "https://wiki.example.com/{runbook}")
    assert result.returncode == 2
    assert "unknown placeholder(s) ['runbook']" in result.stderr
    assert "{alertname}, {detector}" in result.stderr


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """``deadweight runs | head -1``: no traceback when the reader has gone."""
    from deadweight.sidecar.store.journal import Store

    state = tmp_path / "state"
    Store(state).close()  # an empty state database
    process = subprocess.Popen([sys.executable, "-m", "deadweight.cli", "runs", "--state-dir",
                                str(state)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before the command writes a byte
    stderr = process.stderr.read().decode()
    assert process.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
