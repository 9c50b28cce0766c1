"""``/metrics`` over HTTP, rendered straight from the collector's families (and the runbooks).

prometheus_client's generic text encoder spends ~5 us per line; with 50 live runs (~2,300
lines) that alone was 10 ms a scrape. The families come from the same collector; only the text
is written here, in the Prometheus text format 0.0.4 (escaping and float spelling as the
client library does), at under 1 us per line: a sample's labels are spelled once and kept.

The endpoint faces anything that can reach its port, so it is bounded: at most
``MAX_CONNECTIONS`` requests are served at once (one thread each; more are answered 503 and
closed at once, counted in ``deadweight_metrics_http_refused_total``), and a connection that
sends nothing for ``READ_TIMEOUT_SECONDS`` is closed, so idle sockets cannot pin threads.
Scrapes that arrive together share one render (``SharedRender``): fifty parallel scrapers
cost about one render each round, not fifty renders fighting over one interpreter.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from deadweight.sidecar import runbook_pages

_Request = socket.socket | tuple[bytes, socket.socket]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Requests served at once (one thread each).
MAX_CONNECTIONS = 32
#: Seconds a connection may stay silent (reading the request or the client's socket).
READ_TIMEOUT_SECONDS = 5.0
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 23\r\nConnection: close\r\n\r\ntoo many connections\r\n\r\n")


def _escape_label(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:
        return value  # the common case: nothing to escape, no copies
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _go_float(value: float) -> str:
    """Floats spelled as Prometheus (and the client library) spell them: its own function, for
    the values where Go's spelling differs from Python's (non-finite, and positive ones from a
    million up, which Go writes with an exponent)."""
    spelled: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return spelled


def _number(value: float) -> str:
    value = float(value)
    return repr(value) if -math.inf < value < 1e6 else _go_float(value)


#: Sample name and labels -> the line up to its value. A run's label text is the same at
#: every scrape; only values change. Cleared when it outgrows the live samples (runs leave).
_prefixes: dict[tuple[object, ...], str] = {}
MAX_CACHED_PREFIXES = 50_000


def _prefix(sample_name: str, labels: dict[str, str]) -> str:
    text = ",".join([f'{key}="{_escape_label(str(labels[key]))}"' for key in sorted(labels)])
    return f"{sample_name}{{{text}}} "


def sample_line(sample_name: str, labels: dict[str, str], value: float) -> str:
    """One sample's line, as ``render`` writes it."""
    number = _number(value)
    return f"{_prefix(sample_name, labels)}{number}\n" if labels else f"{sample_name} {number}\n"


class TextFamily(Metric):
    """A family whose sample lines are already written (``sample_line``); ``render`` copies
    them. Only for this renderer: the client library's encoder sees no samples in it."""

    def __init__(self, name: str, documentation: str, typ: str, lines: str) -> None:
        super().__init__(name, documentation, typ)
        self.lines = lines


def render(families: Iterable[Metric]) -> bytes:
    """The exposition text of the families, one ``# HELP``/``# TYPE`` block each.

    Each sample's text up to its value comes from a cache keyed by its name and labels.
    """
    out: list[str] = []
    append = out.append
    inf = math.inf
    prefixes = _prefixes
    if len(prefixes) > MAX_CACHED_PREFIXES:
        prefixes.clear()
    for family in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        append(f"# HELP {name} {_escape_help(family.documentation)}\n")
        append(f"# TYPE {name} {family.type}\n")
        if isinstance(family, TextFamily):
            append(family.lines)
            continue
        for sample in family.samples:
            sample_name = sample.name
            if sample_name.endswith("_created"):
                continue
            value = float(sample.value)
            number = repr(value) if -inf < value < 1e6 else _go_float(value)
            labels = sample.labels
            if not labels:
                append(f"{sample_name} {number}\n")
                continue
            try:
                key = (sample_name, *labels.items())
                prefix = prefixes.get(key)
                if prefix is None:
                    prefix = prefixes[key] = _prefix(sample_name, labels)
            except TypeError:  # a label value that cannot be a key: spelled every time
                prefix = _prefix(sample_name, labels)
            append(f"{prefix}{number}\n")
    return "".join(out).encode()


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_SECONDS  # applied to the connection's socket before any read

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # timed out or reset by the client: just close
            self.close_connection = True


class _BoundedServer(ThreadingWSGIServer):  # type: ignore[misc]
    """One thread per request, at most ``MAX_CONNECTIONS`` at once; quiet about client errors."""

    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # the listen backlog: a burst is accepted and answered, not dropped

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0

    def process_request(self, request: _Request, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            try:
                assert isinstance(request, socket.socket)  # a TCP server's requests are sockets
                request.settimeout(0.5)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or stalls is not an error of the sidecar."""


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


class SharedRender:
    """One render at a time, its page handed to every scrape that waited for it.

    A scrape never gets a page older than itself: it takes the first render that starts
    after it arrived (a render already under way began before it, so it waits for the next).
    A render that raises fails every scrape that waited for it, as each would have failed.
    """

    def __init__(self, render_page: Callable[[], bytes]) -> None:
        self._render_page = render_page
        self._changed = threading.Condition()
        self._started = 0  # renders begun
        self._finished = 0  # the number of the latest render that finished
        self._rendering = False
        self._page = b""
        self._error: BaseException | None = None
        #: Scrapes waiting for a render right now.
        self.waiting = 0

    def page(self) -> bytes:
        with self._changed:
            wanted = self._started + 1  # the first render to start from now on
            while self._finished < wanted:
                if not self._rendering:
                    self._rendering = True
                    self._started += 1
                    number = self._started
                    break
                self.waiting += 1
                self._changed.wait()
                self.waiting -= 1
            else:
                if self._error is not None:
                    raise RuntimeError("the shared /metrics render failed") from self._error
                return self._page
        page, error = b"", None
        try:
            page = self._render_page()
        except BaseException as err:
            error = err
        with self._changed:
            self._rendering = False
            self._finished = number
            self._page, self._error = page, error
            self._changed.notify_all()
        if error is not None:
            raise error
        return page


class MetricsServer:
    """A threaded HTTP server answering ``/metrics`` from a collect function."""

    def __init__(self, host: str, port: int, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect
        self._shared = SharedRender(self._render)
        self._httpd: _BoundedServer = make_server(host, port, self._app, _BoundedServer,
                                                  _QuietHandler)
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
        body = self._shared.page()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE),
                                  ("Content-Length", str(len(body)))])
        return [body]

    def _render(self) -> bytes:
        return render(self._collect()) + render([self._own_metrics()])

    def _own_metrics(self) -> Metric:
        refused = CounterMetricFamily(
            "deadweight_metrics_http_refused",
            f"/metrics connections refused because {MAX_CONNECTIONS} were being served.")
        refused.add_metric([], float(self._httpd.refused))
        return refused

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
