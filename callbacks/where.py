"""Where a rank's training thread is right now, read by the sender thread for its heartbeats.

A rank stuck in its own code (a data loader hung on its shard, a branch only it takes) and the
ranks waiting for it in a collective can show the same step begun: the trainer gathers the
batch's token count, or the loss for logging, before a step begins. Their training threads'
stacks tell them apart. The sender thread reads the training thread's current frame (no work on
the training thread) at each heartbeat, a few microseconds every few seconds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import FrameType

#: The answer for a thread inside torch.distributed or a backward pass (waiting for peers).
COLLECTIVE = "collective"
#: Frames looked at from the innermost outwards.
MAX_FRAMES = 64
#: Longest answer.
MAX_LENGTH = 200

_WAITING = (f"{os.sep}torch{os.sep}distributed{os.sep}",
            f"{os.sep}torch{os.sep}autograd{os.sep}")


def stack(thread_id: int, limit: int) -> Iterator[FrameType]:
    """The thread's current frames, innermost first, at most limit of them (none when the
    thread is gone)."""
    frame: FrameType | None = sys._current_frames().get(thread_id)
    for _ in range(limit):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def where(thread_id: int) -> str:
    """"collective" when the thread waits inside torch.distributed or a backward pass, else its
    innermost frame as "file:line function"; "" when the thread is gone."""
    innermost = None
    for frame in stack(thread_id, MAX_FRAMES):
        innermost = innermost or frame
        if any(part in frame.f_code.co_filename for part in _WAITING):
            return COLLECTIVE
    if innermost is None:
        return ""
    code = innermost.f_code
    text = f"{os.path.basename(code.co_filename)}:{innermost.f_lineno} {code.co_name}"
    return text[:MAX_LENGTH]
