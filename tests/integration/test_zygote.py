"""A job forked from the zygote behaves as a process of its own started with ``python``.

The enforcement and console tests start their training jobs this way
(``tests/support/zygote.py``); what they rely on is checked here on small scripts: argv,
environment, folder and output files; the exit code, a signal's death, Python's normal exit
(atexit handlers, non-daemon threads joined); a fresh import of deadweight; ``wait``'s timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support import zygote
from tests.support.realprocs import wait_for

SCRIPT = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
# a non-daemon thread still at work when the script's last line runs: exit must wait for it
# (it starts its work once the argv line is out: a job slowed down by load keeps the order)
printed = threading.Event()
threading.Thread(target=lambda: (printed.wait(), time.sleep(0.2),
                                 print("thread joined", flush=True))).start()
print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "cwd", os.getcwd(),
      "name", __name__, flush=True)
printed.set()
print("deadweight imported before", "deadweight" in sys.modules, file=sys.stderr)
import deadweight.callbacks
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_job_runs_its_script_as_python_would(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "ZYGOTE_TEST": "from-the-test"}
    done = zygote.shared().run([str(script), "3"], timeout=60, env=env)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [
        f"argv ['3'] env from-the-test cwd {os.getcwd()} name __main__",
        "thread joined", "atexit ran"]
    assert "deadweight imported before False" in done.stderr  # never preloaded


def test_a_forked_job_is_signalled_and_waited_for_as_popen(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    job = zygote.shared().popen([str(script)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=tmp_path)
    assert job.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(0.2)
    # The zygote answers with the pid right after the fork; the child changes to its folder
    # afterwards, and under load that can take longer than the 0.2 s above.
    wait_for(lambda: Path(f"/proc/{job.pid}/cwd").resolve() == tmp_path.resolve(), 30,
             what="the forked job in its folder")
    job.send_signal(signal.SIGUSR1)
    assert job.wait(30) == -signal.SIGUSR1
    job.kill()  # already ended: nothing is sent
    assert job.poll() == -signal.SIGUSR1
