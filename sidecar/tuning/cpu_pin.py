"""Keep the sidecar's threads on one CPU (``deadweight serve --cpu``).

The sidecar's work is Python, run one thread at a time under the interpreter lock. When its
threads are spread over cores, the lock and the batches move between cores' caches (the event
loop, gRPC's threads, the history writer). Pinning paid while most batches went to worker
threads; since the event loop answers the batches itself, pinned and unpinned ingest overlap
(``python -m bench --only sidecar`` measures both side by side; ``bench/README.md`` keeps the
figures). One CPU is all that Python can use anyway.

``auto`` takes the CPU the sidecar runs on when it starts, where the scheduler placed it, so
the sidecars of several pods on one node spread the way the scheduler spreads them. Pinning
is opt-in: a platform that gives the sidecar an exclusive CPU (a cpuset) already has it.
"""

from __future__ import annotations

import os
from pathlib import Path

NONE = "none"
AUTO = "auto"


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (Linux), or None where that cannot be read."""
    try:
        text = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
    return int(fields[39 - 3])  # field 39: processor


def choose(spec: str, allowed: set[int]) -> int | None:
    """The CPU to pin to for ``--cpu spec`` (``none``, ``auto`` or a CPU number)."""
    if spec == NONE:
        return None
    if spec == AUTO:
        cpu = current_cpu()
        return cpu if cpu in allowed else min(allowed)
    cpu = int(spec)
    if cpu not in allowed:
        raise ValueError(f"--cpu {cpu}: this process may only run on CPUs "
                         f"{','.join(map(str, sorted(allowed)))}")
    return cpu


def pin(spec: str) -> int | None:
    """Pin the calling thread, and so every thread it starts later, to one CPU. Call it
    before the sidecar starts a thread. Returns the CPU, or None when not pinned."""
    cpu = choose(spec, os.sched_getaffinity(0))
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    return cpu


def spec(text: str) -> str:
    """argparse type of ``--cpu``."""
    if text in (NONE, AUTO) or (text.isdigit() and int(text) < 1 << 16):
        return text
    raise ValueError(f"expected none, auto or a CPU number, got {text!r}")
