"""Pages straight to a chat or incident webhook, for teams without Alertmanager.

``deadweight serve --webhook-url URL`` (repeatable; ``--webhook-url-file FILE`` keeps the URL
out of the process list) posts one JSON message per incident: the same page the Alertmanager
push carries (the actions page once per incident, so the dedup is theirs), with a ``text``
field a Slack-compatible incoming webhook shows as it is (the run, the detector, the cause,
the fix and the runbook link), the same facts as fields for anything else, and an
``idempotency_key`` (also the ``Idempotency-Key`` header) that stays the same for every
attempt of the message, also after a restart. Re-assertions after a restart and resolutions
post nothing new: a message per incident. Delivery is the pager outbox's (``outbox``): one
worker per target, a total deadline per attempt, redirects refused, retries until the
webhook acknowledges, and what was not acknowledged goes again after a restart.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
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
from .outbox import (
    FIRE,
    Delivery,
    DestinationWorker,
    Journal,
    Timing,
    destination_key,
    idempotency_key,
)
from .pager_health import DEFAULT_ATTEMPTS, Outcome, TargetHealth, page_of, target_label

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


class WebhookNotifier:
    """Posts one JSON message per page to one URL, through the pager outbox."""

    coalesce = False  # a message per incident: none replaces another
    batch = 1
    failure_event = "webhook_post_failed"

    def __init__(
        self, url: str, index: int = 0,
        runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN,
        dashboard_url_pattern: str = DEFAULT_DASHBOARD_URL_PATTERN, *,
        deadline: float = 10.0, backoff_initial: float = 0.5, backoff_max: float = 30.0,
        max_attempts: int = DEFAULT_ATTEMPTS, max_pending: int = 1000,
        journal: Journal | None = None,
    ) -> None:
        self.url = check_url(url)
        self.runbook_url_pattern = check_pattern(runbook_url_pattern, RUNBOOK_PLACEHOLDERS)
        self.dashboard_url_pattern = check_pattern(dashboard_url_pattern, DASHBOARD_PLACEHOLDERS)
        #: The label names host:port only: a chat webhook's path is its secret.
        self.health = TargetHealth("webhook", target_label("webhook", url, index))
        self.max_attempts = max_attempts
        self.destination = destination_key("webhook", url)
        self.worker = DestinationWorker(
            self.url, self.destination, self.health, self,
            Timing(deadline=deadline, backoff_initial=backoff_initial, backoff_max=backoff_max,
                   max_attempts=max_attempts, max_pending=max_pending),
            journal, name=f"webhook-{index}")

    # -- caller side (never blocks on I/O) ------------------------------------------------

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str] | None = None, starts_at: float | datetime | None = None,
        on_result: Outcome | None = None, reassert: bool = False, page: int | None = None,
    ) -> None:
        """Queue the incident's one message (a re-assertion after a restart posts none: a
        message the webhook never acknowledged goes again from the journal)."""
        if reassert:
            return
        body = self.message(run_id, detector, severity, summary, description, evidence or {},
                            starts_at)
        page = page_of(on_result, page)
        key = idempotency_key(self.destination, run_id, detector, FIRE,
                              float(body["starts_at"]), page)
        body["idempotency_key"] = key
        self.worker.submit(Delivery((run_id, detector), FIRE, body, key, time.time(),
                                    page=page, on_result=on_result))

    def resolve(self, run_id: str, detector: str, severity: str,
                ends_at: float | datetime | None = None) -> None:
        """Nothing to post: one message per incident."""

    def pending_count(self) -> int:
        return self.worker.pending_count()

    @property
    def dropped(self) -> int:
        return self.worker.dropped

    def close(self, flush_timeout: float = 2.0) -> None:
        """Stop the thread after one last attempt (bounded by flush_timeout); what was not
        acknowledged stays journaled for the next start."""
        self.worker.close(flush_timeout)

    # -- the outbox's encoding -------------------------------------------------------------

    def body(self, deliveries: Sequence[Delivery], now: float) -> object:
        """One message a POST, as it was made when the page fired."""
        return deliveries[0].payload

    def refresh(self, now: float) -> list[Delivery]:
        """Nothing is re-asserted to a webhook."""
        return []

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
