"""The pager outbox's worker against real receivers on 127.0.0.1, in process: a page whose
answer drips holds up no later page to the same target, and what one worker left
unacknowledged in the journal is sent by the next with the same idempotency key and settles
its page."""

from __future__ import annotations

from pathlib import Path

from deadweight.demo.sidecar_process import free_port
from deadweight.sidecar.actions.pager_health import DELIVERED, FAILED, PageSettler
from deadweight.sidecar.actions.pagers import PagerSet
from deadweight.sidecar.actions.webhook import WebhookNotifier
from deadweight.sidecar.store.journal import Store
from tests.support.realprocs import wait_for
from tests.support.receivers import OK, Receiver

FAST = {"deadline": 0.5, "backoff_initial": 0.05, "backoff_max": 0.2, "max_attempts": 2}


def test_a_page_whose_answer_drips_holds_up_no_later_page() -> None:
    hook = Receiver(OK, drip_detector="frozen_weights")
    told: dict[str, list[str]] = {"frozen_weights": [], "empty_optimizer": []}
    notifier = WebhookNotifier(f"{hook.url}/hook", **FAST)  # type: ignore[arg-type]
    try:
        for detector in told:
            notifier.fire("run-1", detector, "critical", "s", "d",
                          on_result=told[detector].append)
        wait_for(lambda: told["empty_optimizer"] == [DELIVERED], 10,
                 what="the later page delivered past the dripping one")
        wait_for(lambda: told["frozen_weights"] == [FAILED], 10,
                 what="the dripping page told failed at its deadline")
        assert hook.messages("run-1", "/hook") == {"empty_optimizer": 1}
        assert notifier.health.failures >= 2 and notifier.pending_count() == 1
    finally:
        notifier.close(flush_timeout=0.2)
        hook.close()


def test_what_one_worker_left_unacknowledged_the_next_sends_once(tmp_path: Path) -> None:
    port = free_port()  # nothing listens: the first worker cannot deliver
    url = f"http://127.0.0.1:{port}/hook"
    store = Store(tmp_path / "state")
    page = store.add_action("run-2", "SFTTrainer", "frozen_weights", 1, "page", "queued")
    first = WebhookNotifier(url, journal=store, **FAST)  # type: ignore[arg-type]
    seen: list[str] = []
    first.fire("run-2", "frozen_weights", "critical", "s", "d",
               on_result=PageSettler(page, seen.append), starts_at=1000.0)
    wait_for(lambda: seen == [FAILED], 10, what="the page told failed")
    first.close(flush_timeout=0.1)
    [row] = store.open_deliveries(first.destination)
    assert row.page == page and row.attempts >= 2

    hook = Receiver(OK, port=port)
    settled: list[tuple[int, str]] = []
    second = WebhookNotifier(url, journal=store, **FAST)  # type: ignore[arg-type]
    try:
        assert PagerSet([second]).restore(lambda p, r: settled.append((p, r))) == 1
        wait_for(lambda: settled == [(page, DELIVERED)], 10, what="the restored page settled")
        [request] = hook.requests("POST", "/hook")
        assert request.headers["Idempotency-Key"] == row.idempotency_key
        assert request.body["idempotency_key"] == row.idempotency_key
        assert store.open_deliveries(second.destination) == []
    finally:
        second.close(flush_timeout=0.1)
        hook.close()
        store.close()


def test_credentials_in_the_url_go_as_basic_auth_and_never_into_the_label() -> None:
    import base64

    hook = Receiver(OK)
    told: list[str] = []
    notifier = WebhookNotifier(f"http://pager:s%40cret@127.0.0.1:{hook.port}/hook",
                               **FAST)  # type: ignore[arg-type]
    try:
        notifier.fire("run-3", "frozen_weights", "critical", "s", "d", on_result=told.append)
        wait_for(lambda: told == [DELIVERED], 10, what="the page delivered")
        [request] = hook.requests("POST", "/hook")
        assert request.headers["Authorization"] == "Basic " + base64.b64encode(
            b"pager:s@cret").decode()
        assert notifier.health.target == f"webhook 127.0.0.1:{hook.port}"
    finally:
        notifier.close(flush_timeout=0.1)
        hook.close()
