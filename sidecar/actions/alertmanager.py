"""Push deadweight's own pages to the Alertmanager API v2, off the ingest path.

The sidecar pages even when no Prometheus scrapes it. The labels are exactly the ones the
Prometheus rules in alerts/ produce ({alertname, run_id, detector, severity}) and the
annotations carry the same summary, runbook_url and dashboard_url (``alert_links``), so
Alertmanager sees one alert whichever path delivers it first. Callers only record the alert;
the pager outbox (``outbox``) journals it, delivers it from this destination's own thread
under a total deadline, retries until Alertmanager acknowledges it, re-sends what a killed
sidecar left unacknowledged, and re-asserts firing alerts every ``resend_interval`` (also
right after a restart, from the open incidents) because Alertmanager resolves an alert
whose endsAt passes without one. ``mute`` posts an Alertmanager silence at once (before the
resolution a silence then queues: on-call's silence takes a page back, and a muted resolution
reaches no receiver, so a silence never reads "resolved"); ``unmute`` ends it once the alerts
queued before it were acknowledged (the page asserted again is in first).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import structlog

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
    RESOLVE,
    Delivery,
    DestinationWorker,
    Journal,
    Timing,
    destination_key,
    idempotency_key,
)
from .pager_health import DEFAULT_ATTEMPTS, Outcome, TargetHealth, page_of, target_label

__all__ = ["AlertmanagerPusher", "alert_name", "dashboard_url", "format_description",
           "runbook_url"]

log = structlog.get_logger("deadweight.pager")

#: Longest wait for Alertmanager to take a mute (on-call's silence command waits for it).
MUTE_DEADLINE = 3.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is a failure, never followed (as for the pages themselves)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _coerce_ts(value: float | datetime | None) -> float:
    if value is None:
        return time.time()
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value)


def format_description(description: str, evidence: dict[str, str]) -> str:
    """Append the evidence as `key=value` pairs, in the order given, unless already quoted."""
    if not evidence or "Evidence:" in description:
        return description
    pairs = ", ".join(f"{k}={v}" for k, v in evidence.items())
    return f"{description} Evidence: {pairs}."


class AlertmanagerPusher:
    """Send firing/resolved alerts to `<url>/api/v2/alerts` through the pager outbox.

    `fire` and `resolve` never block on the network: they record the alert and hand it to
    the destination's worker. Queued updates coalesce per (run_id, detector), so the backlog
    is bounded by the number of distinct alerts (and by `max_pending`, beyond which the
    oldest are dropped and counted). Firing alerts are re-sent every `resend_interval`
    seconds with endsAt = now + `validity_factor` * resend_interval.
    """

    coalesce = True
    batch = 256
    failure_event = "alertmanager_push_failed"

    def __init__(
        self,
        url: str,
        runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN,
        dashboard_url_pattern: str = DEFAULT_DASHBOARD_URL_PATTERN,
        *,
        resend_interval: float = 60.0,
        validity_factor: float = 4.0,
        deadline: float = 10.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        max_pending: int = 10_000,
        max_attempts: int = DEFAULT_ATTEMPTS,
        journal: Journal | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/api/v2/alerts"
        #: Attempts, failures, the last delivery and the backlog of this target (/metrics).
        self.health = TargetHealth("alertmanager", target_label("alertmanager", url))
        self.max_attempts = max_attempts
        self.runbook_url_pattern = check_pattern(runbook_url_pattern, RUNBOOK_PLACEHOLDERS)
        self.dashboard_url_pattern = check_pattern(dashboard_url_pattern, DASHBOARD_PLACEHOLDERS)
        self.resend_interval = resend_interval
        self.validity = validity_factor * resend_interval
        self._lock = threading.Lock()
        #: (run_id, detector) -> the alert as firing (endsAt set at each send).
        self._firing: dict[tuple[str, str], dict[str, Any]] = {}
        self.silences_url = url.rstrip("/") + "/api/v2/silences"
        #: (run_id, cause) -> (the Alertmanager silence id of its mute, the detectors muted).
        self._mutes: dict[tuple[str, str], tuple[str, list[str]]] = {}
        self.destination = destination_key("alertmanager", url)
        self.worker = DestinationWorker(
            self.url, self.destination, self.health, self,
            Timing(deadline=deadline, backoff_initial=backoff_initial, backoff_max=backoff_max,
                   max_attempts=max_attempts, reassert_interval=resend_interval,
                   max_pending=max_pending),
            journal, name="alertmanager")

    # -- caller side (never blocks on I/O) ------------------------------------------------

    def fire(
        self,
        run_id: str,
        detector: str,
        severity: str,
        summary: str,
        description: str,
        evidence: dict[str, str] | None = None,
        starts_at: float | datetime | None = None,
        on_result: Outcome | None = None,
        reassert: bool = False,
        page: int | None = None,
    ) -> None:
        """Record a firing alert and schedule its delivery; on_result hears whether it was
        delivered or failed (reassert: the same alert again after a restart, sent as such:
        Alertmanager merges it with the one it has; not journaled, the incidents are)."""
        annotations = {
            "summary": summary,
            "description": format_description(description, evidence or {}),
            **self._links(run_id, detector),
        }
        key = (run_id, detector)
        starts = _coerce_ts(starts_at)
        page = page_of(on_result, page)
        with self._lock:
            previous = self._firing.get(key)
            if previous is not None:
                starts = min(starts, float(previous["startsAt"]))
            alert = self._alert(run_id, detector, severity, annotations, starts, None)
            self._firing[key] = alert
        self.worker.submit(Delivery(
            key, FIRE, alert, idempotency_key(self.destination, run_id, detector, FIRE, starts,
                                              page),
            time.time(), page=page, on_result=on_result, journaled=not reassert))

    def resolve(
        self,
        run_id: str,
        detector: str,
        severity: str,
        ends_at: float | datetime | None = None,
    ) -> None:
        """Mark an alert resolved; Alertmanager gets it with endsAt = ends_at (default now)."""
        key = (run_id, detector)
        ends = _coerce_ts(ends_at)
        with self._lock:
            previous = self._firing.pop(key, None)
        if previous is not None:
            annotations, starts = previous["annotations"], float(previous["startsAt"])
        else:
            annotations, starts = self._links(run_id, detector), ends
        alert = self._alert(run_id, detector, severity, annotations, min(starts, ends), ends)
        self.worker.submit(Delivery(
            key, RESOLVE, alert, idempotency_key(self.destination, run_id, detector, RESOLVE,
                                                 ends, None), time.time()))

    def firing(self) -> list[tuple[str, str]]:
        """(run_id, detector) of the alerts currently firing from this pusher."""
        with self._lock:
            return sorted(self._firing)

    def pending_count(self) -> int:
        """Updates waiting for delivery (bounded by max_pending)."""
        return self.worker.pending_count()

    @property
    def sent_batches(self) -> int:
        """POSTs Alertmanager acknowledged."""
        attempts, failures, _ = self.health.read()
        return attempts - failures

    @property
    def failed_posts(self) -> int:
        return self.health.read()[1]

    @property
    def dropped(self) -> int:
        return self.worker.dropped

    def mute(self, run_id: str, detectors: list[str], until: float, comment: str) -> None:
        """Mute the run's alerts of these detectors (the first is the silenced cause) until
        ``until`` with an Alertmanager silence, updated in place when muted again. Posted now,
        within ``MUTE_DEADLINE`` (on-call's command waits), so it is in before the
        resolution the silence queues next; a failure is logged and counted."""
        key = (run_id, detectors[0])
        matchers = [{"name": "run_id", "value": run_id, "isRegex": False, "isEqual": True},
                    {"name": "detector", "value": "|".join(detectors), "isRegex": True,
                     "isEqual": True}]
        body: dict[str, object] = {
            "matchers": matchers, "startsAt": _rfc3339(time.time()),
            "endsAt": _rfc3339(until), "createdBy": "deadweight",
            "comment": comment or f"deadweight silence {run_id} {detectors[0]}"}
        with self._lock:
            known = self._mutes.get(key)
        if known is not None:
            body["id"] = known[0]
        request = urllib.request.Request(self.silences_url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"},
                                         method="POST")
        try:
            with _OPENER.open(request, timeout=MUTE_DEADLINE) as response:
                silence_id = str(json.loads(response.read() or b"{}").get("silenceID", ""))
        except (urllib.error.URLError, OSError, ValueError) as err:
            self.health.tried(False)
            log.warning("alertmanager_mute_failed", target=self.health.target, run_id=run_id,
                        detector=detectors[0], error=str(err))
            return
        self.health.tried(True)
        if silence_id:
            with self._lock:
                self._mutes[key] = (silence_id, list(detectors))

    def unmute(self, run_id: str, detector: str) -> None:
        """End the cause's mute (its silence ended) once no alert it muted is still queued:
        the page the sidecar asserts again is in Alertmanager first, so the alert never
        shows resolved in between. Off the caller's thread."""
        with self._lock:
            known = self._mutes.pop((run_id, detector), None)
        if known is None:
            return
        silence_id, muted = known
        keys = {(run_id, name) for name in muted}

        def end() -> None:
            give_up = time.monotonic() + 2 * self.worker.timing.deadline + MUTE_DEADLINE
            while keys & self.worker.pending_alerts() and time.monotonic() < give_up:
                time.sleep(0.05)
            request = urllib.request.Request(
                self.silences_url.removesuffix("s") + f"/{silence_id}", method="DELETE")
            try:
                with _OPENER.open(request, timeout=MUTE_DEADLINE) as response:
                    response.read()
                self.health.tried(True)
            except (urllib.error.URLError, OSError, ValueError) as err:
                self.health.tried(False)  # the mute then ends at its own time
                log.warning("alertmanager_unmute_failed", target=self.health.target,
                            run_id=run_id, detector=detector, error=str(err))

        threading.Thread(target=end, name="deadweight-unmute", daemon=True).start()

    def close(self, flush_timeout: float = 2.0) -> None:
        """Stop the thread after one last attempt (bounded by `flush_timeout`) to deliver;
        what was not acknowledged stays journaled for the next start."""
        self.worker.close(flush_timeout)

    # -- the outbox's encoding -------------------------------------------------------------

    def body(self, deliveries: Sequence[Delivery], now: float) -> object:
        """The API v2 body: one alert per (run_id, detector), endsAt fresh while firing."""
        alerts: dict[tuple[str, str], dict[str, Any]] = {}
        for delivery in deliveries:
            alert = delivery.payload
            ends = alert.get("endsAt")
            item = {"labels": alert["labels"], "annotations": alert["annotations"],
                    "startsAt": _rfc3339(float(alert["startsAt"])),
                    "endsAt": _rfc3339(float(ends) if ends is not None
                                       else now + self.validity)}
            if alert.get("generatorURL"):
                item["generatorURL"] = alert["generatorURL"]
            alerts[delivery.alert] = item
        return list(alerts.values())

    def refresh(self, now: float) -> list[Delivery]:
        """The firing alerts, re-asserted (not journaled: the open incidents are)."""
        with self._lock:
            firing = list(self._firing.items())
        return [Delivery(key, FIRE, alert, idempotency_key(
            self.destination, key[0], key[1], FIRE, float(alert["startsAt"]), None), now,
            journaled=False) for key, alert in firing]

    # -- internals -------------------------------------------------------------------------

    def _alert(self, run_id: str, detector: str, severity: str, annotations: dict[str, str],
               starts: float, ends: float | None) -> dict[str, Any]:
        alert: dict[str, Any] = {"labels": self._labels(run_id, detector, severity),
                                 "annotations": annotations, "startsAt": starts,
                                 "endsAt": ends}
        # Where the alert came from: the run's dashboard (Prometheus links its graph), when
        # one is configured.
        generator = dashboard_url(self.dashboard_url_pattern, run_id)
        if generator:
            alert["generatorURL"] = generator
        return alert

    def _links(self, run_id: str, detector: str) -> dict[str, str]:
        """The annotations the rules carry too: the runbook and, when a dashboard pattern is
        configured, the run's dashboard (no link rather than a dead one)."""
        links = {"runbook_url": runbook_url(self.runbook_url_pattern, detector)}
        dashboard = dashboard_url(self.dashboard_url_pattern, run_id)
        if dashboard:
            links["dashboard_url"] = dashboard
        return links

    @staticmethod
    def _labels(run_id: str, detector: str, severity: str) -> dict[str, str]:
        return {"alertname": alert_name(detector), "run_id": run_id,
                "detector": detector, "severity": severity}
