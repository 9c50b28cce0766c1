"""A kill policy across uids, deployed as the Kubernetes manifest deploys it.

The sidecar runs as SIDECAR_UID, the trainer as TRAINER_UID; both are in SHARED_GID (the pod's
``fsGroup``), the group the sidecar hands its 0660 sockets to (``--socket-group``). The sidecar
runs under ``setpriv`` the way a container runtime starts a non-root container with
``capabilities: {drop: [ALL], add: [KILL]}`` and ``allowPrivilegeEscalation: false``: bounding
set KILL alone, no-new-privs, no ambient set, and an interpreter that carries cap_kill as a
permitted file capability, made by the very function the image build runs. The trainer is the
real frozen SFT job of ``tests/support/enforcement_job.py`` (it drops STOP, so only a signal
ends it).

With KILL the other-uid sidecar ends the trainer with SIGTERM; the control, the same sidecar
without KILL in its bounding set, journals the kernel's refusal (``permission_denied``), says
so in an error line and on ``/metrics``, and keeps serving, while the trainer is never hit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto.transport import attest_path
from deadweight.sidecar.actions.signal_capability import CAP_KILL, grant_to_interpreter
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import assert_never_signalled, start_job, stop_all
from tests.support.realprocs import wait_for
from tests.support.uid_layout import sidecar_folder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAINER_UID, SIDECAR_UID, SHARED_GID = 23001, 23002, 23000
JOB_TIMEOUT = 300.0
#: From the job's start to its attested RunStart (imports of torch and TRL included).
ATTEST_TIMEOUT = 120.0


def _caps(pid: int) -> dict[str, int]:
    """Uid and capability masks of a live process, from /proc."""
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Uid":
            found["uid"] = int(value.split()[1])  # effective
        elif key in ("CapEff", "CapBnd", "CapAmb"):
            found[key] = int(value.strip(), 16)
    return found


@contextmanager
def as_sidecar() -> Iterator[None]:
    """Act as the sidecar's uid (its state dir is 0700 and refuses other owners)."""
    os.setegid(SIDECAR_UID)
    os.seteuid(SIDECAR_UID)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def journal(state: Path, run_id: str) -> list[tuple[str, str]]:
    with as_sidecar():
        store = Store(state)
        try:
            return [(a.action, a.result) for a in store.actions(run_id, "frozen_weights")]
        finally:
            store.close()


def outcome(state: Path, run_id: str) -> str:
    """How the run's frozen_weights escalation ended ("open" while running, "" before)."""
    with as_sidecar():
        store = Store(state)
        try:
            found = [i.enforcement for i in store.incidents(run_id)
                     if i.detector == "frozen_weights"]
        finally:
            store.close()
    assert len(found) <= 1, found
    return found[0] if found else ""


def binding(state: Path, run_id: str) -> tuple[int, int] | None:
    """(uid, pid) the kernel reported for rank 0 when it attested; None before."""
    with as_sidecar():
        store = Store(state)
        try:
            bound = store.bindings(run_id).get(0)
        finally:
            store.close()
    return None if bound is None else (bound.uid, bound.pid)


@pytest.fixture(scope="module")
def shared(tiny: tuple[Path, Path]) -> Iterator[Path]:
    """A folder both uids can traverse, the tiny model readable by the trainer, and an
    interpreter with cap_kill as a permitted file capability, as in the image."""
    folder = Path(tempfile.mkdtemp(prefix="deadweight-uids-", dir="/tmp"))
    os.chmod(folder, 0o755)
    for source in tiny:
        shutil.copytree(source, folder / "models" / source.name)
    for path in (folder / "models").rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)  # safetensors writes 0600
    # The adapter names its base model by path: the trainer's copy, not root's private one.
    config = folder / "models" / tiny[1].name / "adapter_config.json"
    config.write_text(config.read_text().replace(str(tiny[0]), str(folder / "models" /
                                                                    tiny[0].name)))
    venv = Path(sys.prefix)
    interpreter = folder / "capvenv" / "bin" / "python"
    interpreter.parent.mkdir(parents=True)
    shutil.copy(venv / "pyvenv.cfg", folder / "capvenv" / "pyvenv.cfg")
    (folder / "capvenv" / "lib").symlink_to(venv / "lib")
    interpreter.symlink_to(Path(sys.executable).resolve())
    grant_to_interpreter(interpreter)
    for name, uid, gid in (("jobs", TRAINER_UID, TRAINER_UID),
                           ("home", TRAINER_UID, TRAINER_UID)):
        (folder / name).mkdir()
        os.chown(folder / name, uid, gid)
    yield folder
    if os.environ.get("DEADWEIGHT_KEEP_TEST_DIRS") != "1":
        shutil.rmtree(folder, ignore_errors=True)


def _setpriv(uid: int, gid: int, bounding: str) -> list[str]:
    return ["setpriv", "--reuid", str(uid), "--regid", str(gid), "--groups", str(SHARED_GID),
            "--inh-caps", "-all", "--bounding-set", bounding, "--no-new-privs"]


