"""Real HTTP receivers on 127.0.0.1 for the pager outbox's tests: they answer, fail, drip
their answer a byte at a time, or redirect, as the test switches them."""

from __future__ import annotations

import http.server
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

OK = "ok"
FAIL = "fail"  # 503
DRIP = "drip"  # a 200, one byte every DRIP_SECONDS (each read well inside any read timeout)
REDIRECT = "redirect"  # 302 to ``location``
DRIP_SECONDS = 0.3


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float = field(default_factory=time.time)


class Receiver:
    """A webhook and an Alertmanager API (``/api/v2/alerts``) on one port."""

    def __init__(self, mode: str = OK, port: int = 0, location: str = "",
                 drip_detector: str = "") -> None:
        self.mode = mode
        self.location = location
        #: In mode OK, drip the answer to messages about this detector only.
        self.drip_detector = drip_detector
        self.received: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                receiver._note("GET", self.path, dict(self.headers), None)
                self._answer(200)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                mode = receiver.mode
                if mode == OK and receiver.drip_detector and isinstance(
                        body := json.loads(raw), dict) and body.get(
                        "detector") == receiver.drip_detector:
                    mode = DRIP
                if mode == DRIP:
                    receiver._note("POST-drip", self.path, dict(self.headers),
                                   json.loads(raw))
                    self._drip()
                    return
                if mode == FAIL:
                    self._answer(503)
                    return
                if mode == REDIRECT:
                    self.send_response(302)
                    self.send_header("Location", receiver.location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                receiver._note("POST", self.path, dict(self.headers), json.loads(raw))
                self._answer(200)

            def _answer(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _drip(self) -> None:
                answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
                try:
                    for byte in answer:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(DRIP_SECONDS)
                except OSError:
                    pass  # the sender gave up: what this receiver is for

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _note(self, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        with self._lock:
            self.received.append(Received(method, path, headers, body))

    def requests(self, method: str = "POST", path: str | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.received
                    if r.method == method and (path is None or r.path == path)]

    def messages(self, run_id: str, path: str) -> dict[str, int]:
        """detector -> webhook messages about the run delivered to path."""
        counts: dict[str, int] = {}
        for r in self.requests("POST", path):
            if r.body.get("run_id") == run_id:
                counts[r.body["detector"]] = counts.get(r.body["detector"], 0) + 1
        return counts

    def alerts(self, run_id: str, detector: str) -> list[tuple[float, dict[str, Any]]]:
        """(arrival time, alert) of every alert of the run's detector posted here."""
        return [(r.at, a) for r in self.requests("POST", "/api/v2/alerts") for a in r.body
                if a["labels"]["run_id"] == run_id and a["labels"]["detector"] == detector]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
