"""Shared pieces of the enforcement tests: child processes, the journal, a sidecar with kill."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.journal import Store
from tests.support import zygote
from tests.support.realprocs import wait_for
from tests.support.zygote import ForkedJob

TESTS = Path(__file__).resolve().parent


def kill_sidecar(folder: Path, state: Path, stop_grace: float, kill_grace: float,
                 extra_args: list[str] | None = None) -> SidecarProcess:
    """A real sidecar (not started) whose frozen_weights policy is kill, journaling in state."""
    return SidecarProcess(
        folder,
        policies={"frozen_weights": "kill"},
        extra_args=["--state-dir", str(state), "--stop-grace-seconds", str(stop_grace),
                    "--kill-grace-seconds", str(kill_grace), *(extra_args or [])],
    )


def start_job(tiny: tuple[Path, Path], folder: Path, address: str, run_id: str, mode: str,
              prefix: list[str] | None = None, env: dict[str, str] | None = None,
              **options: object) -> subprocess.Popen[bytes] | ForkedJob:
    """tests/support/enforcement_job.py as a process of its own; its output goes to
    folder/<run_id>.log. Forked from this worker's zygote (the training stack imported once),
    or, with prefix, exec'd under another command (``setpriv`` for another uid); env replaces
    the environment."""
    model_dir, adapter_dir = tiny
    folder.mkdir(parents=True, exist_ok=True)
    argv = [str(TESTS / "enforcement_job.py"), "--address", address,
            "--run-id", run_id, "--model-dir", str(model_dir), "--adapter-dir",
            str(adapter_dir), "--out", str(folder / run_id), "--mode", mode]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    with (folder / f"{run_id}.log").open("wb") as log:
        if prefix:
            return subprocess.Popen([*prefix, sys.executable, *argv], stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
        return zygote.shared().popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def start_raw_client(socket_path: Path, run_id: str, log_path: Path, attest: bool,
                     claim_pid: int = 0, rank: int = 0) -> subprocess.Popen[bytes]:
    """tests/support/raw_client.py as a child process: a frozen run that ignores STOP."""
    argv = [sys.executable, str(TESTS / "raw_client.py"), "--socket", str(socket_path),
            "--run-id", run_id, "--claim-pid", str(claim_pid), "--rank", str(rank)]
    if attest:
        argv.append("--attest")
    return subprocess.Popen(argv, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)


def journal(store: Store, run_id: str, detector: str = "frozen_weights") -> list[tuple[str, str]]:
    """(action, result) of every journaled action on the run's detector, in order."""
    return [(a.action, a.result) for a in store.actions(run_id, detector)]


def wait_journal(store: Store, run_id: str, entry: tuple[str, str], timeout: float) -> None:
    wait_for(lambda: entry in journal(store, run_id), timeout,
             what=f"{entry} in the journal of {run_id}")


def enforcement_outcome(store: Store, run_id: str) -> str:
    """How the run's frozen_weights escalation ended ("open" while running, "" before)."""
    found = [i.enforcement for i in store.incidents(run_id) if i.detector == "frozen_weights"]
    assert len(found) <= 1, found
    return found[0] if found else ""


def stop_all(*processes: subprocess.Popen[bytes] | ForkedJob) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def assert_never_signalled(process: subprocess.Popen[bytes] | ForkedJob) -> None:
    """No signal reached process before now: end it with SIGUSR1 and read its cause of death.

    A SIGTERM or SIGKILL sent earlier is the cause whenever it lands, even if the process was
    not reaped yet when the test looked (``poll() is None`` races the kernel there).
    """
    process.send_signal(signal.SIGUSR1)
    assert process.wait(10) == -signal.SIGUSR1, f"pid {process.pid} was signalled before"
