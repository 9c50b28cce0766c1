"""The pager outbox against real receivers: every page leaves exactly once, and on-call learns
when one cannot.

A real ``deadweight serve`` (``SidecarProcess``) pages a frozen run (``raw_client``: the
frozen_weights and empty_optimizer incidents) to real HTTP receivers on 127.0.0.1 that drip
their answer a byte at a time, answer 503, redirect, or are not there at all; the sidecar is
SIGKILLed or stopped with pages unacknowledged and started again. The outbox's clocks are
made short by its flags (deadline, backoff, re-assertion interval), never by sleeping.
"""

from __future__ import annotations

import base64
import json
import re
import time
from datetime import datetime
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess, free_port
from deadweight.sidecar.store.journal import Store
from tests.support.enforcement_support import journal, start_raw_client, stop_all
from tests.support.realprocs import wait_for
from tests.support.receivers import DRIP, FAIL, OK, REDIRECT, Receiver

pytestmark = pytest.mark.slow

SECRET_PATH = "/hooks/T000/B000/secret-token"
#: The outbox's clocks, short: a 1 s deadline per attempt, retries after 0.2 s up to 0.5 s.
FAST = ["--pager-deadline", "1", "--pager-backoff", "0.2", "--pager-backoff-max", "0.5"]
BOTH = {"frozen_weights": 1, "empty_optimizer": 1}


