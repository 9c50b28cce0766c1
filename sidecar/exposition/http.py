"""``/metrics`` over HTTP, rendered straight from the collector's families (and the runbooks).

prometheus_client's generic text encoder spends ~5 us per line; with 50 live runs (~2,300
lines) that alone was 10 ms a scrape. The families come from the same collector; only the text
is written here, in the Prometheus text format 0.0.4 (escaping and float spelling as the
client library does), at under 1 us per line: a sample's labels are spelled once and kept.

The endpoint faces anything that can reach its port (the manifest serves it on 0.0.0.0), so
slow clients must not blind it: it is one event loop, where an open connection costs no
thread; each source address may hold ``MAX_PER_SOURCE`` connections (more are answered 503
and closed at once, counted in ``deadweight_metrics_http_refused_total``), all sources
``MAX_CONNECTIONS``, shared fairly (``_Connections``: a scraper is never crowded out by many
sources at their own cap), and a request head
must arrive whole within ``HEAD_DEADLINE_SECONDS`` (one deadline, not one per read), so a
source trickling hundreds of half-sent requests holds at most its few slots for a few
seconds while every other source is scraped as usual.
Scrapes that arrive together share one render (``SharedRender``): fifty parallel scrapers
cost about one render each round, not fifty renders fighting over one interpreter.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from . import runbook_pages

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Connections one source address may hold open at once (a scraper needs one or two).
MAX_PER_SOURCE = 8
#: Connections open at once, all sources together (each costs a coroutine, no thread).
MAX_CONNECTIONS = 512
#: Seconds for a whole request head to arrive, from the connection (or the previous answer).
HEAD_DEADLINE_SECONDS = 5.0
#: Longest request head read (a scrape's is a few hundred bytes).
MAX_HEAD_BYTES = 8192
#: Threads that render the page (scrapes arriving together share one render).
RENDER_WORKERS = 2
LISTEN_BACKLOG = 128
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


class _Connections:
    """Open connections by source address: what the per-source and total caps count.

    The total cap is shared fairly: when it is full, a newcomer whose source would hold fewer
    connections than the source holding the most takes that source's oldest connection (it
    is cancelled). So many sources each at their own cap (125 loopback addresses, 8 slow
    connections each) cannot crowd out a scraper that holds one or two.
    """

    def __init__(self) -> None:
        self.by_source: dict[str, list[asyncio.Task[None]]] = {}
        self.total = 0
        #: Connections cancelled to let a source holding fewer in.
        self.evicted = 0

    def admit(self, source: str, task: asyncio.Task[None]) -> bool:
        held = self.by_source.get(source, [])
        if len(held) >= MAX_PER_SOURCE:
            return False
        if self.total >= MAX_CONNECTIONS and not self._evict_for(len(held)):
            return False
        self.by_source.setdefault(source, []).append(task)
        self.total += 1
        return True

    def _evict_for(self, held: int) -> bool:
        """Cancel the oldest connection of the source holding the most, when it holds more
        than the newcomer's source would after admission; False when none does."""
        most = max(self.by_source.values(), key=len, default=[])
        if len(most) <= held + 1:
            return False
        most[0].cancel()  # its own clean-up (``leave``) runs when it is cancelled
        self.evicted += 1
        return True

    def leave(self, source: str, task: asyncio.Task[None]) -> None:
        held = self.by_source.get(source)
        if held is None or task not in held:
            return
        held.remove(task)
        self.total -= 1
        if not held:
            del self.by_source[source]


def _response(status: str, headers: list[tuple[str, str]], body: bytes, keep: bool,
              head_only: bool) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers),
             f"Content-Length: {len(body)}", f"Connection: {'keep-alive' if keep else 'close'}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else body)


