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
from deadweight.sidecar.exposition.http import MAX_CONNECTIONS, MAX_PER_SOURCE
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


#: Many sources at their own cap: every address in 127.0.0.2..127.0.0.(1+sources) holds
#: MAX_PER_SOURCE half-sent requests, reconnecting whatever the sidecar closes.
MANY = """
import socket, sys, time
port, sources, per, seconds = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                               float(sys.argv[4]))
def connect(source):
    s = socket.socket()
    s.bind((f"127.0.0.{2 + source}", 0))
    s.settimeout(2)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    s.send(b"GET /metrics HTTP/1.1\\r\\n")  # a head that never ends
    return s
conns = [[i % sources, connect(i % sources)] for i in range(sources * per)]
print("holding", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for c in conns:
        try:
            if c[1].recv(1) == b"":
                raise OSError
        except BlockingIOError:
            continue
        except OSError:
            pass
        c[1].close()
        try:
            c[1] = connect(c[0])
        except OSError:
            c[1] = socket.socket()
    time.sleep(0.2)
"""


def test_many_sources_at_their_cap_do_not_crowd_out_the_scraper(
    sidecar: SidecarProcess,
) -> None:
    """1000 slow connections from 125 loopback addresses (8 each, the per-source cap) used to
    fill the global cap of 512: only 5-9 of ~26 scrapes from Prometheus' address got 200. The
    total is now shared fairly: a source holding one connection takes a slot from the source
    holding the most, so every scrape is answered while the flood holds the rest."""
    port = sidecar.metrics_port
    sources, seconds = 125, 20.0
    before = sidecar.metrics()
    turned_away_before = (_counter(before, "deadweight_metrics_http_refused_total")
                          + _counter(before, "deadweight_metrics_http_evicted_total"))
    attacker = subprocess.Popen([sys.executable, "-c", MANY, str(port), str(sources),
                                 str(MAX_PER_SOURCE), str(seconds)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().strip() == "holding"
        answered = [_get(port)[0] for _ in range(26)]
        assert answered == [200] * 26
    finally:
        attacker.kill()
        attacker.wait()
    # The flood really filled the total: no source passed its own cap, so each of its
    # connections past 512 was refused or took another's slot (1000 for 512 slots).
    after = sidecar.metrics()
    turned_away = (_counter(after, "deadweight_metrics_http_refused_total")
                   + _counter(after, "deadweight_metrics_http_evicted_total"))
    assert turned_away - turned_away_before >= sources * MAX_PER_SOURCE - MAX_CONNECTIONS


def _counter(text: str, name: str) -> float:
    return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " "))
