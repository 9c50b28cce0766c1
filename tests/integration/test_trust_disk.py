"""A full disk under a real ``deadweight serve``: a real 2 MB tmpfs as the state dir.

The verdict that fires while nothing can be journaled stays pending (no page, no STOP that
the journal does not know of); once space returns it fires, and its STOP reaches the job.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.store.journal import Store
from tests.integration.test_trust_runs import Client
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "state"
    mount.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(folder: Path) -> Path:
    """Write until the disk says ENOSPC; the file is the space to give back later."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _metric(process: SidecarProcess, name: str) -> float:
    line = next(x for x in process.metrics().splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def _frozen_firing(process: SidecarProcess) -> bool:
    status = process.run_status("disk-full")
    assert status is not None
    return any(f.firing for f in status.findings if f.detector == "frozen_weights")


def test_a_full_disk_keeps_the_verdict_pending_and_fires_it_when_space_returns(
    small_disk: Path, tmp_path: Path,
) -> None:
    with SidecarProcess(tmp_path / "sidecar", policies={"frozen_weights": "stop"},
                        extra_args=["--state-dir", str(small_disk)]) as process:
        job = Client(process, "disk-full")
        try:
            assert not job.do(start={"seq": 1})["error"]
            filler = _fill(small_disk)
            answer = job.do(steps=[1, 10], kind="frozen", seq=2)
            assert not answer["error"] and not answer["directives"]
            wait_for(lambda: _metric(process, "deadweight_verdicts_pending_total") > 0,
                 what="the verdict to be held pending")
            assert _metric(process, "deadweight_state_write_failures_total") > 0
            # Each tick tries the verdict again: it fires in memory, then the failed journal
            # write takes it back, so a status read between the two sees it firing for a
            # moment (5 of 10,000 reads on an idle machine). Held pending, it is seen not
            # firing between the tries; fired for good, it never would be.
            wait_for(lambda: not _frozen_firing(process), 30,
                     what="the frozen verdict not firing between the tick's tries")
            assert "verdict_pending" in process.log_path.read_text()

            filler.unlink()  # space returns: the next evaluation journals and fires

            def stopped() -> bool:
                return "ACTION_STOP" in job.do(steps=[11, 11], kind="frozen",
                                               seq=22)["directives"]

            wait_for(stopped, timeout=30, what="STOP once the journal takes writes again")
        finally:
            job.close()
    store = Store(small_disk)
    actions = [(a.detector, a.action, a.result) for a in store.actions("disk-full")]
    store.close()
    assert ("frozen_weights", "stop", "sent") in actions
