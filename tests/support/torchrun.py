"""Launch ``torchrun`` on loopback with a master port no other test can take meanwhile.

A port picked by binding port 0 and closing it comes from the kernel's ephemeral range: any
connection or server started between the pick and torchrun's own bind may take it
(``EADDRINUSE``). Master ports come instead from a block below that range, which the kernel
never hands out by itself, split between the test workers (one block each, by xdist worker
number), each tried with a bind before use. A launch that still lost its port exits before
any rank starts (the rendezvous store is the agent's first bind), so it is run again on the
next port: nothing reached a sidecar.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

#: The block master ports come from: under the ephemeral range (32768-60999 on Linux).
FIRST_PORT, PORTS_PER_WORKER, WORKERS = 20000, 500, 16
#: How many launches in a row may lose their port before the test fails.
ATTEMPTS = 3
LOST_PORT = ("EADDRINUSE", "address already in use")


def _worker_number() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) % WORKERS if worker[2:].isdigit() else 0


def _candidates() -> Iterator[int]:
    start = FIRST_PORT + _worker_number() * PORTS_PER_WORKER
    # Each process starts at another offset, so two test sessions on one machine differ too.
    offset = os.getpid() % PORTS_PER_WORKER
    for step in itertools.count():
        yield start + (offset + step) % PORTS_PER_WORKER


_ports = _candidates()


def master_port() -> int:
    """A loopback port of this worker's block that binds now."""
    for _ in range(PORTS_PER_WORKER):
        port = next(_ports)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free master port in this worker's block")


def command(script: Sequence[str], nproc: int = 2) -> list[str]:
    """The torchrun command line for script (its path and arguments) on loopback."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port()), *script]


def lost_its_port(stderr: str) -> bool:
    return any(words in stderr for words in LOST_PORT)


def run(script: Sequence[str], env: Mapping[str, str], timeout: float, nproc: int = 2
        ) -> subprocess.CompletedProcess[str]:
    """torchrun script to its end (stdout and stderr captured), launched again on another
    port when it lost its master port before any rank started."""
    for _ in range(ATTEMPTS - 1):
        done = subprocess.run(command(script, nproc), env=dict(env), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode == 0 or not lost_its_port(done.stderr):
            return done
    return subprocess.run(command(script, nproc), env=dict(env), capture_output=True,
                          text=True, timeout=timeout)
