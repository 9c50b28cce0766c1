"""One POST to a pager destination: bounded as a whole, never redirected.

A per-read timeout bounds nothing against a receiver that answers one byte inside each
timeout, so every attempt runs under a total deadline: a timer shuts the socket down when it
passes, whatever the request was doing (connecting, sending, reading). A 3xx is a failure,
never followed: a redirect would turn the page into a body-less GET to another host and be
counted as delivered. Credentials in the URL (``user:password@``) are sent as Basic auth,
and no error text ever carries the URL (a chat webhook's path is its secret).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import socket
import threading
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

#: The most of a receiver's answer that is read (the status line decides; the body is noise).
MAX_ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True)
class PostResult:
    """What one attempt came to: ok only for a 2xx answer read in full before the deadline."""

    ok: bool
    status: int = 0  # the HTTP status (0: none came)
    error: str = ""


def post(url: str, body: bytes, headers: dict[str, str], deadline: float) -> PostResult:
    """POST body to url, all of it within deadline seconds; a 3xx is refused."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as err:  # a port that is no number: this URL can never be delivered to
        return PostResult(False, 0, f"bad port in the URL: {err}")
    connection_type = (http.client.HTTPSConnection if parts.scheme == "https"
                       else http.client.HTTPConnection)
    connection = connection_type(parts.hostname or "", port, timeout=deadline)
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # closed already
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(deadline, cut)
    timer.daemon = True
    sent = dict(headers)
    sent.setdefault("Content-Type", "application/json")
    if parts.username is not None:
        secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        sent["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    timer.start()
    try:
        connection.request("POST", path, body=body, headers=sent)
        response = connection.getresponse()
        response.read(MAX_ANSWER_BYTES)
        status = response.status
    except (OSError, http.client.HTTPException, ValueError) as err:
        if expired.is_set():
            return PostResult(False, 0, f"no answer within the {deadline:g} s deadline")
        return PostResult(False, 0, _describe(err))
    finally:
        timer.cancel()
        connection.close()
    if expired.is_set():
        return PostResult(False, status, f"no full answer within the {deadline:g} s deadline")
    if 300 <= status < 400:
        return PostResult(False, status, f"redirect refused (HTTP {status}): a page is only "
                          "delivered by a 2xx from the configured URL")
    if not 200 <= status < 300:
        return PostResult(False, status, f"HTTP {status}")
    return PostResult(True, status)


def _describe(err: BaseException) -> str:
    """The error without the URL (a refused connection, a reset, a bad status line)."""
    text = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}"
