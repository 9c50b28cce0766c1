"""``deadweight serve --cpu``: every thread of a real sidecar runs on the CPU asked for
(worker threads started later included); a CPU the process may not use is a clear error;
unpinned (the default) the sidecar keeps every CPU it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.tuning import cpu_pin
from tests.support.faults import Pipe
from tests.support.raw_client import healthy_events, run_start


def _thread_cpus(pid: int) -> dict[str, set[int]]:
    """Each thread of the process (name:tid) -> the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[f"{name}:{tid}"] = os.sched_getaffinity(int(tid))
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return out


def _stream_some(sidecar: SidecarProcess) -> None:
    """A run and a few batches of steps, so the worker threads exist."""
    pipe = Pipe(sidecar.address)
    try:
        start = pb.StreamRequest(run_id="pinned", rank=0,
                                 events=[pb.Event(seq=0, run_start=run_start())])
        assert not pipe.send(start).error
        for step in range(1, 11):
            answer = pipe.send(pb.StreamRequest(run_id="pinned", rank=0,
                                                events=healthy_events(step, 2 * step - 1)))
            assert not answer.error, answer.error
            assert answer.ack_seq == 2 * step
    finally:
        pipe.close()


@pytest.mark.parametrize("asked", ["last", "auto"])
def test_every_thread_runs_on_the_one_cpu_asked_for(asked: str, tmp_path: Path) -> None:
    allowed = os.sched_getaffinity(0)
    arg = str(max(allowed)) if asked == "last" else "auto"
    with SidecarProcess(tmp_path / "sc", extra_args=["--cpu", arg]) as sidecar:
        _stream_some(sidecar)
        assert sidecar.process is not None
        threads = _thread_cpus(sidecar.process.pid)
    assert len(threads) > 3  # the event loop, gRPC's and the worker threads
    cpus = set().union(*threads.values())
    assert len(cpus) == 1 and all(len(c) == 1 for c in threads.values()), threads
    assert cpus <= allowed
    if asked == "last":
        assert cpus == {max(allowed)}


def test_unpinned_by_default(tmp_path: Path) -> None:
    allowed = os.sched_getaffinity(0)
    with SidecarProcess(tmp_path / "sc") as sidecar:
        _stream_some(sidecar)
        assert sidecar.process is not None
        threads = _thread_cpus(sidecar.process.pid)
    assert all(c == allowed for c in threads.values()), threads


def test_a_cpu_outside_the_allowed_set_is_a_clear_error(tmp_path: Path) -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run(
        [sys.executable, "-m", "deadweight.cli", "serve", "--socket", str(tmp_path / "s.sock"),
         "--cpu", str(outside)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"--cpu {outside}: this process may only run on CPUs" in done.stderr
    assert "Traceback" not in done.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "deadweight.cli", "serve", "--cpu", "fast"],
        capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected none, auto or a CPU number" in bad.stderr


def test_auto_takes_the_cpu_the_thread_runs_on() -> None:
    allowed = os.sched_getaffinity(0)
    assert cpu_pin.current_cpu() in allowed
    assert cpu_pin.choose("none", allowed) is None
    assert cpu_pin.choose("auto", {min(allowed)}) == min(allowed)