class MetricsServer:
    """``/metrics`` (and the runbooks) from one event loop on its own thread.

    An open connection costs a coroutine, never a thread: only the render (``SharedRender``)
    runs on a small pool. A source may hold ``MAX_PER_SOURCE`` connections at once (all
    sources ``MAX_CONNECTIONS``); more are answered 503 and closed at once. The whole request
    head must arrive within ``HEAD_DEADLINE_SECONDS`` of the connection (or of the previous
    answer on a kept-alive one), however slowly it trickles; a head over ``MAX_HEAD_BYTES``
    is refused. GET and HEAD only (405 otherwise); a request with a body is refused (400).
    """

    def __init__(self, host: str, port: int, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect
        self._shared = SharedRender(self._render)
        self.refused = 0  # connections refused past a cap
        self.timed_out = 0  # request heads that missed their deadline
        self._connections = _Connections()
        self._pool = ThreadPoolExecutor(RENDER_WORKERS, thread_name_prefix="deadweight-render")
        self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self.port = int(self._sock.getsockname()[1])
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,),
                                        name="deadweight-metrics", daemon=True)
        self._thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._serve, sock=self._sock,
                                                      limit=MAX_HEAD_BYTES)
            started.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        task = asyncio.current_task()
        assert task is not None  # a connection's handler always runs as a task
        if not self._connections.admit(source, task):
            self.refused += 1
            writer.write(_BUSY)
            await self._close(writer)
            return
        try:
            while await self._one_request(reader, writer):
                pass
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass  # a client that hangs up or stops reading (or gave up its slot) is no error
        finally:
            self._connections.leave(source, task)
            await self._close(writer)

    async def _one_request(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        """Read one request head within its deadline and answer it; True to keep going."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                          HEAD_DEADLINE_SECONDS)
        except asyncio.TimeoutError:
            self.timed_out += 1
            return False
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return False  # closed mid-head, or a head over the cap: nothing to answer
        request_line, _, rest = head.decode("latin-1").partition("\r\n")
        parts = request_line.split(" ")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in rest.split("\r\n") if line)}
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            writer.write(_response("400 Bad Request", [("Content-Type", "text/plain")],
                                   b"bad request\n", False, False))
            return False
        method, target, version = parts
        if method not in ("GET", "HEAD"):
            writer.write(_response("405 Method Not Allowed", [
                ("Allow", "GET, HEAD"), ("Content-Type", "text/plain")],
                b"only GET and HEAD\n", False, method == "HEAD"))
            return False
        if "transfer-encoding" in headers or headers.get("content-length", "0") != "0":
            writer.write(_response("400 Bad Request", [("Content-Type", "text/plain")],
                                   b"a GET carries no body\n", False, method == "HEAD"))
            return False
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        path = target.split("?", 1)[0]
        loop = asyncio.get_running_loop()
        status, fields, body = await loop.run_in_executor(self._pool, self._answer, path)
        writer.write(_response(status, fields, body, keep, method == "HEAD"))
        await asyncio.wait_for(writer.drain(), HEAD_DEADLINE_SECONDS)
        return keep

    @staticmethod
    async def _close(writer: asyncio.StreamWriter) -> None:
        try:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError):
            pass

    def _answer(self, path: str) -> tuple[str, list[tuple[str, str]], bytes]:
        """(status, headers, body) for a path; on the render pool (renders block)."""
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            answer[:] = [status, [(k, v) for k, v in headers if k != "Content-Length"]]

        if path == "/runbooks" or path.startswith("/runbooks/"):
            body = b"".join(_runbook(path, start_response))
            return answer[0], answer[1], body
        if path not in ("/metrics", "/"):
            return "404 Not Found", [("Content-Type", "text/plain")], b"not found; try /metrics\n"
        return "200 OK", [("Content-Type", CONTENT_TYPE)], self._shared.page()

    def _render(self) -> bytes:
        return render(self._collect()) + render(self._own_metrics())

    def _own_metrics(self) -> list[Metric]:
        refused = CounterMetricFamily(
            "deadweight_metrics_http_refused",
            f"/metrics connections refused because their source held {MAX_PER_SOURCE} open "
            f"(or all sources {MAX_CONNECTIONS}).")
        refused.add_metric([], float(self.refused))
        slow = CounterMetricFamily(
            "deadweight_metrics_http_timeouts",
            f"/metrics connections closed because the request head did not arrive within "
            f"{HEAD_DEADLINE_SECONDS:g} s.")
        slow.add_metric([], float(self.timed_out))
        evicted = CounterMetricFamily(
            "deadweight_metrics_http_evicted",
            f"/metrics connections closed, when all sources held {MAX_CONNECTIONS}, to let in "
            "a source holding fewer (the oldest of the source holding the most).")
        evicted.add_metric([], float(self._connections.evicted))
        return [refused, slow, evicted]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            # Open connections end here, on the loop, not when their coroutines are collected.
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
        self._sock.close()
        self._pool.shutdown(wait=False)
