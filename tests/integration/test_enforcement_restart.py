"""A sidecar killed (SIGKILL) in the middle of an incident resumes it and repeats nothing.

A real frozen SFT job that ignores STOP and SIGTERM reports to a real sidecar (policy kill,
state dir, pages to an HTTP receiver that records every Alertmanager API v2 push). Right after
the SIGTERM, the sidecar is SIGKILLed and restarted on the same state dir: the page is not
sent again (the receiver sees one alert start time, the journal one page), STOP and SIGTERM
are not repeated, the SIGKILL comes once when its grace is over, and the incident and the
checkpoint hashes from before the crash are still there.
"""

from __future__ import annotations

import http.server
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import (
    enforcement_outcome,
    journal,
    kill_sidecar,
    start_job,
    stop_all,
    wait_journal,
)
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

RUN = "restart-job"


class AlertReceiver:
    """Records each alert of every POST to /api/v2/alerts with its arrival time."""

    def __init__(self) -> None:
        self.alerts: list[tuple[float, dict[str, Any]]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                now = time.time()
                receiver.alerts.extend((now, alert) for alert in json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def frozen(self, since: float = 0.0) -> list[dict[str, Any]]:
        return [a for at, a in self.alerts if at >= since
                and a["labels"].get("alertname") == "DeadweightFrozenWeights"
                and a["labels"].get("run_id") == RUN]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[AlertReceiver]:
    fake = AlertReceiver()
    yield fake
    fake.close()


def test_restart_mid_incident_repeats_nothing(
    tiny: tuple[Path, Path], tmp_path: Path, receiver: AlertReceiver
) -> None:
    state = tmp_path / "state"

    def sidecar() -> Any:
        return kill_sidecar(tmp_path / "sidecar", state, stop_grace=1.0, kill_grace=5.0,
                            extra_args=["--alertmanager-url", receiver.url])

    first = sidecar().start()
    job = start_job(tiny, tmp_path / "jobs", first.address, RUN, "ignore_term", save_steps=2)
    store = Store(state)
    try:
        wait_journal(store, RUN, ("sigterm", "sent"), 300)
        assert first.process is not None
        first.process.kill()  # SIGKILL: no chance to flush or clean up
        first.process.wait(10)
        crashed_at = time.time()
        checkpoints_before = store.checkpoints(RUN)
        (incident_before,) = [i for i in store.incidents(RUN) if i.detector == "frozen_weights"]
        wait_for(lambda: receiver.frozen(), 10, what="the first page at the receiver")
        assert job.poll() is None  # ignoring SIGTERM, still training

        second = sidecar().start()
        try:
            assert job.wait(60) == -signal.SIGKILL
            wait_for(lambda: enforcement_outcome(store, RUN) == "killed", 30,
                     what="the escalation to close")
            metrics = second.metrics()
            run = second.run_status(RUN)
        finally:
            second.stop()
    finally:
        stop_all(job)
        first.stop()

    assert journal(store, RUN) == [
        ("page", "queued"), ("stop", "sent"), ("sigterm", "sent"),  # before the crash
        ("page", "reasserted"), ("stop", "requeued"), ("sigkill", "sent"), ("exit", "exited"),
    ]
    sigterm, sigkill = (next(a for a in store.actions(RUN) if a.action == name)
                        for name in ("sigterm", "sigkill"))
    assert sigterm.pid == sigkill.pid == job.pid
    assert sigkill.time >= sigterm.time + 5.0  # the grace ran on across the restart

    # One page: every push of this alert, before and after the crash, has one start time.
    starts = {alert["startsAt"] for alert in receiver.frozen()}
    assert len(starts) == 1, receiver.frozen()
    assert receiver.frozen(since=crashed_at)  # re-asserted after the restart, same start

    (incident_after,) = [i for i in store.incidents(RUN) if i.detector == "frozen_weights"]
    assert (incident_after.incident, incident_after.fired_at) == (
        incident_before.incident, incident_before.fired_at)
    assert incident_after.resolved_at is not None  # the killed run ended, the page resolved
    assert checkpoints_before, "the job saved no checkpoint before the crash"
    assert checkpoints_before == store.checkpoints(RUN)[:len(checkpoints_before)]
    assert run is not None and run.ended
    (finding,) = [f for f in run.findings if f.detector == "frozen_weights"]
    assert finding.policy == "kill"
    checkpoints_metric = next(
        line for line in metrics.splitlines()
        if line.startswith("deadweight_checkpoints_total{") and f'run_id="{RUN}"' in line)
    assert float(checkpoints_metric.rsplit(" ", 1)[1]) >= len(checkpoints_before)