class OtherUidSidecar(SidecarProcess):
    """``deadweight serve`` as SIDECAR_UID, with or without KILL in its bounding set."""

    def __init__(self, folder: Path, interpreter: Path, with_kill: bool) -> None:
        self.state = sidecar_folder(folder, SIDECAR_UID, SHARED_GID)  # as the pod has it
        super().__init__(folder, policies={"frozen_weights": "kill"}, extra_args=[
            "--state-dir", str(self.state), "--stop-grace-seconds", "1",
            "--kill-grace-seconds", "1", "--trainer-uid", str(TRAINER_UID),
            "--socket-group", str(SHARED_GID)])
        self.prefix = _setpriv(SIDECAR_UID, SIDECAR_UID, "-all,+kill" if with_kill else "-all")
        self.interpreter = interpreter

    def command(self) -> list[str]:
        return [*self.prefix, str(self.interpreter), *super().command()[1:]]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _trainer(shared: Path, tiny: tuple[Path, Path], sidecar: SidecarProcess,
             run_id: str) -> subprocess.Popen[bytes]:
    """The frozen job as TRAINER_UID, on the copy of the tiny model it may read."""
    env = {**os.environ, "HOME": str(shared / "home"), "PYTHONPATH": str(ROOT)}
    readable = (shared / "models" / tiny[0].name, shared / "models" / tiny[1].name)
    return start_job(readable, shared / "jobs", sidecar.address, run_id, "ignore_stop",
                     prefix=_setpriv(TRAINER_UID, TRAINER_UID, "-all"), env=env)


def _assert_sockets_shared(sidecar: SidecarProcess) -> None:
    for path in (sidecar.socket_path, Path(attest_path(str(sidecar.socket_path)))):
        info = path.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (
            SIDECAR_UID, SHARED_GID, 0o660), path


@contextmanager
def _attested_trainer(shared: Path, tiny: tuple[Path, Path], run_id: str, with_kill: bool
                      ) -> Iterator[tuple[OtherUidSidecar, dict[str, int], subprocess.Popen[bytes],
                                          tuple[int, int] | int | None]]:
    """The sidecar as SIDECAR_UID (its sockets checked shared with the trainers' group) and
    the frozen job as TRAINER_UID, once it attested or exited: (sidecar, the sidecar's
    capabilities, job, its binding). The job is stopped on leaving; the sidecar stays up."""
    sidecar = OtherUidSidecar(shared / ("with-kill" if with_kill else "no-kill"),
                              shared / "capvenv" / "bin" / "python", with_kill=with_kill)
    with sidecar:
        assert sidecar.process is not None
        caps = _caps(sidecar.process.pid)
        _assert_sockets_shared(sidecar)
        job = _trainer(shared, tiny, sidecar, run_id)
        try:
            bound = wait_for(lambda: binding(sidecar.state, run_id) or job.poll(),
                             ATTEST_TIMEOUT, interval=0.2, what="the trainer to attest")
            yield sidecar, caps, job, bound
        finally:
            stop_all(job)


def test_sidecar_of_another_uid_with_kill_alone_ends_the_frozen_trainer(
        shared: Path, tiny: tuple[Path, Path]) -> None:
    with _attested_trainer(shared, tiny, "uids-kill", with_kill=True) as (sidecar, caps, job,
                                                                          bound):
        assert caps["uid"] == SIDECAR_UID != TRAINER_UID
        assert caps["CapBnd"] == 1 << CAP_KILL and caps["CapAmb"] == 0
        assert caps["CapEff"] == 1 << CAP_KILL  # raised from the file's permitted set
        code = job.wait(JOB_TIMEOUT)
        wait_for(lambda: outcome(sidecar.state, "uids-kill") == "terminated", 30,
                 what="the escalation to close")
        rows = journal(sidecar.state, "uids-kill")
        log = sidecar.log()
    job_log = (shared / "jobs" / "uids-kill.log").read_text()
    assert code == -signal.SIGTERM, job_log
    assert "IGNORING directive" in job_log  # STOP arrived and was dropped
    # The trainer attested as its own uid, and the sidecar signalled exactly that process.
    assert bound == (TRAINER_UID, job.pid)
    assert rows == [("page", "no_pager"), ("stop", "sent"), ("sigterm", "sent"),
                    ("exit", "exited")]
    assert '"cap_kill": "effective"' in log or "cap_kill=effective" in log, log
    assert "trainer_uid_not_signalable" not in log


def test_sidecar_of_another_uid_without_kill_journals_the_refusal_and_keeps_serving(
        shared: Path, tiny: tuple[Path, Path]) -> None:
    with _attested_trainer(shared, tiny, "uids-nokill", with_kill=False) as (sidecar, caps, job,
                                                                             bound):
        assert caps["uid"] == SIDECAR_UID and caps["CapEff"] == 0
        wait_for(lambda: ("sigterm", "permission_denied") in journal(sidecar.state,
                                                                     "uids-nokill"),
                 JOB_TIMEOUT, interval=0.5, what="the refused SIGTERM in the journal")
        wait_for(lambda: outcome(sidecar.state, "uids-nokill") == "nothing_signalled", 30,
                 what="the escalation to close")
        rows = journal(sidecar.state, "uids-nokill")
        metrics = sidecar.metrics()
        # The sidecar is up and answers; the trainer was never hit (it dies of SIGUSR1).
        assert sidecar.process.poll() is None
        assert sidecar.run_status("uids-nokill") is not None
        assert job.poll() is None, (shared / "jobs" / "uids-nokill.log").read_text()
        assert_never_signalled(job)
        log = sidecar.log()
    assert bound == (TRAINER_UID, job.pid)
    assert rows == [("page", "no_pager"), ("stop", "sent"), ("sigterm", "permission_denied")]
    assert "trainer_uid_not_signalable" in log  # said at startup
    assert "signal_permission_denied" in log  # and when the signal was refused
    assert ('deadweight_actions_total{action="sigterm",detector="frozen_weights",'
            'result="permission_denied",run_id="uids-nokill",trainer="SFTTrainer"} 1.0'
            in metrics), metrics
