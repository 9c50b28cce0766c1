"""Timing and reporting helpers shared by the benchmarks.

The machine is shared, so every figure is the minimum (and median) of repeated runs, and every
reference is measured in the same run as the figure it is compared with.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import torch

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.proto import monitor_stub, pb

#: Larger than the last-level cache: touching it evicts the data a benchmark is about to read,
#: the way a forward/backward pass does between two optimizer steps.
_FLUSH_BYTES = 128 * 2**20
_flush_buffer: torch.Tensor | None = None


def setup_torch() -> None:
    """One thread, as the budgets assume."""
    torch.set_num_threads(1)


def flush_cache() -> None:
    """Evict the caches by writing a buffer larger than them."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.zeros(_FLUSH_BYTES // 4)
    _flush_buffer.add_(1.0)


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the minimum and the median of the repeats."""

    best: float
    median: float


def measure(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None,
            flush: bool = True) -> Timing:
    """Time fn repeats times; setup (untimed) and a cache flush run before each call."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        if flush:
            flush_cache()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(min(times), statistics.median(times))


def measure_bandwidth(repeats: int, nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s with one thread; copy counts read + write bytes."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy = measure(lambda: dst.copy_(src), repeats)
    read = measure(lambda: src.sum(), repeats)
    return 2 * nbytes / copy.best, nbytes / read.best


def fmt_time(seconds: float) -> str:
    """Seconds in a readable unit."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def verdict(ok: bool) -> str:
    """A word for the budget column."""
    return "ok" if ok else "OVER"


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print an aligned table."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    print(f"\n## {title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def attested_stream(address: str, requests: Iterable[pb.StreamRequest]
                    ) -> Iterator[pb.StreamResponse]:
    """The sidecar's answers to requests, sent on one Stream to a ``unix://`` address, each
    RunStart attested with a nonce fetched as it is sent (as the callback does; without one
    the sidecar refuses the stream with PERMISSION_DENIED and its reason). The channel closes
    when the answers end or the generator is closed."""
    socket_path = address.removeprefix("unix://")

    def attested() -> Iterator[pb.StreamRequest]:
        for request in requests:
            for event in request.events:
                if event.HasField("run_start"):
                    event.run_start.attestation = fetch_attestation(socket_path) or ""
            yield request

    with grpc.insecure_channel(address) as channel:
        yield from monitor_stub(channel).Stream(attested())


def in_threads(target: Callable[[], object], count: int) -> float:
    """Run target on count threads at once; the wall seconds until the last one ends."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start
