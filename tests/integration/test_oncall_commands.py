"""On-call's hands on a real training run: ``deadweight silence`` keeps one detector from
paging until the silence expires (then it pages), ``deadweight stop`` ends the run through the
journaled STOP path, once; a uid other than the sidecar's own or root is refused both."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.files import DB_NAME
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import journal, start_job, stop_all
from tests.support.realprocs import wait_for

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 12345
#: The short silence that replaces the first one once the verdict was held back by it.
SILENCE_SECONDS = 3.0


class Receiver(http.server.BaseHTTPRequestHandler):
    """Stands in for Alertmanager's API v2: keeps every alert posted, with its arrival (a
    silence the sidecar posts to mute a page it takes back is answered, not kept)."""

    alerts: list[tuple[float, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        now = time.time()
        if self.path.endswith("/silences"):
            answer = json.dumps({"silenceID": "s1"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        type(self).alerts.extend((now, alert) for alert in body)
        self.send_response(200)
        self.end_headers()

    def do_DELETE(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[type[Receiver]]:
    Receiver.alerts = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Receiver.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield Receiver
    server.shutdown()
    server.server_close()


def received(receiver: type[Receiver], run_id: str, detector: str) -> list[float]:
    """When firing alerts (endsAt still ahead) for the run's detector arrived."""
    return [at for at, alert in receiver.alerts
            if alert["labels"].get("run_id") == run_id
            and alert["labels"].get("detector") == detector
            and datetime.fromisoformat(alert["endsAt"].replace("Z", "+00:00")).timestamp()
            > at]


def cli(*argv: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "deadweight.cli", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd="/")


def test_silence_then_stop_a_real_training_run(
        tmp_path: Path, tiny: tuple[Path, Path], receiver: type[Receiver]) -> None:
    run_id = "job-oncall"
    url: str = receiver.url  # type: ignore[attr-defined]
    with SidecarProcess(tmp_path / "sc", extra_args=[
            "--alertmanager-url", url, "--state-dir", str(tmp_path / "state")]) as sidecar:
        # Set before the job starts (its start-up time varies), long enough to outlast it.
        silenced = cli("silence", run_id, "frozen_weights", "--for", "10m",
                       "--reason", "known frozen adapter", "--address", sidecar.address)
        assert silenced.returncode == 0, silenced.stderr
        assert "does not page" in silenced.stdout
        job = start_job(tiny, tmp_path / "jobs", sidecar.address, run_id, "obey",
                        step_pause=0.05)
        try:
            # The frozen verdict stands while silenced: journaled as held back, not paged.
            # The detector that is not silenced pages meanwhile (the control).
            wait_for(lambda: ("page", "silenced") in journal(_store(tmp_path), run_id), 90,
                     what="frozen_weights held back by the silence")
            wait_for(lambda: received(receiver, run_id, "empty_optimizer"), 30,
                     what="the page of the detector that is not silenced")
            status = cli("status", "--address", sidecar.address)
            assert "silenced frozen_weights until" in status.stdout, status.stdout
            assert "known frozen adapter" in status.stdout
            metrics = sidecar.metrics()
            assert (f'deadweight_detector_silenced{{detector="frozen_weights",run_id="{run_id}"}}'
                    ' 1.0') in metrics
            assert not received(receiver, run_id, "frozen_weights")
            # A short silence replaces it and expires by itself; the verdict still stands, so
            # it pages then.
            asked = time.time()  # the silence ends SILENCE_SECONDS after the sidecar got it
            short = cli("silence", run_id, "frozen_weights", "--for", f"{SILENCE_SECONDS:g}s",
                        "--address", sidecar.address)
            assert short.returncode == 0, short.stderr
            assert not received(receiver, run_id, "frozen_weights")
            wait_for(lambda: received(receiver, run_id, "frozen_weights"),
                     SILENCE_SECONDS + 30, what="the page after the silence expired")
            first = min(received(receiver, run_id, "frozen_weights"))
            assert first >= asked + SILENCE_SECONDS
            wait_for(lambda: ("page", "delivered") in journal(_store(tmp_path), run_id), 30,
                     what="the page journaled as delivered")
            actions = journal(_store(tmp_path), run_id)
            assert actions.index(("silence", "set")) < actions.index(("page", "silenced")) \
                < actions.index(("silence", "replaced")) < actions.index(("silence", "expired")) \
                < actions.index(("page", "delivered"))  # the row queued, then delivered
            assert "deadweight_detector_silenced{" not in sidecar.metrics()

            # STOP by hand: the real trainer ends training by itself.
            stopped = cli("stop", run_id, "--reason", "on-call ends it", "--address",
                          sidecar.address)
            assert stopped.returncode == 0, stopped.stderr
            assert "STOP queued" in stopped.stdout
            assert job.wait(90) == 0
            log = (tmp_path / "jobs" / f"{run_id}.log").read_text()
            assert "TRAINING_ENDED" in log
            assert "deadweight STOPPED run" in log  # the console's STOP line, with its cause
            assert "operator: stopped by on-call: on-call ends it" in log
            again = cli("stop", run_id, "--address", sidecar.address)
            assert again.returncode in (0, 2)
            operator = [(a.action, a.result) for a in _store(tmp_path).actions(run_id,
                                                                                "operator")]
            assert operator == [("stop", "sent")]  # exactly once
            [row] = _store(tmp_path).actions(run_id, "operator")
            assert row.detail["reason"] == "on-call ends it" and row.detail["by_uid"] == 0
            final = cli("status", "--address", sidecar.address)
            assert "stopped by operator" in final.stdout, final.stdout
        finally:
            stop_all(job)


