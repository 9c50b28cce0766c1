"""A sidecar at a large job's scale: many ranks of one run reporting every second.

A real ``deadweight serve`` child process. Each rank of one run holds its own long-lived
stream (as each rank's callback does) and, once a second, sends what a rank of a running job
sends: a step report (with its local and step seconds, an adapter and seven module-kind
groups), a heartbeat with its phase marks, and on rank 0 the trainer's log. Two scales: the 64
ranks one node's sidecar serves (8 nodes of 8 GPUs would be 8 such sidecars; 64 on one node is
the dense case), and 1024 ranks of one run on one sidecar (the per-run rank cap). Measured over
the steady window: the sidecar's CPU (its own /proc seconds over wall seconds, in % of one
core), its resident memory at the end and its peak, and /metrics render time scraped while the
ranks report (median and slowest), with the page size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.callbacks.wire import to_event
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import monitor_stub, pb

from .common import fmt_time, table
from .sidecar_load import _cpu_seconds, _log_record, _run_start, _step_record

#: Streams per client channel (many HTTP/2 streams share a connection, as ranks do not, but
#: the sidecar sees one stream per rank either way).
STREAMS_PER_CHANNEL = 64


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _events(rank: int, step: int, seq: int) -> list[pb.Event]:
    """One second of one rank: its step report, a heartbeat with its phase, rank 0's log."""
    record = _step_record(step)
    report = to_event("step", record)
    report.step.local_seconds = 0.05
    report.step.step_seconds = 1.0
    report.seq = seq
    now = time.time()
    report.time_seconds = now
    beat = pb.Event(seq=0, time_seconds=now, heartbeat=pb.Heartbeat(
        step=step, began_step=step, phase=pb.Heartbeat.PHASE_OPTIMIZER_STEP,
        phase_step=step, phase_seconds_ago=0.001))
    events = [report, beat]
    if rank == 0:
        log = to_event("log", _log_record(step))
        log.seq = seq + 1
        log.time_seconds = now
        events.append(log)
    return events


class _Start:
    """Every rank's stream opened and its RunStart answered: then the seconds begin."""

    def __init__(self, world: int, ready: threading.Event) -> None:
        self.left = world
        self.opened = asyncio.Event()
        self.at = 0.0
        self.ready = ready

    def one_open(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.at = time.time() + 1.0
            self.opened.set()
            self.ready.set()


async def _rank(stub: object, address: str, run_id: str, rank: int, world: int,
                seconds: int, start: _Start, acked: list[int]) -> None:
    """One rank's stream: RunStart; once every rank's is answered, a second's report at the
    common start + 1, + 2, ..."""
    socket_path = address.removeprefix("unix://")
    run_start = _run_start(0)
    run_start.run_start.world_size = world
    nonce = await asyncio.to_thread(fetch_attestation, socket_path)
    run_start.run_start.attestation = nonce or ""
    call = stub.Stream()  # type: ignore[attr-defined]
    await call.write(pb.StreamRequest(run_id=run_id, rank=rank, events=[run_start]))
    answer = await call.read()
    if answer.error:
        raise RuntimeError(f"rank {rank}: {answer.error}")
    start.one_open()
    await start.opened.wait()
    seq = 0
    reader = asyncio.ensure_future(_acks(call, acked, rank))
    for second in range(1, seconds + 1):
        await asyncio.sleep(max(0.0, start.at + second - time.time()))
        events = _events(rank, second, seq + 1)
        seq += 2 if rank == 0 else 1
        await call.write(pb.StreamRequest(run_id=run_id, rank=rank, events=events))
    await call.done_writing()
    await reader


async def _acks(call: object, acked: list[int], rank: int) -> None:
    while True:
        response = await call.read()  # type: ignore[attr-defined]
        if response is grpc.aio.EOF:
            return
        acked[rank] = max(acked[rank], response.ack_seq)


async def _job(address: str, run_id: str, world: int, seconds: int,
               ready: threading.Event) -> list[int]:
    from concurrent.futures import ThreadPoolExecutor

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(64))
    channels = [grpc.aio.insecure_channel(address)
                for _ in range((world + STREAMS_PER_CHANNEL - 1) // STREAMS_PER_CHANNEL)]
    stubs = [monitor_stub(channel) for channel in channels]
    acked = [0] * world
    start = _Start(world, ready)
    try:
        await asyncio.gather(*(_rank(stubs[rank // STREAMS_PER_CHANNEL], address, run_id, rank,
                                     world, seconds, start, acked) for rank in range(world)))
    finally:
        for channel in channels:
            await channel.close()
    return acked


def measure(world: int, seconds: int, scrapes: int) -> list[str]:
    """One row: the sidecar under ``world`` ranks reporting every second for ``seconds``."""
    with tempfile.TemporaryDirectory(prefix="dw-ranks-") as tmp, \
            SidecarProcess(Path(tmp) / "sidecar") as sidecar:
        assert sidecar.process is not None
        pid = sidecar.process.pid
        url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
        run_id = f"bench-ranks-{world}"
        result: list[list[int]] = []
        ready = threading.Event()
        job = threading.Thread(target=lambda: result.append(
            asyncio.run(_job(sidecar.address, run_id, world, seconds, ready))))
        rss_before = _vm(pid, "VmRSS")
        opening = time.perf_counter()
        job.start()
        if not ready.wait(900):
            raise RuntimeError("the ranks' streams did not all open")
        opened = time.perf_counter() - opening
        time.sleep(1.0 + min(5.0, seconds / 4))  # a few seconds reported: steady state
        cpu0, wall0 = _cpu_seconds(pid), time.perf_counter()
        renders: list[float] = []
        size = 0
        gap = max(0.2, (seconds / 2) / scrapes)
        for _ in range(scrapes):
            begin = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as response:
                page = response.read()
            renders.append(time.perf_counter() - begin)
            size = len(page)
            time.sleep(gap)  # scrapes spread over the window, as Prometheus' are
        cpu, wall = _cpu_seconds(pid) - cpu0, time.perf_counter() - wall0
        job.join()
        rss, peak = _vm(pid, "VmRSS"), _vm(pid, "VmHWM")
        acked = result[0] if result else []
        complete = sum(1 for a in acked if a >= seconds)
        series = page.decode().count(f'run_id="{run_id}"')
    return [f"{world} ranks of one run, 1 report/s each", f"{cpu / wall:.1%}",
            f"{rss / 2**20:.0f} MiB (+{(rss - rss_before) / 2**20:.0f})",
            f"{peak / 2**20:.0f} MiB", fmt_time(statistics.median(renders)),
            fmt_time(max(renders)), f"{size / 1024:.0f} KiB, {series} series of the run",
            f"{complete}/{world}", f"{opened:.0f} s"]


def run(repeats: int, quick: bool) -> list[list[str]]:
    seconds = 12 if quick else 30
    rows = [measure(world, seconds, 10 if quick else 20) for world in (64, 1024)]
    table(f"a sidecar at a large job's scale: each rank streams a step report, a heartbeat "
          f"(with its phase) and rank 0 a log, every second, for {seconds} s; "
          f"{os.cpu_count()} cores",
          ["load", "sidecar CPU (of one core)", "RSS at the end", "peak RSS",
           "/metrics render (median)", "/metrics render (slowest)", "page",
           "ranks fully acknowledged", "all streams open after"], rows)
    del repeats
    return rows
