"""A newcomer's rough edges: each one reproduced as it was met, and shown gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess


def test_sidecar_starts_from_a_folder_that_holds_a_deadweight_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shadow = tmp_path / "deadweight"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('a user folder, not the package')\n")
    monkeypatch.chdir(tmp_path)
    with SidecarProcess(tmp_path / "sidecar") as process:
        assert process.status().runs == []


def _serve(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.cli", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_second_serve_refuses_a_live_socket_and_the_first_keeps_its_runs_and_kill_path(
    tmp_path: Path,
) -> None:
    from deadweight.proto.transport import attest_path

    with SidecarProcess(tmp_path / "first") as first:
        attest = attest_path(str(first.socket_path))
        assert attest.exists()
        second = _serve("--socket", str(first.socket_path), "--metrics-address", "127.0.0.1:0")
        assert second.returncode == 2
        assert "another process is listening on" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.socket_path.exists() and attest.exists()
        assert first.status().runs == []  # still answering on the same socket


def test_a_stale_socket_from_a_crash_is_replaced(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "sock" / "deadweight.sock"
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays; nobody listens
    with SidecarProcess(tmp_path) as process:
        assert process.socket_path == path and process.status().runs == []


def test_a_job_that_squats_the_socket_during_a_restart_does_not_keep_the_sidecar_down(
    tmp_path: Path,
) -> None:
    """A process that is no sidecar (here a training-like script) bound ``deadweight.sock``
    while the sidecar was down: the sidecar used to refuse to start ("another process is
    listening"), and stayed down. Now it removes the squatter's name, listens there again and
    logs who squatted; the squatter's own socket stays open but no new client reaches it."""
    import json

    path = tmp_path / "sock" / "deadweight.sock"
    path.parent.mkdir()
    squatter = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys\n"
         "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n"
         "print('bound', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "bound\n"
        with SidecarProcess(tmp_path) as process:
            assert process.status().runs == []  # reached over the socket path, not the squat
            lines = [json.loads(line) for line in process.log_path.read_text().splitlines()
                     if line.startswith("{")]
            squat = [line for line in lines if line["event"] == "socket_squatted"]
            assert squat and squat[0]["pid"] == squatter.pid, lines
            assert squatter.poll() is None  # nobody was signalled
    finally:
        squatter.kill()
        squatter.wait()


@pytest.mark.parametrize(("flags", "message"), [
    (["--metrics-address", "nonsense"], "expected HOST:PORT"),
    (["--listen", "nowhere"], "expected HOST:PORT"),
    (["--log-level", "LOUD"], "invalid choice: 'loud'"),
    (["--socket", "/proc/no-such-folder/deadweight.sock"],
     "cannot create the socket folder /proc/no-such-folder"),
])
def test_serve_mistakes_are_one_clear_line(tmp_path: Path, flags: list[str],
                                           message: str) -> None:
    done = _serve("--socket", str(tmp_path / "s.sock"), "--metrics-address", "127.0.0.1:0",
                  *flags)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_names_the_port_it_cannot_take(tmp_path: Path) -> None:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        done = _serve("--socket", str(tmp_path / "s.sock"), "--metrics-address",
                      f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert done.returncode == 2
    assert f"cannot serve /metrics on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_help_shows_every_default() -> None:
    done = subprocess.run([sys.executable, "-m", "deadweight.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "COLUMNS": "200"})
    for flag, default in (("--socket", "/run/deadweight/deadweight.sock"),
                          ("--stop-grace-seconds", "120.0"), ("--kill-grace-seconds", "30.0"),
                          ("--log-level", "info"), ("--metrics-address", "127.0.0.1:9464")):
        block = done.stdout.split(f"  {flag} ", 1)[1].split("\n  -", 1)[0]
        assert f"(default {default})" in " ".join(block.split()), block


@pytest.mark.slow
def test_a_finished_run_does_not_own_checkpoints_written_later_in_its_folder(
    tmp_path: Path, tiny: tuple[Path, Path]
) -> None:
    """A copy of the last checkpoint, made after the run ended, pages nobody."""
    import shutil

    from deadweight.demo import runs
    from tests.support.inprocess_sidecar import InProcessSidecar
    from tests.support.realprocs import wait_for

    live = InProcessSidecar.live(tmp_path / "sidecar")
    try:
        model_dir, adapter_dir = tiny
        model = runs.load_adapter(model_dir, adapter_dir, trainable=True)
        out = tmp_path / "sidecar" / "run"  # under the folder the sidecar may read
        runs.sft_trainer(model, model_dir, out, [live.callback("reused-dir")], steps=4,
                         save_steps=2).train()
        live.wait_inspected("reused-dir", 2)
        assert live.seen("reused-dir").ended
        shutil.copytree(out / "checkpoint-4", out / "checkpoint-6")
        assert live.server is not None and live.server.watcher is not None
        watcher = live.server.watcher
        target = watcher.passes + 3  # the watcher has looked at the folder again, thrice
        wait_for(lambda: watcher.passes >= target, 20, what="three more watcher passes")
        run = live.seen("reused-dir")
        assert run.checkpoint(str(out / "checkpoint-6")) is None
        assert live.fired("reused-dir") == {}
    finally:
        live.stop()


def test_inspect_labels_checkpoints_with_their_own_steps(tiny: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    import shutil

    from deadweight.sidecar.commands.inspect import audit, render

    _, adapter = tiny
    for step in (2, 10):  # 10 sorts after 2 although "checkpoint-10" < "checkpoint-2"
        shutil.copytree(adapter, tmp_path / f"checkpoint-{step}")
    results = audit([tmp_path / "checkpoint-10", tmp_path / "checkpoint-2"], initial=adapter)
    text = render(results)
    assert "checkpoint at step 2 is byte-identical to the initial adapter" in text
    assert "checkpoint at step 10 is byte-identical to the previous (step 2) adapter" in text
    # no step label of its own (paths are checkpoint-<step> folders), and the one note is the
    # gate's: these folders carry no run summary
    assert "step 1 " not in text and "note: the paths are not all" not in text
    assert "note: no deadweight-summary.json beside this adapter" in text
    mixed = render(audit([adapter, tmp_path / "checkpoint-2"]))
    assert mixed.startswith("note: the paths are not all checkpoint-<step> folders")


@pytest.mark.slow
def test_status_says_which_verdict_stopped_a_run(stopping_sidecar: SidecarProcess,
                                                tiny: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    from deadweight.callbacks import DeadweightCallback
    from deadweight.demo import runs
    from deadweight.sidecar.commands import status

    model_dir, adapter_dir = tiny
    model = runs.load_adapter(model_dir, adapter_dir, trainable=False)
    callback = DeadweightCallback(address=stopping_sidecar.address, run_id="stopped-run")
    trainer = runs.sft_trainer(model, model_dir, tmp_path, [callback], steps=12)
    trainer.train()
    assert trainer.state.global_step < 12
    only = status.fetch(stopping_sidecar.address, run_id="stopped-run")
    assert [r.run_id for r in only.runs] == ["stopped-run"]  # the filter holds
    run = only.runs[0]
    assert run.ended and run.end_reason
    stops = [a for a in run.actions if a.action == "stop"]
    assert [(a.detector, a.result) for a in stops] == [("frozen_weights", "sent")]
    done = subprocess.run([sys.executable, "-m", "deadweight.cli", "status", "--address",
                           stopping_sidecar.address], capture_output=True, text=True,
                          timeout=30)
    line = next(x for x in done.stdout.splitlines() if x.startswith("stopped-run"))
    assert f"stopped by frozen_weights at step {stops[0].step} (STOP)" in line
    assert "root cause empty_optimizer" in line  # the trigger is its symptom
    assert f"action   stop for frozen_weights at step {stops[0].step}: sent" in done.stdout
    frozen = next(f for f in run.findings if f.detector == "frozen_weights")
    assert f"fired at step {frozen.step}; latest: weights unchanged" in done.stdout


ROOT = Path(__file__).resolve().parents[2]
#: Set-up lines that install (run by .ci/run before the tests, not again here).
INSTALLS = ("bash scripts/", "bash .ci/")


def _bash_blocks(markdown: str) -> list[list[str]]:
    """The command lines of each ```bash block (comments and continuation lines dropped)."""
    blocks, block, inside, continued = [], [], False, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            if inside:
                blocks.append(block)
            inside, block = line.strip() == "```bash", []
            continue
        if inside and line.strip() and not continued and not line.lstrip().startswith("#"):
            block.append(line.split(" #")[0].strip())
        continued = inside and line.rstrip().endswith("\\")
    return blocks


#: Where the quick start's own-user set-up installs deadweight for the sidecar's user (its
#: own install step, an administrator's, not run here).
OWN_USER_INSTALL = "/opt/deadweight/"


def _program(command: str) -> str:
    """The program a README command line runs (``VAR=value prog args``: prog; ``sudo [-u
    USER] prog args``: prog, as an administrator runs it; "" for the own-user install's)."""
    words = [w for w in command.split() if "=" not in w.split("/")[0]]
    if words[:1] == ["sudo"]:
        words = words[3:] if words[1:2] == ["-u"] else words[1:]
    if words and words[0].startswith(OWN_USER_INSTALL):
        return ""
    return words[0] if words else ""


def test_every_readme_command_runs_after_the_set_up_section_in_a_fresh_shell() -> None:
    """The README's set-up section, then each program its commands call, in a shell with a
    fresh machine's PATH: `deadweight` and `python` must be the environment's (a README
    that never activates `.venv` leaves `deadweight: command not found`)."""
    readme = (ROOT / "README.md").read_text()
    setup, rest = readme.split("## On a fresh machine", 1)[1].split("\n## ", 1)
    setup_lines = [line for block in _bash_blocks(setup) for line in block]
    assert "bash scripts/demo.sh" in setup_lines, setup_lines
    shell = [line for line in setup_lines if not line.startswith(INSTALLS)]
    programs = sorted({_program(line) for block in _bash_blocks(rest) for line in block
                       if not line.startswith(INSTALLS)} - {""})
    assert {"deadweight", "python"} <= set(programs), programs
    script = "\n".join([*shell, *(f"command -v {p} || {{ echo '{p}: command not found' >&2; "
                                  "exit 1; }" for p in programs),
                        "deadweight --version", "python -c 'import deadweight.callbacks'"])
    done = subprocess.run(["bash", "-euc", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"HOME": os.environ.get("HOME", "/root"),
                                            # a fresh login's PATH, with the sbin folders
                                            # sudo's secure path gives the admin's steps
                                            "PATH": "/usr/local/bin:/usr/bin:/bin:"
                                                    "/usr/local/sbin:/usr/sbin:/sbin",
                                            "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, f"after {shell}: {done.stderr}"
    found = dict(zip(programs, done.stdout.splitlines(), strict=False))
    for program in ("deadweight", "python"):
        assert found[program].startswith(str(ROOT / ".venv" / "bin")), found
    assert done.stdout.splitlines()[len(programs)].startswith("deadweight ")


@pytest.mark.slow
def test_bootstrap_says_what_it_is_doing() -> None:
    """The first `bash scripts/demo.sh` used to be silent for two minutes."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["bash", str(root / "scripts" / "bootstrap.sh")], capture_output=True,
                          text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "bootstrap: installing deadweight[train,dev,report,integrations] and its dependencies " \
           "(first run: under a minute)" in lines
    assert lines[-1] == "bootstrap: ready: .venv"