def _store(tmp_path: Path) -> Store:
    assert (tmp_path / "state" / DB_NAME).exists()
    return Store(tmp_path / "state")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder the second uid can traverse (pytest's own temp root is private)."""
    folder = Path(tempfile.mkdtemp(prefix="deadweight-oncall-", dir="/tmp"))
    os.chmod(folder, 0o755)
    yield folder


def test_a_trainer_uid_that_attests_may_not_stop_or_silence(
        shared: Path, tiny: tuple[Path, Path]) -> None:
    """The second uid may report runs (--trainer-uid) and attests fine, yet is refused."""
    other = ("setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--groups", "0")
    with SidecarProcess(shared / "sc", extra_args=[
            "--trainer-uid", "0", "--trainer-uid", str(OTHER_UID)],
            watch_roots=[shared]) as sidecar:
        os.chmod(shared / "sc", 0o755)
        job = start_job(tiny, shared / "jobs", sidecar.address, "job-kept", "obey",
                        step_pause=0.05)
        try:
            wait_for(lambda: sidecar.run_status("job-kept"), 90, what="the run registered")
            for argv in (("stop", "job-kept"), ("silence", "job-kept", "frozen_weights")):
                refused = cli(*argv, "--address", sidecar.address, prefix=other)
                assert refused.returncode == 2
                assert "PERMISSION_DENIED" in refused.stderr, refused.stderr
                assert f"uid {OTHER_UID} may not" in refused.stderr
            run = sidecar.run_status("job-kept")
            assert run is not None and not run.silences
            assert not [a for a in run.actions if a.detector == "operator"]
            assert job.poll() is None  # still training
            # TCP is no way around it either: the commands name a unix socket only.
            tcp = cli("stop", "job-kept", "--address", "127.0.0.1:1")
            assert tcp.returncode == 2 and "unix socket only" in tcp.stderr
        finally:
            stop_all(job)


SIDECAR_UID, OPERATOR_UID = 12347, 12348


class _SidecarAs(SidecarProcess):
    """``deadweight serve`` as SIDECAR_UID, whose uid is also the trainers' (the default)."""

    def command(self) -> list[str]:
        return ["setpriv", "--reuid", str(SIDECAR_UID), "--regid", str(SIDECAR_UID),
                "--groups", "0", *super().command()]


def test_a_job_of_the_sidecars_own_uid_may_not_stop_another_run(shared: Path) -> None:
    """Where jobs run as the sidecar's uid (the quick start, the compose stack), a job used to
    stop any other, healthy run with ``deadweight stop``: the sidecar's uid was always an
    operator. Now it is one only when it is no trainer uid; on-call gets root or its own
    ``--operator-uid``, which a training job does not have."""
    from deadweight.proto import pb
    from tests.support.faults import Pipe
    from tests.support.raw_client import run_start

    folder = shared / "own-uid"
    (folder / "sc").mkdir(parents=True)
    for made in (folder, folder / "sc"):
        os.chown(made, SIDECAR_UID, SIDECAR_UID)
    as_job = ("setpriv", "--reuid", str(SIDECAR_UID), "--regid", str(SIDECAR_UID),
              "--groups", "0")
    # On-call is in the socket's group (the sidecar's), as a trainer of another uid would be.
    as_operator = ("setpriv", "--reuid", str(OPERATOR_UID), "--regid", str(OPERATOR_UID),
                   "--groups", f"0,{SIDECAR_UID}")
    with _SidecarAs(folder / "sc", extra_args=["--operator-uid", str(OPERATOR_UID)],
                    watch_roots=[shared]) as sidecar:
        os.chmod(folder / "sc", 0o755)
        os.chmod(folder / "sc" / "sock", 0o755)
        pipe = Pipe(sidecar.address)  # root, a trainer uid by default, reports a run
        try:
            answer = pipe.send(pb.StreamRequest(run_id="job-healthy", events=[
                pb.Event(run_start=run_start())]))
            assert not answer.error, answer.error
            refused = cli("stop", "job-healthy", "--address", sidecar.address, prefix=as_job)
            assert refused.returncode == 2, refused.stdout + refused.stderr
            assert f"uid {SIDECAR_UID} may not stop" in refused.stderr, refused.stderr
            run = sidecar.run_status("job-healthy")
            assert run is not None and not [a for a in run.actions if a.detector == "operator"]
            done = cli("stop", "job-healthy", "--address", sidecar.address, "--reason",
                       "on-call", prefix=as_operator)
            assert done.returncode == 0, done.stdout + done.stderr
            run = sidecar.run_status("job-healthy")
            assert run is not None and [a for a in run.actions if a.detector == "operator"]
        finally:
            pipe.close()
