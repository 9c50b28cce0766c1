"""/metrics stays up under slow clients, against a real ``deadweight serve`` on loopback.

About 32 slow connections used to blind /metrics for everyone (0 of 30 scrapes answered):
one cap for all clients, a timeout per read rather than per request. Here a real attacker
process holds 400 half-sent requests open from one loopback source (127.0.0.2), trickling a
byte to each every half second and reconnecting whatever is closed, for a bounded 25 s; all
the while, scrapes from another source (127.0.0.1) keep succeeding. Methods other than GET
and HEAD get 405.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.sidecar.exposition.http import MAX_PER_SOURCE
from tests.support.faults import metric_value
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow

CONNECTIONS = 400
SECONDS = 25.0
#: The attacker: CONNECTIONS half-sent requests from 127.0.0.2, a byte each per 0.5 s.
SLOW = """
import socket, sys, time
port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
head = b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n" + b"X-Slow: " + b"a" * 4000
def connect():
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    s.settimeout(2)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    return [s, 0]
conns, opened, deadline = [], 0, time.monotonic() + seconds
while len(conns) < count:
    conns.append(connect()); opened += 1
print("holding", flush=True)
while time.monotonic() < deadline:
    for c in conns:
        try:
            c[0].send(head[c[1]:c[1] + 1]); c[1] += 1
            c[0].recv(1)  # b"" or a 503: the sidecar closed it
            c[0].close(); c[:] = connect(); opened += 1
        except BlockingIOError:
            pass
        except OSError:
            c[0].close(); c[:] = connect(); opened += 1
    time.sleep(0.5)  # the attack's own pace: one byte per connection every half second
print(opened, flush=True)
"""


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with SidecarProcess(tmp_path_factory.mktemp("slow-metrics")) as process:
        yield process


def _get(port: int, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, "/metrics")
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_scrapes_succeed_while_one_source_holds_hundreds_of_half_sent_requests(
    sidecar: SidecarProcess,
) -> None:
    port = sidecar.metrics_port
    attacker = subprocess.Popen([sys.executable, "-c", SLOW, str(port), str(CONNECTIONS),
                                 str(SECONDS)], stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().strip() == "holding"
        served, started = 0, time.monotonic()
        while time.monotonic() - started < SECONDS - 5:
            status, body = _get(port)
            assert status == 200 and b"deadweight_" in body
            served += 1
        assert served >= 30
        opened = int(attacker.stdout.readline())
        assert attacker.wait(30) == 0
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    assert opened >= CONNECTIONS
    text = sidecar.metrics()
    refused = metric_value(text, "deadweight_metrics_http_refused_total") or float(
        next(x.split()[-1] for x in text.splitlines()
             if x.startswith("deadweight_metrics_http_refused_total ")))
    assert refused >= CONNECTIONS - MAX_PER_SOURCE
    timeouts = next(float(x.split()[-1]) for x in text.splitlines()
                    if x.startswith("deadweight_metrics_http_timeouts_total "))
    assert timeouts >= 1  # the half-sent heads missed their deadline


def test_only_get_and_head_are_served(sidecar: SidecarProcess) -> None:
    port = sidecar.metrics_port
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
        status, _ = _get(port, method)
        assert status == 405, method
    status, body = _get(port, "HEAD")
    assert status == 200 and body == b""
    assert _get(port)[0] == 200


def test_a_source_past_its_cap_gets_503_and_its_slots_come_back(
    sidecar: SidecarProcess, tmp_path: Path,
) -> None:
    import socket

    port = sidecar.metrics_port
    held = [socket.create_connection(("127.0.0.1", port), timeout=10)
            for _ in range(MAX_PER_SOURCE)]
    try:
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert extra.recv(64).startswith(b"HTTP/1.0 503")
        extra.close()
        # The held ones send nothing: closed at the head deadline, then scrapes are served.
        wait_for(lambda: _get(port)[0] == 200, timeout=30, what="a slot to come back")
    finally:
        for conn in held:
            conn.close()
