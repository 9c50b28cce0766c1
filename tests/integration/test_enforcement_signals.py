"""The one function that signals: only the identified process, verified first, via a pidfd."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from deadweight.sidecar.actions.enforcer import send_signal
from deadweight.sidecar.model.process import ProcessIdentity, boot_id, start_time
from tests.support.enforcement_support import assert_never_signalled


@pytest.fixture()
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "120"])
    yield child
    if child.poll() is None:
        child.kill()
        child.wait()


def _identity(pid: int, shift: int = 0, boot: str | None = None) -> ProcessIdentity:
    started = start_time(pid)
    assert started is not None
    return ProcessIdentity(pid, os.getuid(), os.getgid(), started + shift,
                           boot_id() if boot is None else boot)


def test_the_identified_process_gets_the_signal(sleeper: subprocess.Popen[bytes]) -> None:
    assert send_signal(_identity(sleeper.pid), signal.SIGTERM) == "sent"
    assert sleeper.wait(10) == -signal.SIGTERM


def test_a_reused_pid_is_never_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    assert send_signal(_identity(sleeper.pid, shift=1), signal.SIGKILL) == "pid_reused"
    assert send_signal(_identity(sleeper.pid, boot="an-earlier-boot"),
                       signal.SIGKILL) == "pid_reused"
    assert_never_signalled(sleeper)


def test_dry_run_verifies_and_spares(sleeper: subprocess.Popen[bytes]) -> None:
    assert send_signal(_identity(sleeper.pid), signal.SIGKILL, dry_run=True) == "dry_run"
    assert_never_signalled(sleeper)


def test_gone_and_forbidden_targets(sleeper: subprocess.Popen[bytes]) -> None:
    identity = _identity(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert send_signal(identity, signal.SIGTERM) == "gone"
    assert send_signal(_identity(os.getpid()), signal.SIGTERM) == "refused"
    assert send_signal(ProcessIdentity(1, 0, 0, 0, boot_id()), signal.SIGTERM) == "refused"
