"""Pages straight to a chat or incident webhook, for teams without Alertmanager.

``deadweight serve --webhook-url URL`` (repeatable) posts one JSON message per incident: the
same page the Alertmanager push carries (the actions page once per incident, so the dedup is
theirs), with a ``text`` field a Slack-compatible incoming webhook shows as it is (the run,
the detector, the cause, the fix and the runbook link) and the same facts as fields for
anything else. Re-assertions after a restart and resolutions post nothing: a message per
incident. One background thread per target posts in order and retries with exponential
backoff; after ``max_attempts`` the page is told ``failed`` (and ``delivered`` if a later try
gets through). The backlog is bounded (``max_pending``; the oldest is dropped and counted).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import structlog

from ..detectors import fix_sentence
from .alertmanager import format_description
from .links import (
    DASHBOARD_PLACEHOLDERS,
    DEFAULT_DASHBOARD_URL_PATTERN,
    DEFAULT_RUNBOOK_URL_PATTERN,
    RUNBOOK_PLACEHOLDERS,
    alert_name,
    check_pattern,
    dashboard_url,
    runbook_url,
)
from .pager_health import (
    DEFAULT_ATTEMPTS,
    DELIVERED,
    FAILED,
    Outcome,
    TargetHealth,
    target_label,
)

log = structlog.get_logger("deadweight.pager")

class BadWebhookUrl(ValueError):
    """Not an http(s) URL with a host."""


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadWebhookUrl(f"expected an http:// or https:// URL with a host, got {url!r}")
    return url


def first_fix(detector: str, evidence: Mapping[str, str] | None = None) -> str:
    """The detector's fix in one sentence (its spec's, as the evidence selects it, as
    everywhere a verdict is told)."""
    return fix_sentence(detector, evidence)


@dataclass(eq=False)  # one page each: found in the queue by identity
class _Message:
    body: dict[str, Any]
    on_result: Outcome | None
    tries: int = 0


class WebhookNotifier:
    """Posts one JSON message per page to one URL, from its own thread."""

    def __init__(
        self, url: str, index: int = 0,
        runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN,
        dashboard_url_pattern: str = DEFAULT_DASHBOARD_URL_PATTERN, *,
        timeout: float = 5.0, backoff_initial: float = 0.5, backoff_max: float = 30.0,
        max_attempts: int = DEFAULT_ATTEMPTS, max_pending: int = 1000,
    ) -> None:
        self.url = check_url(url)
        self.runbook_url_pattern = check_pattern(runbook_url_pattern, RUNBOOK_PLACEHOLDERS)
        self.dashboard_url_pattern = check_pattern(dashboard_url_pattern, DASHBOARD_PLACEHOLDERS)
        #: The label names host:port only: a chat webhook's path is its secret.
        self.health = TargetHealth("webhook", target_label("webhook", url, index))
        self.timeout = timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_attempts = max_attempts
        self.max_pending = max_pending
        self.dropped = 0
        self._queue: deque[_Message] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._final_timeout = timeout
        self._thread = threading.Thread(target=self._run, name=f"deadweight-webhook-{index}",
                                        daemon=True)
        self._thread.start()

    # -- caller side (never blocks on I/O) ------------------------------------------------

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str] | None = None, starts_at: float | datetime | None = None,
        on_result: Outcome | None = None, reassert: bool = False,
    ) -> None:
        """Queue the incident's one message (a re-assertion after a restart posts none)."""
        if reassert:
            return
        body = self.message(run_id, detector, severity, summary, description, evidence or {},
                            starts_at)
        with self._lock:
            self._queue.append(_Message(body, on_result))
            while len(self._queue) > self.max_pending:
                self._queue.popleft()
                self.dropped += 1
        self._wake.set()

    def resolve(self, run_id: str, detector: str, severity: str,
                ends_at: float | datetime | None = None) -> None:
        """Nothing to post: one message per incident."""

    def pending_count(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self, flush_timeout: float = 2.0) -> None:
        """Stop the thread after one last attempt (bounded by flush_timeout)."""
        self._final_timeout = min(self.timeout, flush_timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=flush_timeout + self.timeout + 1.0)

    def message(self, run_id: str, detector: str, severity: str, summary: str,
                description: str, evidence: dict[str, str],
                starts_at: float | datetime | None) -> dict[str, Any]:
        """The JSON body: ``text`` for chat webhooks, the same facts as fields."""
        runbook = runbook_url(self.runbook_url_pattern, detector)
        dashboard = dashboard_url(self.dashboard_url_pattern, run_id)
        cause = format_description(description, evidence)
        fix = first_fix(detector, evidence) or "see the runbook"
        at = starts_at.timestamp() if isinstance(starts_at, datetime) else starts_at
        lines = [
            f"[{severity.upper()}] {summary}",
            f"Run: {run_id}   Detector: {detector} ({alert_name(detector)})",
            f"Cause: {cause}",
            f"Fix: {fix}",
            f"Runbook: {runbook}",
        ]
        if dashboard:  # only a dashboard the operator configured: never a dead default
            lines.append(f"Dashboard: {dashboard}")
        body: dict[str, Any] = {
            "text": "\n".join(lines), "status": "firing", "alertname": alert_name(detector),
            "run_id": run_id, "detector": detector, "severity": severity,
            "summary": summary, "cause": cause, "fix": fix, "runbook_url": runbook,
            "evidence": dict(evidence), "starts_at": at if at is not None else time.time()}
        if dashboard:
            body["dashboard_url"] = dashboard
        return body

    # -- the thread ------------------------------------------------------------------------

    def _post(self, body: dict[str, Any], timeout: float) -> bool:
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.health.tried(False)
            log.warning("webhook_post_failed", target=self.health.target, error=str(exc),
                        run_id=body["run_id"], detector=body["detector"],
                        failures=self.health.failures)
            return False
        self.health.tried(True)
        return True

    @staticmethod
    def _tell(message: _Message, result: str) -> None:
        if message.on_result is None:
            return
        try:
            message.on_result(result)
        except Exception:  # the journal's failure must not stop delivery
            log.exception("page_outcome_failed")

    def _run(self) -> None:
        """Post the oldest message; a failed one goes to the back, so a message that cannot
        get through holds up no other. The backoff grows per round (every queued message
        tried once), so each page gets its attempts at the same pace."""
        backoff = 0.0
        tried_in_round = 0
        while True:
            stopping = self._stop.is_set()
            with self._lock:
                message = self._queue[0] if self._queue else None
                queued = len(self._queue)
            if message is None:
                if stopping:
                    return
                self._wake.wait()
                self._wake.clear()
                continue
            if self._post(message.body, self._final_timeout if stopping else self.timeout):
                backoff, tried_in_round = 0.0, 0
                with self._lock:
                    if message in self._queue:
                        self._queue.remove(message)
                self._tell(message, DELIVERED)
                continue
            message.tries += 1
            if message.tries == self.max_attempts:
                self._tell(message, FAILED)
            with self._lock:
                if self._queue and self._queue[0] is message:
                    self._queue.rotate(-1)
            tried_in_round += 1
            if tried_in_round < queued and not stopping:
                continue
            if stopping:
                return
            tried_in_round = 0
            backoff = min(self.backoff_max, max(self.backoff_initial, backoff * 2))
            self._stop.wait(backoff)
