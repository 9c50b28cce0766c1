"""The signing key and on-call powers out of a training job's reach, as the documented set-ups
deploy them: the sidecar as SIDECAR_UID with its state dir, the trainer as TRAINER_UID, both in
SHARED_GID, the group the sidecar hands its 0660 sockets to (``--socket-group``); only the
trainer's uid reports (``--trainer-uid``). Real processes under ``setpriv``, as in
``test_trust_separate_uid.py``; the trainer is ``tests/support/forging_trainer.py`` (a broken
run over the wire, no torch) and ``tests/support/raw_client.py``.

- The trainer cannot open the signing key; the run it reports is judged and its true summary
  signed; the summary it forges (verdicts out, signed with a key of its own) fails the strict
  gate. The control is the one-uid set-up (the trainer runs as the sidecar's uid): there the
  same job reads the key, its forgery passes the strict gate, and the sidecar said so at
  start and says so in ``deadweight status``.
- The trainer's ``deadweight stop`` of another run is refused; the sidecar's uid stops it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from tests.support.enforcement_support import stop_all
from tests.support.realprocs import wait_for
from tests.support.uid_layout import sidecar_folder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAINER_UID, SIDECAR_UID, SHARED_GID = 23021, 23022, 23020
STRICT = ("--require-signed", "--require-summary")
WARNING = "trainers of this uid can read the signing key"


def _as(uid: int, gid: int | None = None) -> list[str]:
    """Run as uid (group gid, else uid's own), in SHARED_GID, with no capability."""
    return ["setpriv", "--reuid", str(uid), "--regid", str(uid if gid is None else gid),
            "--groups", str(SHARED_GID), "--inh-caps", "-all", "--bounding-set", "-all",
            "--no-new-privs"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/nonexistent"}


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder both uids can traverse (pytest's own temp root is private)."""
    folder = Path(tempfile.mkdtemp(prefix="deadweight-keyuid-", dir="/tmp"))
    os.chmod(folder, 0o755)
    yield folder
    if os.environ.get("DEADWEIGHT_KEEP_TEST_DIRS") != "1":
        shutil.rmtree(folder, ignore_errors=True)


class SidecarAs(SidecarProcess):
    """``deadweight serve`` as SIDECAR_UID with a state dir, laid out as the deployments have
    it: its folder and socket folder its own (SHARED_GID may enter), its state dir 0700."""

    def __init__(self, folder: Path, jobs: Path, extra_args: list[str]) -> None:
        self.state = sidecar_folder(folder, SIDECAR_UID, SHARED_GID)
        super().__init__(folder, watch_roots=[jobs],
                         extra_args=["--state-dir", str(self.state), *extra_args])

    def command(self) -> list[str]:
        return [*_as(SIDECAR_UID), *super().command()]

    @property
    def key(self) -> Path:
        return self.state / "summary-signing.key"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _jobs(shared: Path, name: str, uid: int) -> Path:
    """The trainer's output folder, laid out as a pod's volume under ``fsGroup`` (or a
    folder of the group the compose sidecar joins): the trainer's, in SHARED_GID, setgid so
    what it writes stays in that group, closed to others. The sidecar reads it through the
    group alone, so a weight file the save left 0600 is out of its reach until the
    callback grants the group read."""
    jobs = shared / name
    jobs.mkdir()
    os.chown(jobs, uid, SHARED_GID)
    os.chmod(jobs, 0o2750)
    return jobs


def _forging_job(sidecar: SidecarAs, uid: int, run_id: str, jobs: Path) -> dict[str, object]:
    job = subprocess.run(
        [*_as(uid), sys.executable, "-m", "tests.support.forging_trainer",
         str(sidecar.socket_path), run_id, str(sidecar.key), str(jobs / run_id)],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert job.returncode == 0, job.stdout + job.stderr
    found: dict[str, object] = json.loads(job.stdout.strip().splitlines()[-1])
    return found


def _gate(folder: Path, key: Path) -> subprocess.CompletedProcess[str]:
    """The promotion pipeline's strict form, as a command."""
    return subprocess.run([sys.executable, "-m", "deadweight.cli", "inspect", str(folder),
                           "--trust-key", str(key), *STRICT],
                          capture_output=True, text=True, timeout=120, env=_env())


def _cli(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_as(uid), sys.executable, "-m", "deadweight.cli", *argv],
                          capture_output=True, text=True, timeout=60, env=_env(), cwd="/")


def test_a_trainer_of_another_uid_cannot_read_the_key_and_its_forgery_fails_the_gate(
        shared: Path) -> None:
    jobs = _jobs(shared, "jobs", TRAINER_UID)
    with SidecarAs(shared / "sc", jobs, ["--trainer-uid", str(TRAINER_UID),
                                         "--socket-group", str(SHARED_GID)]) as sidecar:
        job = _forging_job(sidecar, TRAINER_UID, "keyuid-broken", jobs)
        run = sidecar.run_status("keyuid-broken")
        status = _cli(TRAINER_UID, "status", "--address", sidecar.address)
        log = sidecar.log()
    key = sidecar.state / "summary-signing.pub"
    # (a) The key is the sidecar's alone: the trainer's open() is refused by the kernel.
    assert str(job["key"]).startswith("PermissionError"), job
    info = sidecar.key.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (SIDECAR_UID, 0o600)
    assert (sidecar.state.stat().st_uid, sidecar.state.stat().st_mode & 0o777) == (
        SIDECAR_UID, 0o700)
    # (b) The trainer's run was reported over the socket and judged: its true summary, signed
    # by the sidecar, fails the gate on the run's own verdicts.
    assert run is not None and run.ended and "empty_optimizer" in job["verdicts"], job
    true = _gate(jobs / "keyuid-broken" / "final", key)
    assert true.returncode == 1, true.stdout + true.stderr
    assert "signature verified" in true.stdout
    assert "run_has_critical_verdict [critical]: empty_optimizer" in true.stdout, true.stdout
    # Its forgery, the verdicts taken out and signed with the only key it has: refused.
    assert job["forged_with"] == "its own key"
    forged = _gate(jobs / "keyuid-broken" / "forged", key)
    assert forged.returncode == 1, forged.stdout + forged.stderr
    assert "summary_untrusted_key [critical]" in forged.stdout, forged.stdout
    # The separate uids are said to be so: no warning at start or in status.
    assert status.returncode == 0, status.stderr
    assert WARNING not in log and WARNING not in status.stdout
    assert '"signing_key_readable_by_trainers"' not in log


def test_control_a_trainer_of_the_sidecars_uid_reads_the_key_and_its_forgery_passes(
        shared: Path) -> None:
    """The one-uid set-up (no --trainer-uid: the sidecar's own uid reports): the same job
    reads the key and its forgery passes the strict gate. The sidecar warned."""
    jobs = _jobs(shared, "jobs-one", SIDECAR_UID)
    with SidecarAs(shared / "sc-one", jobs, []) as sidecar:
        job = _forging_job(sidecar, SIDECAR_UID, "keyuid-one", jobs)
        status = _cli(SIDECAR_UID, "status", "--address", sidecar.address)
        log = sidecar.log()
    key = sidecar.state / "summary-signing.pub"
    assert job["key"] == "read" and job["forged_with"] == "the sidecar's key", job
    assert "empty_optimizer" in job["verdicts"], job
    assert _gate(jobs / "keyuid-one" / "final", key).returncode == 1  # the truth fails
    forged = _gate(jobs / "keyuid-one" / "forged", key)
    assert forged.returncode == 0, forged.stdout + forged.stderr  # the forgery passes
    assert f"ok    {jobs / 'keyuid-one' / 'forged'}" in forged.stdout
    [line] = [json.loads(x) for x in log.splitlines() if '"signing_key_readable_by_trainers"' in x]
    assert line["level"] == "warning" and line["uid"] == SIDECAR_UID
    assert line["key"] == str(sidecar.key) and WARNING in line["note"]
    assert status.returncode == 0 and f"WARNING: {WARNING}" in status.stdout, status.stdout


def test_a_trainer_may_not_stop_another_run_and_the_sidecars_uid_may(shared: Path) -> None:
    jobs = _jobs(shared, "jobs-stop", TRAINER_UID)
    with SidecarAs(shared / "sc-stop", jobs, ["--trainer-uid", str(TRAINER_UID),
                                              "--socket-group", str(SHARED_GID)]) as sidecar:
        output = jobs / "victim.log"
        with output.open("wb") as log:  # another job of the trainer's uid: a frozen run
            victim = subprocess.Popen(
                [*_as(TRAINER_UID), sys.executable, str(ROOT / "tests/support/raw_client.py"),
                 "--socket", str(sidecar.socket_path), "--run-id", "keyuid-victim",
                 "--attest", "--interval", "0.2"],
                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd="/")
        try:
            wait_for(lambda: sidecar.run_status("keyuid-victim") or victim.poll() is not None,
                     60, what="the other run registered")
            assert victim.poll() is None, output.read_text()
            refused = _cli(TRAINER_UID, "stop", "keyuid-victim", "--address", sidecar.address)
            assert refused.returncode == 2, refused.stdout + refused.stderr
            assert "PERMISSION_DENIED" in refused.stderr
            assert f"uid {TRAINER_UID} may not stop" in refused.stderr, refused.stderr
            run = sidecar.run_status("keyuid-victim")
            assert run is not None and not [a for a in run.actions if a.detector == "operator"]
            assert "IGNORING" not in output.read_text()
            # On-call, as the sidecar's uid: the STOP goes out, once, and reaches the job.
            done = _cli(SIDECAR_UID, "stop", "keyuid-victim", "--reason", "on-call",
                        "--address", sidecar.address)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "STOP queued" in done.stdout
            wait_for(lambda: "IGNORING ACTION_STOP" in output.read_text(), 30,
                     what="the STOP at the other run's job")
            run = sidecar.run_status("keyuid-victim")
            assert run is not None
            assert [(a.action, a.result) for a in run.actions if a.detector == "operator"] == [
                ("stop", "sent")]
        finally:
            stop_all(victim)
