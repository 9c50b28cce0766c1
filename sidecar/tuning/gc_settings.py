"""The sidecar's garbage-collector settings: few collections over many long-lived objects.

The sidecar holds up to 256 steps per rank of every live run (hundreds of thousands of small
objects that live for minutes) and allocates a few objects per step report it receives. With
CPython's default thresholds (a young collection every 700 allocations) the collector ran
several times per batch of step reports and took a noticeable share of the process's CPU
under the ingest bench (``bench/README.md``). Collecting less often changes no result:
garbage in reference cycles is still freed, a little later (the sidecar's state is freed by
reference counting).
"""

from __future__ import annotations

import gc

#: Allocations (net) between young collections, and the generation ratios above it.
YOUNG_THRESHOLD = 20_000
OLDER_RATIO = 20


def tune_garbage_collector() -> tuple[int, int, int]:
    """Collect less often, and move what exists at start (modules, the servers' objects) out
    of every later collection. Returns the thresholds now in force."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_RATIO, OLDER_RATIO)
    return gc.get_threshold()
