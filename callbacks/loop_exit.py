"""Whether the Trainer's training loop still runs on the training thread.

A loop that raises (Ctrl-C in a notebook cell, an exception a script catches and goes on from)
never calls ``on_train_end``: the process lives on, the sender keeps beating, and the sidecar
sees a live run that makes no step, a stall verdict and a page half an hour later for a run its
user stopped. So the sender asks at each heartbeat whether the loop's frame is still on the
training thread's stack (read from the sender thread: no work on the training thread), and
ends the run as ``failed`` once it has been gone at two heartbeats in a row with nothing
submitted in between. A loop still running always has its frame on the stack, wherever it is
(a forward pass, a collective, a save), so a running loop is never taken for a left one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import CodeType

from .where import stack

#: The Trainer's loop function (``Trainer._inner_training_loop``), called under
#: ``on_train_begin`` and ``on_train_end`` alike.
LOOP_FUNCTION = "_inner_training_loop"
#: Heartbeats in a row that must find the loop gone, with nothing submitted between them.
LEFT_CHECKS = 2
#: Frames walked at most; a deeper stack counts as still inside.
MAX_FRAMES = 10_000


def enclosing_loop(name: str = LOOP_FUNCTION) -> CodeType | None:
    """The code of the loop function the calling thread is inside, None outside one (a raw
    loop under ``deadweight.watch``, whose context manager ends its run itself)."""
    return next((frame.f_code for frame in stack(threading.get_ident(), MAX_FRAMES)
                 if frame.f_code.co_name == name), None)


def inside(thread_id: int, code: CodeType) -> bool:
    """Whether the thread runs code now, at any depth of its stack (False once it is gone)."""
    frames = list(stack(thread_id, MAX_FRAMES))
    # a stack deeper than looked at counts as inside
    return any(frame.f_code is code for frame in frames) or len(frames) == MAX_FRAMES


class LoopWatch:
    """Asked at each heartbeat (the sender thread): whether the loop has been left."""

    def __init__(self, code: CodeType, submitted: Callable[[], int],
                 thread_id: int | None = None) -> None:
        self.code = code
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.submitted = submitted
        self._seen = submitted()
        self._misses = 0

    def left(self) -> bool:
        """True once the loop's frame was gone at LEFT_CHECKS asks in a row, with no record
        submitted by the training thread between them."""
        submitted = self.submitted()
        if submitted != self._seen or inside(self.thread_id, self.code):
            self._seen, self._misses = submitted, 0
            return False
        self._misses += 1
        return self._misses >= LEFT_CHECKS
