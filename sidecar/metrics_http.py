"""``/metrics`` over HTTP, rendered straight from the collector's families (and the runbooks).

prometheus_client's generic text encoder spends ~5 us per line; with 50 live runs (~1,700
lines) that alone was 10 ms a scrape. The families come from the same collector; only the text
is written here, in the Prometheus text format 0.0.4 (escaping and float spelling as the
client library does), at ~1 us per line.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric

from deadweight.sidecar import runbook_pages

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape_label(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:
        return value  # the common case: nothing to escape, no copies
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _go_float(value: float) -> str:
    """Floats spelled as Prometheus (and the client library) spell them."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def render(families: Iterable[Metric]) -> bytes:
    """The exposition text of the families, one ``# HELP``/``# TYPE`` block each.

    Every sample of a family has the same label names, so they are sorted once per family.
    """
    out: list[str] = []
    append = out.append
    finite = math.isfinite
    for family in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        append(f"# HELP {name} {_escape_help(family.documentation)}\n")
        append(f"# TYPE {name} {family.type}\n")
        order: list[str] | None = None
        for sample in family.samples:
            sample_name = sample.name
            if sample_name.endswith("_created"):
                continue
            value = sample.value
            number = repr(float(value)) if finite(value) else _go_float(value)
            labels = sample.labels
            if not labels:
                append(f"{sample_name} {number}\n")
                continue
            if order is None or len(order) != len(labels):
                order = sorted(labels)
            try:
                text = ",".join([f'{key}="{_escape_label(str(labels[key]))}"'
                                 for key in order])
            except KeyError:  # a sample with other label names than the first
                order = sorted(labels)
                text = ",".join([f'{key}="{_escape_label(str(labels[key]))}"'
                                 for key in order])
            append(f"{sample_name}{{{text}}} {number}\n")
    return "".join(out).encode()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


def _runbook(path: str, start_response: Callable[..., Any]) -> list[bytes]:
    """A shipped runbook as HTML; /runbooks redirects to the index so relative links resolve."""
    if path == "/runbooks":
        start_response("301 Moved Permanently", [("Location", "/runbooks/")])
        return [b""]
    body = runbook_pages.page(path.removeprefix("/runbooks/"))
    if body is None:
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"no such runbook; the index is /runbooks/\n"]
    start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                              ("Content-Length", str(len(body)))])
    return [body]


class MetricsServer:
    """A threaded HTTP server answering ``/metrics`` from a collect function."""

    def __init__(self, host: str, port: int, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect
        self._httpd = make_server(host, port, self._app, ThreadingWSGIServer, _QuietHandler)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="deadweight-metrics", daemon=True
        )
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/runbooks" or path.startswith("/runbooks/"):
            return _runbook(path, start_response)
        if path not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found; try /metrics\n"]
        body = render(self._collect())
        start_response("200 OK", [("Content-Type", CONTENT_TYPE),
                                  ("Content-Length", str(len(body)))])
        return [body]

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
