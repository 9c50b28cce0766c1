"""How long a real trainer waits for its attestation nonce while another uid floods ``.attest``.

A real ``deadweight serve`` (as root, this machine's test setup) and FLOODERS processes of
another uid (``setpriv --reuid``, in the socket's group) that connect to the ``.attest``
socket in a loop from several threads each, reading each reply, some holding their
connections (``tests/support/trust_client.py --flood --read-replies``). The trainer (this
process) then asks for a nonce, SAMPLES times, exactly as the callback does
(``fetch_attestation``). Two sidecars are compared: one that admits the flooding uid as a
trainer uid (every connection costs a ``/proc`` read, a pidfd and a nonce: the old cost for
any uid) and one with the default trainer uids (the sidecar's own and root), which closes the
flooders' connections after one ``getsockopt``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto.transport import attest_path
from tests.support.trust_client import flood_command

from .common import fmt_time, table

ROOT = Path(__file__).resolve().parent.parent
OTHER_UID = 12345
FLOODERS = 6
SAMPLES = 30

def start_flooders(socket_path: Path, count: int, uid: int = OTHER_UID
                   ) -> list[subprocess.Popen[str]]:
    """count flooding processes of uid (in group 0, the socket's group here), each flooding."""
    argv = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--groups", "0",
            *flood_command(str(attest_path(str(socket_path))), read_replies=True)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flooders = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd="/", env=env) for _ in range(count)]
    for flooder in flooders:
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "flooding"
    return flooders


def stop_flooders(flooders: list[subprocess.Popen[str]]) -> None:
    for flooder in flooders:
        flooder.kill()
        flooder.wait(30)


def nonce_waits(socket_path: Path, samples: int) -> tuple[list[float], int]:
    """Seconds to each nonce, and how many attempts got none (after the client's retries)."""
    waits: list[float] = []
    missed = 0
    for _ in range(samples):
        began = time.perf_counter()
        nonce = fetch_attestation(str(socket_path))
        waits.append(time.perf_counter() - began)
        missed += nonce is None
    return waits, missed


def measure(folder: Path, admit_flooders: bool) -> tuple[list[float], int]:
    extra = ["--trainer-uid", "0", "--trainer-uid", str(OTHER_UID)] if admit_flooders else []
    with SidecarProcess(folder, extra_args=extra) as sidecar:
        flooders = start_flooders(sidecar.socket_path, FLOODERS)
        try:
            return nonce_waits(sidecar.socket_path, SAMPLES)
        finally:
            stop_flooders(flooders)


def run(repeats: int, quick: bool) -> list[list[str]]:
    if os.geteuid() != 0:
        print("\n## attest_flood: needs root (setpriv to another uid); skipped")
        return []
    rows = []
    for admit, what in ((True, "flooding uid admitted (every connection identified)"),
                        (False, "default trainer uids (flooding uid closed at once)")):
        with tempfile.TemporaryDirectory(prefix="deadweight-flood-") as tmp:
            os.chmod(tmp, 0o755)
            waits, missed = measure(Path(tmp), admit)
        rows.append([what, fmt_time(statistics.median(waits)), fmt_time(max(waits)),
                     f"{missed} of {len(waits)}"])
    table(f"nonce wait under a flood of {FLOODERS} processes x 8 threads of another uid",
          ["sidecar", "median", "max", "no nonce"], rows)
    return rows
