"""``.ci/run`` runs every tier in one xdist session and still fails fast on the fast tiers.

A scratch suite under two real xdist workers: a failure in a folder named by
``--stop-at-failure-in`` stops the other worker too, in the middle of its file; a failure
anywhere else stops nothing and every test runs (``tests/support/fail_fast.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLOW_TESTS = 40

CONFTEST = 'pytest_plugins = ["tests.support.fail_fast"]\n'
# The failing fast test waits until the other worker is inside its long file, so the stop
# lands in the middle of it, not before it began.
FAST = '''
import os, time
from pathlib import Path

def test_a_fast_tier_test_fails():
    started = Path(os.environ["SCRATCH_LOG"])
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval of the condition wait
    assert started.exists()
    assert False, "the fast tier's failure"
'''
# Each test stands for a unit of work of the long tier: it logs itself, then works 0.5 s.
SLOW = f'''
import os, time
import pytest

@pytest.mark.parametrize("n", range({SLOW_TESTS}))
def test_slow_work(n):
    with open(os.environ["SCRATCH_LOG"], "a") as log:
        log.write(f"{{n}}\\n")
    time.sleep(float(os.environ["SCRATCH_WORK_SECONDS"]))
    assert n != 3 or os.environ.get("SCRATCH_SLOW_FAILS") != "1", "a long-tier failure"
'''


def _session(root: Path, *args: str, work_seconds: float = 0.5,
             slow_fails: bool = False) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    (root / "fast").mkdir(parents=True)
    (root / "slow").mkdir()
    (root / "conftest.py").write_text(CONFTEST)
    (root / "fast" / "test_fast.py").write_text(FAST)
    (root / "slow" / "test_slow.py").write_text(SLOW)
    log = root / "slow.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCRATCH_LOG": str(log),
           "SCRATCH_WORK_SECONDS": str(work_seconds),
           "SCRATCH_SLOW_FAILS": "1" if slow_fails else "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p",
         "no:cacheprovider", "-q", "--rootdir", str(root), *args, "slow", "fast"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return done, log.read_text().split() if log.exists() else []


def test_a_fast_tier_failure_stops_the_other_worker_mid_file(tmp_path: Path) -> None:
    done, ran = _session(tmp_path, "--stop-at-failure-in", "fast")
    assert done.returncode != 0, done.stdout[-3000:]
    assert "the fast tier's failure" in done.stdout
    assert "fast/test_fast.py::test_a_fast_tier_test_fails failed" in done.stdout, \
        done.stdout[-3000:]  # the reason the session stopped
    assert 1 <= len(ran) < SLOW_TESTS, ran  # begun, and stopped before its end


def test_a_failure_elsewhere_stops_nothing(tmp_path: Path) -> None:
    done, ran = _session(tmp_path, "--stop-at-failure-in", "fast/test_absent.py",
                         work_seconds=0.0, slow_fails=True)
    assert done.returncode == 1, done.stdout[-3000:]
    assert len(ran) == SLOW_TESTS  # every test of the long file ran
    assert "2 failed" in done.stdout and f"{SLOW_TESTS - 1} passed" in done.stdout, \
        done.stdout[-3000:]
