"""A silent run: gone or frozen is critical, a process stopped on purpose is a warning.

Real ``deadweight serve``, real attested client processes on its unix socket. Each client
registers a run and reports steps, then falls silent: one idles (alive, running, silent: a
frozen training process looks the same to the sidecar), the other is stopped with SIGSTOP, as a
scheduler suspends a job. Both pass ``stalled_seconds``; the sidecar reads the stopped one's
state in /proc and pages only the frozen one as critical.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from tests.support.realprocs import wait_for
from tests.support.trust_party import Client

pytestmark = pytest.mark.slow

#: Longer than the sidecar's exit check (every 5 s), so it has read a stopped process's
#: state before the silence counts.
STALLED_SECONDS = 8


def _stalled(sidecar: SidecarProcess, run_id: str) -> pb.Finding | None:
    status = sidecar.run_status(run_id)
    if status is None:
        return None
    return next((f for f in status.findings if f.detector == "stalled" and f.firing), None)


def test_a_suspended_process_is_a_warning_a_frozen_one_critical(tmp_path: Path) -> None:
    with SidecarProcess(tmp_path, extra_args=[
            "--setting", f"stalled_seconds={STALLED_SECONDS}",
            "--setting", "stalled_step_seconds=3600"]) as sidecar:
        frozen, suspended = Client(sidecar, "frozen"), Client(sidecar, "suspended")
        try:
            for client in (frozen, suspended):
                assert not client.do(start={"seq": 1})["error"]
                assert not client.do(steps=[1, 3], seq=2)["error"]
            os.kill(suspended.proc.pid, signal.SIGSTOP)
            try:
                found: dict[str, pb.Finding] = {}

                def both() -> bool:
                    for run_id in ("frozen", "suspended"):
                        finding = _stalled(sidecar, run_id)
                        if finding is not None:
                            found[run_id] = finding
                    return len(found) == 2

                wait_for(both, 60, what="both silent runs judged stalled")
            finally:
                os.kill(suspended.proc.pid, signal.SIGCONT)
            assert found["frozen"].severity == "critical"
            assert "stopped (SIGSTOP" not in found["frozen"].summary
            assert found["suspended"].severity == "warning"
            assert "stopped (SIGSTOP" in found["suspended"].summary, found["suspended"].summary
        finally:
            frozen.close()
            suspended.close()
