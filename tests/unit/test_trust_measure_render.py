"""Scrapes that arrive together share one render, and none gets a page older than itself.

Issue 12, item 5: 50 parallel scrapes each rendered the whole page at once (one interpreter,
so each waited for all the others). ``SharedRender`` renders once for all who waited; these
tests pin its guarantees with a render that blocks until the test lets it go.
"""

from __future__ import annotations

import threading

import pytest

from deadweight.sidecar.exposition.http import SharedRender
from tests.support.realprocs import wait_for


class GatedRender:
    """A render that numbers its pages and waits for the test's go before finishing."""

    def __init__(self) -> None:
        self.started = 0
        self.go = threading.Semaphore(0)
        self.fail = False

    def __call__(self) -> bytes:
        self.started += 1
        number = self.started
        self.go.acquire()
        if self.fail:
            raise ValueError("dictionary changed size during iteration")
        return f"page {number}".encode()


def _scrape(shared: SharedRender, into: list[bytes | str]) -> threading.Thread:
    def scrape() -> None:
        try:
            into.append(shared.page())
        except Exception as err:
            into.append(repr(err))

    thread = threading.Thread(target=scrape)
    thread.start()
    return thread


def test_scrapes_arriving_during_a_render_share_the_next_one_not_the_older_one() -> None:
    render = GatedRender()
    shared = SharedRender(render)
    first: list[bytes | str] = []
    early = _scrape(shared, first)
    wait_for(lambda: render.started == 1, what="the first render to begin")
    later: list[bytes | str] = []
    waiting = [_scrape(shared, later) for _ in range(20)]  # arrive while page 1 renders
    wait_for(lambda: shared.waiting == 20, what="twenty scrapes waiting")
    render.go.release()  # page 1 done
    early.join(10)
    assert first == [b"page 1"]
    wait_for(lambda: render.started == 2, what="one render for all who waited")
    render.go.release()
    for thread in waiting:
        thread.join(10)
    assert later == [b"page 2"] * 20  # one render served all twenty, none got page 1
    assert render.started == 2


def test_a_failed_render_fails_only_the_scrapes_that_waited_for_it() -> None:
    render = GatedRender()
    shared = SharedRender(render)
    render.fail = True
    results: list[bytes | str] = []
    threads = [_scrape(shared, results)]
    wait_for(lambda: render.started == 1, what="the failing render to begin")
    render.go.release()
    threads[0].join(10)
    assert "ValueError" in str(results[0])
    render.fail = False
    render.go.release()
    assert shared.page() == b"page 2"  # the next scrape renders afresh


@pytest.mark.parametrize("scrapers", [1, 50])
def test_every_scrape_gets_a_whole_page(scrapers: int) -> None:
    counter = {"n": 0}

    def page() -> bytes:
        counter["n"] += 1
        return b"x" * 1000

    shared = SharedRender(page)
    results: list[bytes | str] = []
    threads = [_scrape(shared, results) for _ in range(scrapers)]
    for thread in threads:
        thread.join(10)
    assert results == [b"x" * 1000] * scrapers
    assert 1 <= counter["n"] <= scrapers
