"""``/metrics`` over HTTP, rendered straight from the collector's families (and the runbooks).

prometheus_client's generic text encoder spends ~5 us per line; with 50 live runs (~2,300
lines) that alone was 10 ms a scrape. The families come from the same collector; only the text
is written here, in the Prometheus text format 0.0.4 (escaping and float spelling as the
client library does), at under 1 us per line: a sample's labels are spelled once and kept.

The endpoint faces anything that can reach its port, so it is bounded: at most
``MAX_CONNECTIONS`` requests are served at once (one thread each, kept between requests; more
are answered 503 and closed at once, counted in ``deadweight_metrics_http_refused_total``),
and a connection that sends nothing for ``READ_TIMEOUT_SECONDS`` is closed, so idle sockets
cannot pin threads.
Scrapes that arrive together share one render (``SharedRender``): fifty parallel scrapers
cost about one render each round, not fifty renders fighting over one interpreter.
"""

from __future__ import annotations

import math
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from . import runbook_pages

_Request = socket.socket | tuple[bytes, socket.socket]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Requests served at once (one thread each).
MAX_CONNECTIONS = 32
#: Seconds a connection may stay silent (reading the request or the client's socket).
READ_TIMEOUT_SECONDS = 5.0
#: Request threads kept while no request comes; more end after ``IDLE_WORKER_SECONDS``.
CORE_WORKERS = 1
IDLE_WORKER_SECONDS = 5.0
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


#: Spellings of finite values from a million up (parameter counts, Unix times), which take
#: the slow path: such a float equals another only when their bits (and spelling) are equal.
_large: dict[float, str] = {}
MAX_CACHED_LARGE = 10_000


def number(value: float) -> str:
    """A sample's value as the client library spells it."""
    value = float(value)
    if -math.inf < value < 1e6:
        return repr(value)
    spelled = _large.get(value)
    if spelled is None:
        spelled = _go_float(value)
        if 1e6 <= value < math.inf:  # not NaN (never equal to itself) nor an infinity
            if len(_large) >= MAX_CACHED_LARGE:
                _large.clear()
            _large[value] = spelled
    return spelled


#: Sample name and labels -> the line up to its value. A run's label text is the same at
#: every scrape; only values change. Cleared when it outgrows the live samples (runs leave).
_prefixes: dict[tuple[object, ...], str] = {}
MAX_CACHED_PREFIXES = 50_000


def sample_prefix(sample_name: str, labels: dict[str, str]) -> str:
    """A sample's line up to its value: the name and the labels, sorted and escaped."""
    text = ",".join([f'{key}="{_escape_label(str(labels[key]))}"' for key in sorted(labels)])
    return f"{sample_name}{{{text}}} "


def sample_line(sample_name: str, labels: dict[str, str], value: float) -> str:
    """One sample's line, as ``render`` writes it."""
    spelled = number(value)
    return (f"{sample_prefix(sample_name, labels)}{spelled}\n" if labels
            else f"{sample_name} {spelled}\n")


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
            spelled = repr(value) if -inf < value < 1e6 else number(value)
            labels = sample.labels
            if not labels:
                append(f"{sample_name} {spelled}\n")
                continue
            try:
                key = (sample_name, *labels.items())
                prefix = prefixes.get(key)
                if prefix is None:
                    prefix = prefixes[key] = sample_prefix(sample_name, labels)
            except TypeError:  # a label value that cannot be a key: spelled every time
                prefix = sample_prefix(sample_name, labels)
            append(f"{prefix}{spelled}\n")
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


class _BoundedServer(WSGIServer):
    """At most ``MAX_CONNECTIONS`` requests at once, served by kept worker threads; quiet
    about client errors.

    A thread started per request made every scrape wait for a new thread to be scheduled
    (``Thread.start`` blocks until it runs): on a loaded machine that was most of a scrape's
    time. Workers are kept instead and handed requests; ``CORE_WORKERS`` stay for the next
    scrape, any more end after ``IDLE_WORKER_SECONDS`` without work.
    """

    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # the listen backlog: a burst is accepted and answered, not dropped

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before binding: a port that cannot be bound makes the base class call
        # server_close(), which reads these.
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0
        self._work = threading.Condition()
        self._pending: deque[tuple[_Request, Any]] = deque()
        self._idle = 0  # workers waiting for a request
        self._workers = 0
        self._stopping = False
        super().__init__(*args, **kwargs)

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
        with self._work:
            self._pending.append((request, client_address))
            if self._idle >= len(self._pending):
                self._work.notify()
                return
            self._workers += 1
        try:
            threading.Thread(target=self._worker, name="deadweight-metrics-request",
                             daemon=True).start()
        except BaseException:  # no thread to serve it: taken back, and closed by the caller
            with self._work:
                self._workers -= 1
                if (request, client_address) in self._pending:
                    self._pending.remove((request, client_address))
                    self._slots.release()
            raise

    def _next(self) -> tuple[_Request, Any] | None:
        """The next request, or None when this worker should end (idle too long, stopping)."""
        with self._work:
            self._idle += 1
            try:
                while not self._pending:
                    if self._stopping:
                        break
                    woken = self._work.wait(IDLE_WORKER_SECONDS)
                    if not woken and not self._pending and self._workers > CORE_WORKERS:
                        break
                else:
                    return self._pending.popleft()
                self._workers -= 1
                return None
            finally:
                self._idle -= 1

    def _worker(self) -> None:
        while (item := self._next()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or stalls is not an error of the sidecar."""

    def server_close(self) -> None:
        super().server_close()
        with self._work:
            self._stopping = True
            self._work.notify_all()


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
