"""The sender's question about the training loop, on real threads: inside while the loop
function runs (whatever it waits on), gone once it returned or raised."""

from __future__ import annotations

import threading
from types import CodeType

from deadweight.callbacks.loop_exit import LEFT_CHECKS, LoopWatch, enclosing_loop, inside


def _inner_training_loop(entered: threading.Event, leave: threading.Event,
                         found: list[CodeType | None]) -> None:
    found.append(enclosing_loop())
    entered.set()
    leave.wait(30)  # blocked in C, as a loop waiting on a collective is


def test_the_loop_is_inside_while_it_runs_and_left_after_it_raised() -> None:
    entered, leave, found = threading.Event(), threading.Event(), []
    done, finish = threading.Event(), threading.Event()

    def thread_body() -> None:
        try:
            _inner_training_loop(entered, leave, found)
            raise KeyboardInterrupt  # after the loop: the thread lives on at its prompt
        except KeyboardInterrupt:
            done.set()
            finish.wait(30)

    worker = threading.Thread(target=thread_body, daemon=True)
    worker.start()
    assert entered.wait(10)
    [code] = found
    assert code is not None and code.co_name == "_inner_training_loop"
    ident = worker.ident
    assert ident is not None
    submitted = [0]
    watch = LoopWatch(code, lambda: submitted[0], thread_id=ident)
    assert inside(ident, code)
    assert not any(watch.left() for _ in range(5))  # a long wait inside is no exit
    leave.set()
    assert done.wait(10)
    assert not inside(ident, code)
    # gone at LEFT_CHECKS asks in a row, with nothing submitted between them
    answers = [watch.left() for _ in range(LEFT_CHECKS)]
    assert answers == [False] * (LEFT_CHECKS - 1) + [True]
    fresh = LoopWatch(code, lambda: submitted[0], thread_id=ident)
    fresh.left()
    submitted[0] += 1  # the training thread handed a record over: it is still working
    assert not fresh.left()
    finish.set()
    worker.join(10)


def test_outside_any_loop_there_is_nothing_to_watch() -> None:
    assert enclosing_loop() is None
    assert not inside(-1, test_outside_any_loop_there_is_nothing_to_watch.__code__)