def sample(metrics: str, name: str, target: str) -> float:
    """The value of a deadweight_pager_* sample of one target (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'target="{target}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def page_results(store_dir: Path, run_id: str, detector: str = "frozen_weights") -> list[str]:
    store = Store(store_dir)
    try:
        return [result for action, result in journal(store, run_id, detector)
                if action == "page"]
    finally:
        store.close()


def log_events(log: Path, event: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()
            if line.startswith("{") and f'"{event}"' in line]


def test_a_slow_receiver_fails_at_its_deadline_and_delays_no_other_destination(
        tmp_path: Path) -> None:
    """Item 1 (and 6): Alertmanager and a webhook that drip one byte every 0.3 s (each read
    inside any per-read timeout) fail at the 1 s deadline, counted and journaled, while the
    other webhook, given in a file so its secret path is not in the process list, gets
    both incidents at once."""
    slow, good = Receiver(DRIP), Receiver(OK)
    url_file = tmp_path / "webhook.url"
    url_file.write_text(f"# the team's chat\n{good.url}{SECRET_PATH}\n")
    url_file.chmod(0o600)
    state = tmp_path / "state"
    log = tmp_path / "sidecar.log"
    run_id = "run-slow"
    args = ["--alertmanager-url", slow.url, "--webhook-url", f"{slow.url}/hook",
            "--webhook-url-file", str(url_file), "--state-dir", str(state), *FAST]
    slow_am, slow_hook = f"alertmanager 127.0.0.1:{slow.port}", f"webhook 127.0.0.1:{slow.port}"
    good_target = f"webhook#2 127.0.0.1:{good.port}"
    try:
        with SidecarProcess(tmp_path / "sc", extra_args=args, log_path=log) as sidecar:
            assert sidecar.process is not None
            cmdline = Path(f"/proc/{sidecar.process.pid}/cmdline").read_bytes()
            assert b"secret-token" not in cmdline and str(url_file).encode() in cmdline
            client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log",
                                      attest=True)
            try:
                wait_for(lambda: good.messages(run_id, SECRET_PATH) == BOTH, 30,
                         what="both messages at the good webhook while the others drip")

                def failing() -> bool:
                    metrics = sidecar.metrics()
                    return all(sample(metrics, "deadweight_pager_failures_total", t) >= 2
                               for t in (slow_am, slow_hook))

                wait_for(failing, 30, what="the dripping targets' failures on /metrics")
                wait_for(lambda: "failed" in page_results(state, run_id), 30,
                         what="the page journaled failed")
                # The good webhook holds a message before the sidecar has read its answer
                # and taken the delivery off its queue.
                wait_for(lambda: sample(sidecar.metrics(), "deadweight_pager_queued",
                                        good_target) == 0, 30,
                         what="the good webhook's deliveries acknowledged")
                metrics = sidecar.metrics()
            finally:
                stop_all(client)
    finally:
        slow.close()
        good.close()
    for target in (slow_am, slow_hook):
        assert sample(metrics, "deadweight_pager_last_success_timestamp_seconds", target) == 0
        assert sample(metrics, "deadweight_pager_queued", target) >= 1
        assert sample(metrics,
                      "deadweight_pager_oldest_unacknowledged_age_seconds", target) > 1
    assert sample(metrics, "deadweight_pager_failures_total", good_target) == 0
    assert sample(metrics, "deadweight_pager_queued", good_target) == 0
    assert "secret-token" not in metrics
    failures = log_events(log, "webhook_post_failed") + log_events(log, "alertmanager_push_failed")
    assert failures and all("deadline" in str(f["error"]) for f in failures)
    # The slow receivers did get the requests: what failed is their answer's pace.
    assert slow.requests("POST-drip", "/api/v2/alerts") and slow.requests("POST-drip", "/hook")
    warned = log_events(log, "webhook_url_in_argv")
    assert warned and "--webhook-url-file" in str(warned[0]["note"])


def test_a_page_in_flight_when_the_sidecar_is_killed_leaves_after_the_restart(
        tmp_path: Path) -> None:
    """Item 2: the webhook is down when the verdicts page; the sidecar is SIGKILLed with both
    pages unacknowledged and started again with the webhook up: each page arrives once, with
    the same idempotency key in its header and body, and its journal row says delivered."""
    port = free_port()  # nothing listens yet
    state = tmp_path / "state"
    run_id = "run-killed"
    target = f"webhook 127.0.0.1:{port}"
    args = ["--webhook-url", f"http://127.0.0.1:{port}{SECRET_PATH}", "--state-dir",
            str(state), *FAST]
    sidecar = SidecarProcess(tmp_path / "sc", extra_args=args).start()
    client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log", attest=True)
    try:
        for detector in BOTH:
            wait_for(lambda d=detector: page_results(state, run_id, d), 30,  # type: ignore[misc]
                     what=f"the {detector} page journaled")
        wait_for(lambda: sample(sidecar.metrics(), "deadweight_pager_failures_total",
                                target) >= 1, 30, what="a failed attempt")
    finally:
        assert sidecar.process is not None
        sidecar.process.kill()  # SIGKILL: nothing is flushed
        sidecar.process.wait(10)
        stop_all(client)
    assert "delivered" not in page_results(state, run_id)
    hook = Receiver(OK, port=port)
    try:
        with SidecarProcess(tmp_path / "sc2", extra_args=args):
            wait_for(lambda: hook.messages(run_id, SECRET_PATH) == BOTH, 30,
                     what="both pages after the restart")
            # The page's own row is settled (the restart added a "reasserted" row after it).
            wait_for(lambda: page_results(state, run_id)[:1] == ["delivered"], 30,
                     what="the frozen_weights page journaled delivered")
        assert hook.messages(run_id, SECRET_PATH) == BOTH  # once each, no second copy
        for request in hook.requests("POST", SECRET_PATH):
            key = request.headers["Idempotency-Key"]
            assert re.fullmatch(r"[0-9a-f]{32}", key) and request.body["idempotency_key"] == key
    finally:
        hook.close()


def test_a_failed_page_is_retried_after_a_graceful_restart(tmp_path: Path) -> None:
    """Item 2, SIGTERM: the webhook answers 503 until the page is journaled failed; the
    sidecar is stopped and started again with the webhook healthy: the page arrives and
    its journal row goes from failed to delivered."""
    hook = Receiver(FAIL)
    state = tmp_path / "state"
    run_id = "run-stopped"
    args = ["--webhook-url", f"{hook.url}{SECRET_PATH}", "--state-dir", str(state), *FAST]
    try:
        with SidecarProcess(tmp_path / "sc", extra_args=args) as sidecar:
            client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log",
                                      attest=True)
            try:
                wait_for(lambda: page_results(state, run_id) == ["failed"], 30,
                         what="the page journaled failed against the 503s")
            finally:
                stop_all(client)
        # stopped (SIGTERM): the failed page was not acknowledged
        assert hook.messages(run_id, SECRET_PATH) == {}
        hook.mode = OK
        with SidecarProcess(tmp_path / "sc2", extra_args=args):
            wait_for(lambda: hook.messages(run_id, SECRET_PATH) == BOTH, 30,
                     what="both pages after the graceful restart")
            wait_for(lambda: page_results(state, run_id)[:1] == ["delivered"], 30,
                     what="the page journaled delivered")
    finally:
        hook.close()


def _ends(alert: dict[str, object]) -> float:
    return datetime.fromisoformat(str(alert["endsAt"]).replace("Z", "+00:00")).timestamp()


def test_open_alerts_are_reasserted_with_a_fresh_end_after_a_crash(tmp_path: Path) -> None:
    """Item 3: a firing alert pushed to Alertmanager, the sidecar SIGKILLed: the restarted
    sidecar re-posts it at once and keeps doing so, each time with an endsAt ahead of the
    clock, so Alertmanager never lets it expire into "resolved"."""
    am = Receiver(OK)
    state = tmp_path / "state"
    run_id = "run-reasserted"
    args = ["--alertmanager-url", am.url, "--state-dir", str(state),
            "--pager-resend-interval", "1", *FAST]
    try:
        sidecar = SidecarProcess(tmp_path / "sc", extra_args=args).start()
        client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log", attest=True)
        try:
            wait_for(lambda: am.alerts(run_id, "frozen_weights"), 30, what="the first push")
        finally:
            assert sidecar.process is not None
            sidecar.process.kill()
            sidecar.process.wait(10)
            stop_all(client)
        killed_at = time.time()

        def reasserted() -> list[tuple[float, dict[str, object]]] | None:
            since = [(at, a) for at, a in am.alerts(run_id, "frozen_weights") if at > killed_at]
            return since[:3] if len(since) >= 3 else None

        with SidecarProcess(tmp_path / "sc2", extra_args=args):
            after = wait_for(reasserted, 30, what="three re-assertions after the restart")
    finally:
        am.close()
    for at, alert in after:
        assert _ends(alert) > at + 1  # still active when the next one is due
        assert alert["labels"]["alertname"] == "DeadweightFrozenWeights"
    assert _ends(after[-1][1]) > _ends(after[0][1])  # each later than the one before


def test_a_redirect_is_a_failure_never_followed(tmp_path: Path) -> None:
    """Item 4: the webhook answers 302 to another host: nothing reaches that host (no
    body-less GET), the attempts count as failures and the page is journaled failed, never
    delivered."""
    elsewhere = Receiver(OK)
    hook = Receiver(REDIRECT, location=f"{elsewhere.url}/elsewhere")
    state = tmp_path / "state"
    log = tmp_path / "sidecar.log"
    run_id = "run-redirected"
    target = f"webhook 127.0.0.1:{hook.port}"
    args = ["--webhook-url", f"{hook.url}{SECRET_PATH}", "--state-dir", str(state), *FAST]
    try:
        with SidecarProcess(tmp_path / "sc", extra_args=args, log_path=log) as sidecar:
            client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log",
                                      attest=True)
            try:
                wait_for(lambda: page_results(state, run_id) == ["failed"], 30,
                         what="the redirected page journaled failed")
                metrics = sidecar.metrics()
            finally:
                stop_all(client)
    finally:
        hook.close()
        elsewhere.close()
    assert elsewhere.received == []
    assert sample(metrics, "deadweight_pager_failures_total", target) >= 4
    assert sample(metrics, "deadweight_pager_last_success_timestamp_seconds", target) == 0
    failures = log_events(log, "webhook_post_failed")
    assert failures and all("redirect refused" in str(f["error"]) for f in failures)
    assert all(f["status"] == 302 for f in failures)
    assert "delivered" not in page_results(state, run_id)


def test_the_webhook_url_file_must_hold_a_url(tmp_path: Path) -> None:
    """Item 6: a file that holds no http(s) URL stops the start, naming the problem (and a
    missing file too), rather than a sidecar that pages nobody."""
    import subprocess
    import sys

    bad = tmp_path / "bad.url"
    bad.write_text("ftp://example.invalid/hook\n")
    for given in (bad, tmp_path / "missing.url"):
        result = subprocess.run(
            [sys.executable, "-m", "deadweight.sidecar.commands.cli", "serve", "--socket",
             str(tmp_path / "s.sock"), "--metrics-address", f"127.0.0.1:{free_port()}",
             "--webhook-url-file", str(given)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "deadweight serve:" in result.stderr
        assert ("http:// or https://" in result.stderr if given == bad
                else "No such file" in result.stderr)


def test_alertmanager_credentials_come_from_a_file_out_of_the_process_list(
        tmp_path: Path) -> None:
    """Item 6 for Alertmanager: its URL's user:password@ read from --alertmanager-url-file
    reaches the receiver as Basic auth and never shows in /proc/<pid>/cmdline, /metrics or
    the log; the same URL given in argv still pages but warns."""
    am = Receiver(OK)
    with_secret = am.url.replace("http://", "http://oncall:s3cret-pass@")
    url_file = tmp_path / "alertmanager.url"
    url_file.write_text(f"# the team's Alertmanager\n{with_secret}\n")
    url_file.chmod(0o600)
    expected = "Basic " + base64.b64encode(b"oncall:s3cret-pass").decode()
    try:
        for args, run_id in ((["--alertmanager-url-file", str(url_file)], "run-file"),
                             (["--alertmanager-url", with_secret], "run-argv")):
            log = tmp_path / f"{run_id}.log"
            state = tmp_path / f"state-{run_id}"
            with SidecarProcess(tmp_path / run_id, extra_args=[*args, "--state-dir",
                                                               str(state), *FAST],
                                log_path=log) as sidecar:
                assert sidecar.process is not None
                cmdline = Path(f"/proc/{sidecar.process.pid}/cmdline").read_bytes()
                client = start_raw_client(sidecar.socket_path, run_id, tmp_path / "c.log",
                                          attest=True)
                try:
                    wait_for(lambda r=run_id: [  # type: ignore[misc]
                        q for q in am.requests("POST", "/api/v2/alerts")
                        if r in json.dumps(q.body)], 30, what=f"{run_id}'s page")
                    metrics = sidecar.metrics()
                finally:
                    stop_all(client)
            posts = [q for q in am.requests("POST", "/api/v2/alerts")
                     if run_id in json.dumps(q.body)]
            assert posts and all(q.headers.get("Authorization") == expected for q in posts)
            assert "s3cret-pass" not in metrics and "s3cret-pass" not in log.read_text()
            warned = log_events(log, "alertmanager_url_in_argv")
            if run_id == "run-file":
                assert b"s3cret-pass" not in cmdline and not warned
            else:
                assert warned and "--alertmanager-url-file" in str(warned[0]["note"])
    finally:
        am.close()


def test_alertmanager_url_file_and_flag_are_one_or_the_other(tmp_path: Path) -> None:
    """Both given, an empty file or a file without a URL stop the start with the reason."""
    import subprocess
    import sys

    empty = tmp_path / "empty.url"
    empty.write_text("# nothing yet\n")
    for args, words in ((["--alertmanager-url", "http://127.0.0.1:9093",
                          "--alertmanager-url-file", str(empty)], "not both"),
                        (["--alertmanager-url-file", str(empty)], "holds no Alertmanager URL")):
        result = subprocess.run(
            [sys.executable, "-m", "deadweight.sidecar.commands.cli", "serve", "--socket",
             str(tmp_path / "s.sock"), "--metrics-address", f"127.0.0.1:{free_port()}",
             *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "deadweight serve:" in result.stderr and words in result.stderr
