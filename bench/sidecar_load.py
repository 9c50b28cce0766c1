"""The sidecar under load, and the training thread's hand-off to the sender.

A real ``deadweight serve`` child process on a unix socket. Ingest: 50 concurrent runs stream
batches of step reports; records/s per core counts the sidecar process's own CPU seconds (from
/proc), so the load generator's CPU is not charged to it. Then /metrics is scraped with those
50 runs live. Hand-off: the callback's real StreamClient, connected, with its sender thread
running, timed per submit() while the training thread otherwise sleeps (releases the GIL).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from deadweight.callbacks.digest import AdapterDigest
from deadweight.callbacks.facts.membership import Membership
from deadweight.callbacks.facts.preflight import PreflightFacts
from deadweight.callbacks.stream_client import ClientSettings, StreamClient
from deadweight.callbacks.update.stats import GroupStats, UpdateStats
from deadweight.callbacks.wire import LogRecord, RunStartRecord, StepRecord, to_event
from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb

from .common import attested_stream, fmt_time, table, verdict

HANDOFF_BUDGET = 2e-6
INGEST_BUDGET = 50_000  # records/s per core
METRICS_BUDGET = 10e-3
RUNS = 50


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_start(run: int) -> pb.Event:
    start = RunStartRecord(
        trainer="SFTTrainer", world_size=1, output_dir=f"/tmp/bench-run-{run}",
        config={"learning_rate": 2e-4, "warmup_steps": 0.0, "weight_decay": 0.0},
        config_text={}, versions={},
        membership=Membership(392, 10_092_544, 392, 10_092_544, 0, 392, 10_092_544, [], [], [],
                              []),
        preflight=PreflightFacts(is_peft=True, peft_type="LORA", lora_rank=16),
        initial_adapter=AdapterDigest(),
    )
    event = to_event("run_start", start)
    event.seq = 0
    event.time_seconds = time.time()
    return event


def _stats(step: int) -> UpdateStats:
    groups = [GroupStats(kind, "module", 1e-4 * step, 56, 0, 1_441_792, 3_000, "bfloat16")
              for kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj")]
    return UpdateStats(7e-4, 12.5, 392, 10_092_544, 0, 0, False,
                       [*groups, GroupStats("default", "adapter", 7e-4, 392, 0, 10_092_544,
                                            21_000, "bfloat16")], 21_000)


def _step_record(step: int) -> StepRecord:
    return StepRecord(step, 2e-4, _stats(step), 10_092_544, 0, 0)


def _log_record(step: int) -> LogRecord:
    return LogRecord(step, {"loss": 2.0 - 1e-4 * step, "grad_norm": 0.5, "learning_rate": 2e-4,
                            "epoch": step / 1000})


def _requests(run: int, batches: int, batch: int, logs: bool = False
              ) -> list[pb.StreamRequest]:
    """The run's whole stream, built before timing starts; logs: every step report is
    followed by its trainer log (``logging_steps=1``), as the callback sends them."""
    run_id = f"bench-{run}"
    out = [pb.StreamRequest(run_id=run_id, rank=0, events=[_run_start(run)])]
    seq = step = 0
    for _ in range(batches):
        events = []
        for _ in range(batch):
            seq += 1
            if logs and seq % 2 == 0:
                event = to_event("log", _log_record(step))
            else:
                step += 1
                event = to_event("step", _step_record(step))
            event.seq = seq
            event.time_seconds = time.time()
            events.append(event)
        out.append(pb.StreamRequest(run_id=run_id, rank=0, events=events))
    return out


def _stream(address: str, requests: list[pb.StreamRequest], acks: list[int]) -> None:
    """Send every batch on one stream (its RunStart attested, as the callback does) and keep
    the last ack."""
    for response in attested_stream(address, requests):
        acks.append(response.ack_seq)


def ingest(sidecar: SidecarProcess, batches: int, batch: int, logs: bool = False
           ) -> tuple[float, float, int]:
    """(records/s wall, records/s per sidecar CPU second, records) for RUNS streams."""
    assert sidecar.process is not None
    return _ingest(sidecar.address, sidecar.process.pid, batches, batch, logs)


def transport_floor(batches: int, batch: int, logs: bool = False) -> tuple[float, float, int]:
    """``ingest``'s streams against ``bench.transport_floor``: what the gRPC transport costs
    with nothing applied."""
    with tempfile.TemporaryDirectory() as tmp:
        socket_path = Path(tmp) / "floor.sock"
        server = subprocess.Popen(
            [sys.executable, "-m", "bench.transport_floor", str(socket_path)],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":  # "" once it died
                raise RuntimeError(f"the transport floor server exited ({server.wait()})")
            return _ingest(f"unix://{socket_path}", server.pid, batches, batch, logs)
        finally:
            server.kill()
            server.wait()


def _streamed(address: str, pid: int, plans: list[list[pb.StreamRequest]], acked: int
              ) -> tuple[float, float]:
    """(wall seconds, the process pid's CPU seconds) to send every plan on a stream of its
    own, all at once; each stream's last ack must be acked (its highest sequence number)."""
    acks: list[list[int]] = [[] for _ in plans]
    threads = [threading.Thread(target=_stream, args=(address, plan, acks[i]))
               for i, plan in enumerate(plans)]
    cpu0 = _cpu_seconds(pid)
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    cpu = _cpu_seconds(pid) - cpu0
    last = [a[-1] if a else -1 for a in acks]
    if last != [acked] * len(plans):
        raise RuntimeError(f"not every event was acknowledged: {last[:5]}...")
    return wall, max(cpu, 1e-9)


def _ingest(address: str, pid: int, batches: int, batch: int, logs: bool = False
            ) -> tuple[float, float, int]:
    plans = [_requests(run, batches, batch, logs) for run in range(RUNS)]
    wall, cpu = _streamed(address, pid, plans, batches * batch)
    records = RUNS * batches * batch
    return records / wall, records / cpu, records


def scrape(sidecar: SidecarProcess, repeats: int) -> tuple[list[float], int]:
    """Seconds per /metrics GET, and the page size."""
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    times = []
    size = 0
    for _ in range(repeats):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            size = len(response.read())
        times.append(time.perf_counter() - start)
    return times, size


class WakeEveryRecordClient(StreamClient):
    """An earlier client, measured beside the real one: it woke the sender on every record."""

    def submit(self, kind: str, record: object) -> None:
        ordinal = self.submitted + 1
        self.submitted = ordinal
        time.time()  # it stamped the record here; the tuple keeps the ordinal the sender reads
        self._queue.append((kind, record, ordinal))
        self._wake.set()


#: The kinds the previous client looked up on every record, to wake its sender for them.
_URGENT_KINDS = frozenset({"checkpoint", "run_end"})


class ClockedClient(StreamClient):
    """The previous client, measured beside the real one: it read the clock on the training
    thread for every record, checked the queue for a full batch and a full queue, and looked
    the kind up among the urgent ones. (The tuple carries the ordinal the sender now reads
    instead of the time; the clock is read all the same.)"""

    def submit(self, kind: str, record: object) -> None:
        ordinal = self.submitted + 1
        self.submitted = ordinal
        queue = self._queue
        if len(queue) >= _MAX_QUEUE:  # (never true here: the sender drains)
            queue.popleft()
        time.time()
        queue.append((kind, record, ordinal))
        if len(queue) >= _BATCH_SIZE or kind in _URGENT_KINDS:
            self._wake.set()


_MAX_QUEUE = ClientSettings().max_queue
_BATCH_SIZE = ClientSettings().batch_size


#: What each iteration of the hand-off loop times, in turn (see ``handoff``).
SUBMIT, EMPTY, BARE = "submit", "empty", "bare"
#: The training thread's 0.5 ms GIL-free wait between two hand-offs, timed whole.
RESUME = "resume"


def _registered_client(sidecar: SidecarProcess, run_id: str,
                       client_class: type[StreamClient]) -> StreamClient:
    """A started client of a one-rank run the sidecar has registered (its RunStart acked)."""
    client = client_class(sidecar.address, run_id, 0, to_event)
    client.start(RunStartRecord(
        trainer="SFTTrainer", world_size=1, output_dir=f"/tmp/{run_id}", config={},
        config_text={}, versions={},
        membership=Membership(1, 1, 1, 1, 0, 1, 1, [], [], [], []),
        preflight=PreflightFacts(), initial_adapter=AdapterDigest(),
    ))
    deadline = time.monotonic() + 30
    while not client.wait_registered(0.1):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sidecar did not register the run {run_id}")
    return client


def handoff(sidecar: SidecarProcess, calls: int,
            client_class: type[StreamClient] = StreamClient,
            ) -> tuple[dict[str, list[float]], list[float], float]:
    """Per-call seconds of submit() with a live sender, and of its references in the same loop.

    Each iteration stands for a training step: build the step's record, time one thing, then
    sleep (the rest of the step, GIL released, so the sender and other processes run and the
    caches go cold). The thing timed rotates between ``client.submit``, an empty timed region
    (the pair of clock reads alone: after a sleep it is far from free, and every other figure
    includes it) and a bare ``deque.append((kind, record, time.time()))`` into a deque of our
    own, so all three see the same conditions. Also returns the record build times and the
    mean of a tight loop of bare appends (warm caches, the lower bound). ``RESUME`` holds the
    sleeps themselves (see ``resume_alone``).
    """
    bare: deque[tuple[str, object, float]] = deque(maxlen=10_000)
    record = _step_record(1)
    start = time.perf_counter()
    for _ in range(calls):
        bare.append(("step", record, time.time()))
    bare_mean = (time.perf_counter() - start) / calls
    bare.clear()

    client = _registered_client(sidecar, f"bench-handoff-{client_class.__name__}",
                                client_class)
    timed: dict[str, list[float]] = {SUBMIT: [], EMPTY: [], BARE: [], RESUME: []}
    build = []
    order = (SUBMIT, EMPTY, BARE)
    clock = time.perf_counter_ns
    for step in range(1, 3 * calls + 1):
        t0 = clock()
        rec = _step_record(step)
        t1 = clock()
        what = order[step % 3]
        if what == SUBMIT:
            t1 = clock()
            client.submit("step", rec)
            t2 = clock()
        elif what == EMPTY:
            t1 = clock()
            t2 = clock()
        else:
            t1 = clock()
            bare.append(("step", rec, time.time()))
            t2 = clock()
        build.append((t1 - t0) / 1e9)
        timed[what].append((t2 - t1) / 1e9)
        t3 = clock()
        time.sleep(0.0005)  # the rest of the "training step", GIL released
        timed[RESUME].append((clock() - t3) / 1e9)
    client.close(timeout=10)
    return timed, build, bare_mean


def resume_alone(calls: int) -> list[float]:
    """Seconds of the same 0.5 ms sleep with no client in the process: beside the same figure
    with a live sender, it shows whether the sender's drains (records turned into protobuf
    events with the GIL held) delay the training thread's return from a GIL-free wait."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        time.sleep(0.0005)
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return times


def _gil_bound(iterations: int = 300_000) -> float:
    """Seconds of pure-Python work that holds the GIL throughout (the Python side of a step)."""
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return time.perf_counter() - start


def idle_sender_tax(sidecar: SidecarProcess, cycles: int, repeats: int = 5,
                    ) -> tuple[float, float]:
    """Median seconds of GIL-bound work with no client, and with a connected idle client.

    The sender wakes every ``flush_seconds`` and must take the GIL from the training thread
    each time (after up to the switch interval, 5 ms): the difference is what those wake-ups
    cost a training thread busy in Python. Blocks with and without a client alternate, so a
    change in the machine's load falls on both.
    """
    alone: list[float] = []
    live: list[float] = []
    for cycle in range(cycles):
        alone += [_gil_bound() for _ in range(repeats)]
        client = _registered_client(sidecar, f"bench-idle-sender-{cycle}", StreamClient)
        live += [_gil_bound() for _ in range(repeats)]
        client.close(timeout=10)
    return statistics.median(alone), statistics.median(live)


def wake_cost(calls: int) -> tuple[float, float]:
    """Median seconds of deque.append alone and of append + Event.set() waking a waiter.

    Isolates what submit() pays for signalling its sender on every record.
    """
    wake = threading.Event()
    queue: deque[tuple[str, int, float]] = deque()
    done = threading.Event()

    def sender() -> None:
        while not done.is_set():
            wake.wait(1.0)
            wake.clear()
            while queue:
                queue.popleft()

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    result = []
    for signal in (False, True):
        times = []
        for i in range(calls):
            t0 = time.perf_counter_ns()
            queue.append(("step", i, time.time()))
            if signal:
                wake.set()
            times.append((time.perf_counter_ns() - t0) / 1e9)
            time.sleep(0.0005)
        result.append(statistics.median(times))
    done.set()
    wake.set()
    thread.join()
    return result[0], result[1]


def render_in_process(repeats: int) -> tuple[float, float, float, int]:
    """(our page, our page after every run stepped, the library's text) seconds, no HTTP.

    The second figure is what a scrape costs when every run has reported since the last one
    (Prometheus scraping live runs): nothing of a run's figures can be reused.
    """
    from prometheus_client import CollectorRegistry, generate_latest

    from deadweight.sidecar.exposition.collector import DeadweightCollector
    from deadweight.sidecar.exposition.http import render as render_text
    from deadweight.sidecar.logs import configure
    from deadweight.sidecar.registry import Registry

    configure(level="warning")  # 50 "run_registered" lines would drown the tables
    registry = Registry()
    batches, batch = 2, 16
    for run in range(RUNS):
        for request in _requests(run, batches, batch):
            registry.ingest(request)
    collector = DeadweightCollector(registry, None, registry.detectors)
    prom = CollectorRegistry(auto_describe=False)
    prom.register(collector)
    ours, stepped, library = [], [], []
    size = 0
    seq = batches * batch
    for _ in range(repeats):  # ours: what the server renders (collector.exposition)
        start = time.perf_counter()
        size = len(render_text(collector.exposition()))
        ours.append(time.perf_counter() - start)
        seq += 1
        for run in range(RUNS):  # one more step of every run, then the same page again
            event = to_event("step", _step_record(seq))
            event.seq = seq
            event.time_seconds = time.time()
            registry.ingest(pb.StreamRequest(run_id=f"bench-{run}", rank=0, events=[event]))
        start = time.perf_counter()
        render_text(collector.exposition())
        stepped.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate_latest(prom)
        library.append(time.perf_counter() - start)
    return min(ours), min(stepped), min(library), size


#: Events in a batch as the callback sends them: its sender drains every 50 ms, and a
#: training step takes longer, so a batch holds a step report and its log, a few at most.
SMALL_BATCH = 8


def small_batches(batches: int) -> list[list[str]]:
    """Ingest at the callback's batch size, each step report followed by its log: what a
    batch costs beyond its records (detectors, history writes, the gRPC round trip)."""
    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
        wall, per_cpu, _ = ingest(sidecar, batches, SMALL_BATCH, logs=True)
    _, floor_cpu, _ = transport_floor(batches, SMALL_BATCH, logs=True)
    batch_cost = SMALL_BATCH / per_cpu
    return [
        [f"ingest at the callback's batch size: {RUNS} runs x {batches} batches x "
         f"{SMALL_BATCH} events (a step report and its log each)", f"{wall:,.0f} rec/s wall",
         f"{per_cpu:,.0f} rec/s per CPU-s",
         f"reference ({fmt_time(batch_cost)} of CPU a batch; a real run sends a few a second)"],
        ["ingest floor at that batch size (bench.transport_floor)", "",
         f"{floor_cpu:,.0f} rec/s per CPU-s",
         f"reference (the sidecar's own work: {fmt_time(batch_cost - SMALL_BATCH / floor_cpu)}"
         " a batch)"],
    ]


#: Ranks of the sharded run ``sharded_ingest`` streams (FSDP or ZeRO-3 on one node).
SHARDED_RANKS = 8


def sharded_ingest(steps: int) -> tuple[float, float]:
    """(records/s wall, records/s per CPU-second) of one sharded run of SHARDED_RANKS ranks
    on a fresh sidecar, each rank sending one step report a batch: every step received asks
    for the run's combined steps, summed over the ranks' shards."""
    def plan(rank: int) -> list[pb.StreamRequest]:
        start = _run_start(0)
        start.run_start.sharded = True
        start.run_start.world_size = SHARDED_RANKS
        requests = [pb.StreamRequest(run_id="bench-sharded", rank=rank, events=[start])]
        for step in range(1, steps + 1):
            event = to_event("step", _step_record(step))
            event.seq = step
            requests.append(pb.StreamRequest(run_id="bench-sharded", rank=rank,
                                             events=[event]))
        return requests

    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
        assert sidecar.process is not None
        wall, cpu = _streamed(sidecar.address, sidecar.process.pid,
                              [plan(rank) for rank in range(SHARDED_RANKS)], steps)
    records = SHARDED_RANKS * steps
    return records / wall, records / cpu


#: Runs a sidecar holds at most by default (``serve --max-runs``): the tick evaluates each.
TICKED_RUNS = 1000


def answers_during_ticks(batches: int) -> list[float]:
    """Seconds from sending a batch to its answer, one batch at a time every 5 ms, while a
    fresh sidecar holds TICKED_RUNS runs of 256 steps each and ticks them every second."""
    import concurrent.futures

    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
        def register(run: int) -> None:
            _stream(sidecar.address, _requests(run, 1, 256), [])

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(register, range(TICKED_RUNS)))
        answered = threading.Event()
        sent: list[float] = []
        waits: list[float] = []

        def lockstep() -> Iterator[pb.StreamRequest]:
            for request in _requests(TICKED_RUNS, batches, SMALL_BATCH, logs=True):
                answered.clear()
                sent.append(time.perf_counter())
                yield request
                answered.wait(10)
                time.sleep(0.005)

        for _ in attested_stream(sidecar.address, lockstep()):
            waits.append(time.perf_counter() - sent[-1])
            answered.set()
    return waits[1:]  # the first answers the RunStart


@contextlib.contextmanager
def busy_machine() -> Iterator[int]:
    """One process spinning on every core while the block runs (yields how many): a machine
    whose cores are all taken, where the sidecar is preempted and its caches go cold."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
    try:
        yield len(spinners)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def loaded(batches: int, batch: int, scrapes: int, samples: int) -> list[list[str]]:
    """Ingest and /metrics on fresh sidecars while every core is busy with other work: the
    margin the budgets are meant to keep."""
    rates: list[tuple[float, float]] = []
    times: list[float] = []
    with busy_machine() as spinners:
        for _ in range(samples):
            with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
                rates.append(ingest(sidecar, batches, batch)[:2])
                times, _ = scrape(sidecar, scrapes)  # the last sidecar's 50 live runs
    med = statistics.median(times)
    return [
        _ingest_row(f"ingest, machine loaded ({spinners} busy processes, one per core)",
                    rates),
        [f"/metrics with {RUNS} live runs, machine loaded", fmt_time(med),
         f"p99 {fmt_time(_pct(times, 0.99))}",
         f"<= 10 ms (median) {verdict(med <= METRICS_BUDGET)}, "
         f"2x margin {verdict(med <= METRICS_BUDGET / 2)}"],
    ]


def fresh_ingest(batches: int, batch: int, extra_args: list[str]) -> tuple[float, float]:
    """(records/s wall, records/s per CPU-second) of ``ingest`` on a fresh sidecar."""
    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(
            Path(tmp), extra_args=extra_args) as sidecar:
        wall, per_cpu, _ = ingest(sidecar, batches, batch)
    return wall, per_cpu


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: Fresh sidecars each ingest row is measured on (one run varies by 15% on this machine).
INGEST_SAMPLES = 3


def _ingest_row(label: str, samples: list[tuple[float, float]]) -> list[str]:
    """An ingest figure (the median of its samples, and their range) beside its budget and
    the 2x margin aimed for."""
    wall = statistics.median(w for w, _ in samples)
    rates = sorted(r for _, r in samples)
    per_cpu = statistics.median(rates)
    spread = f" ({rates[0]:,.0f}-{rates[-1]:,.0f} over {len(rates)})" if len(rates) > 1 else ""
    return [label, f"{wall:,.0f} rec/s wall", f"{per_cpu:,.0f} rec/s per CPU-s{spread}",
            f">= {INGEST_BUDGET:,} rec/s per core {verdict(per_cpu >= INGEST_BUDGET)}"
            f", 2x margin {verdict(per_cpu >= 2 * INGEST_BUDGET)}"]


def run(repeats: int, quick: bool) -> list[list[str]]:
    """Hand-off, ingest and /metrics rows."""
    rows: list[list[str]] = []
    logging.getLogger("deadweight").setLevel(logging.ERROR)  # a client closing mid-stream warns
    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
        calls = 1000 if quick else 5000
        timed, build, bare = handoff(sidecar, calls)
        submit, empty, appended = timed[SUBMIT], timed[EMPTY], timed[BARE]
        rows.append(["hand-off: deque.append((kind, record, time.time())), tight loop",
                     fmt_time(bare), "", "reference (warm caches)"])
        rows.append(["hand-off: build StepRecord (+ its UpdateStats)",
                     fmt_time(statistics.median(build)), fmt_time(_pct(build, 0.99)),
                     "reference (probe already built the stats)"])
        med = statistics.median(submit)
        rows.append(["hand-off: StreamClient.submit, sender live", fmt_time(med),
                     fmt_time(_pct(submit, 0.99)),
                     f"<= 2 us (median) {verdict(med <= HANDOFF_BUDGET)}"])
        floor = statistics.median(empty)
        rows.append(["hand-off: empty timed region (2 clock reads), same loop", fmt_time(floor),
                     fmt_time(_pct(empty, 0.99)), "reference (inside every figure here)"])
        ref = statistics.median(appended)
        rows.append(["hand-off: deque.append((kind, record, time.time())), same loop",
                     fmt_time(ref), fmt_time(_pct(appended, 0.99)),
                     f"reference (submit = {med / ref:.2f}x this)"])
        rows.append(["hand-off: submit net of the empty region (medians)",
                     fmt_time(max(med - floor, 0.0)), "",
                     f"reference (bare append net: {fmt_time(max(ref - floor, 0.0))})"])
        alone = resume_alone(3 * calls)
        live = timed[RESUME]
        rows.append(["hand-off: training thread back from a 0.5 ms GIL-free wait, sender live",
                     fmt_time(statistics.median(live)), fmt_time(_pct(live, 0.99)),
                     f"reference (no client: {fmt_time(statistics.median(alone))}, "
                     f"p99 {fmt_time(_pct(alone, 0.99))})"])
        alone_s, live_s = idle_sender_tax(sidecar, 4 if quick else 10)
        rows.append(["hand-off: GIL-bound Python work, idle sender live (its timed wake-ups)",
                     fmt_time(live_s), "",
                     f"reference (no client: {fmt_time(alone_s)}, {live_s / alone_s - 1:+.1%})"])
        for label, client_class in (
                ("the previous submit (clock read, queue checks)", ClockedClient),
                ("submit waking the sender on every record (earlier client)",
                 WakeEveryRecordClient)):
            other, _, _ = handoff(sidecar, calls, client_class)
            rows.append([f"hand-off: {label}", fmt_time(statistics.median(other[SUBMIT])),
                         fmt_time(_pct(other[SUBMIT], 0.99)),
                         f"reference (empty region {fmt_time(statistics.median(other[EMPTY]))})"])
        quiet, woken = wake_cost(1000 if quick else 3000)
        rows.append(["hand-off: deque.append, sender not signalled", fmt_time(quiet), "",
                     "reference (sender drains on a timer)"])
        rows.append(["hand-off: deque.append + Event.set() waking the sender", fmt_time(woken),
                     "", "reference (the thread switch submit() now avoids)"])
        batches, batch = (4, 256) if quick else (20, 256)
        samples = 1 if quick else INGEST_SAMPLES
        wall, per_cpu, records = ingest(sidecar, batches, batch)  # its runs stay for /metrics
        unpinned, pinned = [(wall, per_cpu)], []
        for sample in range(samples):  # alternated, so that both see the same conditions
            pinned.append(fresh_ingest(batches, batch, ["--cpu", "auto"]))
            if sample + 1 < samples:
                unpinned.append(fresh_ingest(batches, batch, []))
        rows.append(_ingest_row(f"ingest: {RUNS} runs x {batches} batches x {batch} step "
                                "reports", unpinned))
        rows.append(_ingest_row("ingest, a fresh sidecar pinned to one CPU (serve --cpu auto)",
                                pinned))
        per_cpu = statistics.median(r for _, r in unpinned)
        _, floor_cpu, _ = transport_floor(batches, batch)
        own = 1e6 / per_cpu - 1e6 / floor_cpu
        rows.append(["ingest floor: the same streams, gRPC transport only "
                     "(bench.transport_floor)", "", f"{floor_cpu:,.0f} rec/s per CPU-s",
                     f"reference (the sidecar's own work: {own:.1f} us of "
                     f"{1e6 / per_cpu:.1f} us a record)"])
        rows.extend(small_batches(160 if quick else 640))
        sharded_wall, sharded_cpu = sharded_ingest(100 if quick else 400)
        rows.append([f"ingest, one sharded run of {SHARDED_RANKS} ranks, one step report a "
                     "batch", f"{sharded_wall:,.0f} rec/s wall",
                     f"{sharded_cpu:,.0f} rec/s per CPU-s",
                     "reference (built afresh at every ask, before: 178 rec/s per CPU-s over "
                     "the first 60 steps, 48 ms a batch once the windows are full)"])
        times, size = scrape(sidecar, 20 if quick else 50)
        med = statistics.median(times)
        rows.append([f"/metrics with {RUNS} live runs ({size / 1024:.0f} KiB)", fmt_time(med),
                     f"p99 {fmt_time(_pct(times, 0.99))}, min {fmt_time(min(times))}",
                     f"<= 10 ms (median) {verdict(med <= METRICS_BUDGET)}, "
                     f"2x margin {verdict(med <= METRICS_BUDGET / 2)}"])
        rows.extend(loaded(batches, batch, 20 if quick else 50, samples))
        waits = answers_during_ticks(200 if quick else 600)
        rows.append([f"a stream's answer, one 8-event batch every 5 ms, while the sidecar "
                     f"ticks {TICKED_RUNS} runs of 256 steps every second",
                     fmt_time(statistics.median(waits)),
                     f"p99 {fmt_time(_pct(waits, 0.99))}, max {fmt_time(max(waits))}",
                     "reference (the tick in one go, before: max 154-179 ms)"])
        del records
        ours, stepped, library, size = render_in_process(20 if quick else 50)
        rows.append([f"/metrics in-process: page / page after every run stepped / library "
                     f"text ({size / 1024:.0f} KiB)",
                     f"{fmt_time(ours)} / {fmt_time(stepped)} / {fmt_time(library)}", "min",
                     "reference"])
    table("sidecar and hand-off (real sidecar process, unix socket)",
          ["what", "median / rate", "p99 / per core", "budget"], rows)
    return rows
