"""Push deadweight's own pages to the Alertmanager API v2, off the ingest path.

The sidecar pages even when no Prometheus scrapes it. The labels are exactly the ones the
Prometheus rules in alerts/ produce ({alertname, run_id, detector, severity}) and the
annotations carry the same summary, runbook_url and dashboard_url (``alert_links``), so
Alertmanager sees one alert whichever path delivers it first. Callers only touch a dict under
a lock; one background thread does all network I/O, retries with backoff, and re-sends firing
alerts periodically because Alertmanager resolves an alert whose endsAt passes without one.
Each POST counts in the target's ``TargetHealth`` (``pager_health``); a page whose alert was
not taken after ``max_attempts`` POSTs is told ``failed`` (and ``delivered`` if a later one
takes it), so the journal says what happened instead of "queued" forever. ``mute`` posts an
Alertmanager silence before the alerts queued after it (a silence that takes a page back:
its resolution then reaches no receiver) and ``unmute`` ends it after the alerts queued
before it (the page asserted again is in first).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone

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
from .pager_health import (
    DEFAULT_ATTEMPTS,
    DELIVERED,
    FAILED,
    Outcome,
    TargetHealth,
    target_label,
)

__all__ = ["AlertmanagerPusher", "alert_name", "dashboard_url", "format_description",
           "runbook_url"]

log = structlog.get_logger("deadweight.pager")


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _coerce_ts(value: float | datetime | None) -> float:
    if value is None:
        return time.time()
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value)


@dataclass
class _Alert:
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None  # None while firing: set to now + validity at each send

    def payload(self, now: float, validity: float) -> dict[str, object]:
        ends = self.ends_at if self.ends_at is not None else now + validity
        return {
            "labels": self.labels,
            "annotations": self.annotations,
            "startsAt": _rfc3339(self.starts_at),
            "endsAt": _rfc3339(ends),
        }


def format_description(description: str, evidence: dict[str, str]) -> str:
    """Append the evidence as `key=value` pairs, in the order given, unless already quoted."""
    if not evidence or "Evidence:" in description:
        return description
    pairs = ", ".join(f"{k}={v}" for k, v in evidence.items())
    return f"{description} Evidence: {pairs}."


class AlertmanagerPusher:
    """Send firing/resolved alerts to `<url>/api/v2/alerts` from a background thread.

    `fire` and `resolve` never block on the network: they record the alert and wake the
    thread. Pending updates coalesce per (run_id, detector), so the backlog is bounded by the
    number of distinct alerts (and by `max_pending`, beyond which the oldest are dropped and
    counted). A failed POST is retried with exponential backoff; firing alerts are re-sent every
    `resend_interval` seconds with endsAt = now + `validity_factor` * resend_interval.
    """

    def __init__(
        self,
        url: str,
        runbook_url_pattern: str = DEFAULT_RUNBOOK_URL_PATTERN,
        dashboard_url_pattern: str = DEFAULT_DASHBOARD_URL_PATTERN,
        *,
        resend_interval: float = 60.0,
        validity_factor: float = 4.0,
        timeout: float = 5.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        max_pending: int = 10_000,
        max_attempts: int = DEFAULT_ATTEMPTS,
    ) -> None:
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.silences_url = url.rstrip("/") + "/api/v2/silences"
        #: Attempts, failures and the last delivery of this target (``/metrics``).
        self.health = TargetHealth("alertmanager", target_label("alertmanager", url))
        self.max_attempts = max_attempts
        self.runbook_url_pattern = check_pattern(runbook_url_pattern, RUNBOOK_PLACEHOLDERS)
        self.dashboard_url_pattern = check_pattern(dashboard_url_pattern, DASHBOARD_PLACEHOLDERS)
        self.resend_interval = resend_interval
        self.validity = validity_factor * resend_interval
        self.timeout = timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_pending = max_pending
        self._final_timeout = timeout
        self.sent_batches = 0
        self.failed_posts = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._firing: dict[tuple[str, str], _Alert] = {}
        self._pending: dict[tuple[str, str], _Alert] = {}
        #: Pages waiting to be told delivered/failed, and the POSTs each has had.
        self._outcomes: dict[tuple[str, str], Outcome] = {}
        self._tries: dict[tuple[str, str], int] = {}
        #: Mutes to send before the next alerts (``mute``), and the Alertmanager silence id
        #: of each (run_id, detector) muted, so a changed silence updates the same one.
        self._mutes: list[tuple[tuple[str, str], dict[str, object]]] = []
        self._silence_ids: dict[tuple[str, str], str] = {}
        #: Mutes to end once the alerts queued before them went out (``unmute``).
        self._unmutes: list[tuple[str, str]] = []
        self._taken_mutes: tuple[list[tuple[tuple[str, str], dict[str, object]]],
                                 list[tuple[str, str]]] = ([], [])
        self._thread = threading.Thread(target=self._run, name="deadweight-alertmanager",
                                        daemon=True)
        self._thread.start()

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
    ) -> None:
        """Record a firing alert and schedule its delivery; on_result hears whether it was
        delivered or failed (reassert: the same alert again after a restart, sent as such:
        Alertmanager merges it with the one it has)."""
        annotations = {
            "summary": summary,
            "description": format_description(description, evidence or {}),
            **self._links(run_id, detector),
        }
        alert = _Alert(self._labels(run_id, detector, severity), annotations,
                       _coerce_ts(starts_at), None)
        key = (run_id, detector)
        with self._lock:
            previous = self._firing.get(key)
            if previous is not None:
                alert.starts_at = min(alert.starts_at, previous.starts_at)
            self._firing[key] = alert
            self._enqueue(key, alert)
            if on_result is not None:
                self._outcomes[key] = on_result
                self._tries[key] = 0
        self._wake.set()

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
                annotations, starts = previous.annotations, previous.starts_at
            else:
                annotations = self._links(run_id, detector)
                starts = ends
            alert = _Alert(self._labels(run_id, detector, severity), annotations,
                           min(starts, ends), ends)
            self._enqueue(key, alert)
        self._wake.set()

    def mute(self, run_id: str, detectors: list[str], until: float, comment: str) -> None:
        """Mute the run's alerts of these detectors in Alertmanager until ``until`` (an
        Alertmanager silence, the first detector's, updated in place when muted again).

        On-call's silence takes a page back: its alert is then resolved on both paths, and
        without the mute Alertmanager would tell the pager "resolved" for a fault that still
        stands. Sent before any alert queued after it, so the resolution arrives muted."""
        matchers = [{"name": "run_id", "value": run_id, "isRegex": False, "isEqual": True},
                    {"name": "detector", "value": "|".join(detectors), "isRegex": True,
                     "isEqual": True}]
        body: dict[str, object] = {
            "matchers": matchers, "startsAt": _rfc3339(time.time()),
            "endsAt": _rfc3339(until), "createdBy": "deadweight",
            "comment": comment or f"deadweight silence {run_id} {detectors[0]}"}
        with self._lock:
            self._mutes.append(((run_id, detectors[0]), body))
        self._wake.set()

    def unmute(self, run_id: str, detector: str) -> None:
        """End the detector's mute on the run (its silence ended): sent after the alerts
        queued before it, so the page the sidecar asserts again is in Alertmanager first and
        the alert never shows resolved in between."""
        with self._lock:
            self._unmutes.append((run_id, detector))
        self._wake.set()

    def _send_unmutes(self, unmutes: list[tuple[str, str]], timeout: float) -> None:
        for key in unmutes:
            known = self._silence_ids.pop(key, None)
            if known is None:
                continue
            request = urllib.request.Request(
                self.silences_url.removesuffix("s") + f"/{known}", method="DELETE")
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    response.read()
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self.health.tried(False)  # the mute then ends at its own time
                log.warning("alertmanager_unmute_failed", target=self.health.target,
                            error=str(exc), run_id=key[0], detector=key[1])
                continue
            self.health.tried(True)

    def _send_mutes(self, mutes: list[tuple[tuple[str, str], dict[str, object]]],
                    timeout: float) -> None:
        """POST the mutes, in order (one try each: a mute that fails is logged)."""
        for key, body in mutes:
            known = self._silence_ids.get(key)
            if known:
                body = {**body, "id": known}
            request = urllib.request.Request(
                self.silences_url, data=json.dumps(body).encode(), method="POST",
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    answer = json.loads(response.read() or b"{}")
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self.health.tried(False)
                log.warning("alertmanager_mute_failed", target=self.health.target,
                            error=str(exc), run_id=key[0], detector=key[1])
                continue
            self.health.tried(True)
            if isinstance(answer, dict) and answer.get("silenceID"):
                self._silence_ids[key] = str(answer["silenceID"])

    def firing(self) -> list[tuple[str, str]]:
        """(run_id, detector) of the alerts currently firing from this pusher."""
        with self._lock:
            return sorted(self._firing)

    def pending_count(self) -> int:
        """Updates waiting for delivery (bounded by max_pending)."""
        with self._lock:
            return len(self._pending)

    def close(self, flush_timeout: float = 2.0) -> None:
        """Stop the thread after one last attempt (bounded by `flush_timeout`) to deliver."""
        self._final_timeout = min(self.timeout, flush_timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=flush_timeout + self.timeout + 1.0)

    # -- internals -------------------------------------------------------------------------

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

    def _enqueue(self, key: tuple[str, str], alert: _Alert) -> None:
        self._pending.pop(key, None)
        self._pending[key] = alert
        while len(self._pending) > self.max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            self.dropped += 1

    def _take_batch(self, include_firing: bool) -> dict[tuple[str, str], _Alert]:
        """The alerts to send now; the mutes and unmutes queued before them are taken under
        the same lock (``_taken_mutes``), so each goes out in the order it was asked for."""
        with self._lock:
            self._taken_mutes = (self._mutes, self._unmutes)
            self._mutes, self._unmutes = [], []
            batch = dict(self._pending)
            self._pending.clear()
            if include_firing:
                for key, alert in self._firing.items():
                    batch.setdefault(key, alert)
        return batch

    def _restore(self, batch: dict[tuple[str, str], _Alert]) -> None:
        with self._lock:
            for key, alert in batch.items():
                # A newer update for the same key supersedes the failed one.
                if key not in self._pending:
                    if alert.ends_at is None and key not in self._firing:
                        continue  # resolved meanwhile
                    self._pending[key] = alert
            while len(self._pending) > self.max_pending:
                del self._pending[next(iter(self._pending))]
                self.dropped += 1

    def _told(self, batch: dict[tuple[str, str], _Alert], ok: bool) -> None:
        """Tell the pages in batch what became of them: delivered, or failed once their
        POSTs reach max_attempts (told once; a later delivery still tells delivered)."""
        tell: list[tuple[Outcome, str]] = []
        with self._lock:
            for key in batch:
                outcome = self._outcomes.get(key)
                if outcome is None:
                    continue
                if ok:
                    del self._outcomes[key]
                    self._tries.pop(key, None)
                    tell.append((outcome, DELIVERED))
                    continue
                self._tries[key] = tries = self._tries.get(key, 0) + 1
                if tries == self.max_attempts:
                    tell.append((outcome, FAILED))
        for outcome, result in tell:
            try:
                outcome(result)
            except Exception:  # the journal's own failure must not stop delivery
                log.exception("page_outcome_failed", target=self.health.target)

    def _post(self, batch: dict[tuple[str, str], _Alert], timeout: float) -> bool:
        now = time.time()
        body = []
        for alert in batch.values():
            item = alert.payload(now, self.validity)
            # Where the alert came from: the run's dashboard (Prometheus links its graph),
            # when one is configured.
            generator = dashboard_url(self.dashboard_url_pattern, alert.labels["run_id"])
            if generator:
                item["generatorURL"] = generator
            body.append(item)
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.failed_posts += 1
            self.health.tried(False)
            log.warning("alertmanager_push_failed", target=self.health.target,
                        error=str(exc), alerts=len(batch), failures=self.health.failures)
            self._told(batch, ok=False)
            return False
        self.sent_batches += 1
        self.health.tried(True)
        self._told(batch, ok=True)
        return True

    def _run(self) -> None:
        next_resend = time.monotonic() + self.resend_interval
        backoff = 0.0
        while True:
            self._wake.wait(max(0.0, next_resend - time.monotonic()))
            self._wake.clear()
            stopping = self._stop.is_set()
            resend_due = time.monotonic() >= next_resend
            batch = self._take_batch(include_firing=resend_due)
            mutes, unmutes = self._taken_mutes
            # Before the alerts queued after them: a resolution they mute arrives muted.
            self._send_mutes(mutes, self._final_timeout if stopping else self.timeout)
            if resend_due:
                next_resend = time.monotonic() + self.resend_interval
            if batch:
                timeout = self._final_timeout if stopping else self.timeout
                if self._post(batch, timeout):
                    backoff = 0.0
                else:
                    self._restore(batch)
                    backoff = min(self.backoff_max, max(self.backoff_initial, backoff * 2))
                    if not stopping:
                        # Sleep out the backoff unless asked to stop.
                        self._stop.wait(backoff)
                        self._wake.set()
            # After the alerts queued before them (taken with the batch, not after it).
            self._send_unmutes(unmutes, self._final_timeout if stopping else self.timeout)
            if stopping:
                return
