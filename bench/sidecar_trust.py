"""The sidecar under the resource attacks of issue 12 (items 5 and 7): what a real job feels.

Heartbeat flood: a client registers a run with the most adapters the caps allow (1024 in the
membership, 1024 adapter groups per step) and sends heartbeats and steps as fast as the
sidecar answers, while a second, normal client's step -> ack round trip is timed, before and
under the attack. ``Registry.ingest`` of one heartbeat (the time it holds the registry lock)
is also timed in-process, with the per-step adapter cap and with it lifted (the earlier code).

Scrape flood: 50 threads scrape ``/metrics`` at once while idle connections are held open
(connected, never sending a byte), against a real ``deadweight serve`` with 50 live runs.
Reported: scrape time of the served ones (median, p99, max) and how many got the 503.
"""

from __future__ import annotations

import logging
import queue
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.model import step_point

from .common import attested_stream, fmt_time, in_threads, table
from .sidecar_load import RUNS, _pct, _requests

#: The caps of sidecar/model/limits.py: the most adapters and groups one client may send.
ADAPTERS = 1024
SCRAPERS = 50


class _Stream:
    """One open Stream: send a batch, wait for its answer (a client's round trip)."""

    def __init__(self, socket_path: Path) -> None:
        self._requests: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self._responses = attested_stream(f"unix://{socket_path}",
                                          iter(self._requests.get, None))

    def send(self, request: pb.StreamRequest) -> pb.StreamResponse:
        self._requests.put(request)
        response: pb.StreamResponse = next(self._responses)
        if response.error:
            raise RuntimeError(f"sidecar refused a bench batch: {response.error}")
        return response

    def close(self) -> None:
        self._requests.put(None)
        self._responses.close()


def attack_start(adapters: int = ADAPTERS) -> pb.RunStart:
    """A RunStart naming as many adapters as the caps allow."""
    return pb.RunStart(trainer="SFTTrainer", world_size=1, membership=pb.OptimizerMembership(
        optimizer_params=adapters * 1000, trainable_params=adapters * 1000,
        adapter_params=adapters * 1000, adapter_tensors=4 * adapters,
        adapters=[pb.AdapterCoverage(name=f"adapter-{i}", tensors=4, params=1000,
                                     in_optimizer_tensors=4, active=True)
                  for i in range(adapters)]))


def attack_step(step: int, seq: int, adapters: int = ADAPTERS) -> pb.Event:
    """One step report with one adapter group per adapter."""
    return pb.Event(seq=seq, time_seconds=time.time(), step=pb.StepReport(
        step=step, learning_rate=1e-4, update_sq_sum=1e-6, param_sq_sum=1.0,
        watched_tensors=4 * adapters, watched_params=1000 * adapters,
        optimizer_params=1000 * adapters,
        groups=[pb.GroupUpdate(name=f"adapter-{i}", kind="adapter", update_sq_sum=1e-9,
                               tensors=4) for i in range(adapters)]))


def heartbeat(step: int) -> pb.Event:
    return pb.Event(time_seconds=time.time(), heartbeat=pb.Heartbeat(step=step))


def _normal_step(step: int, seq: int) -> list[pb.Event]:
    return [pb.Event(seq=seq, time_seconds=time.time(), step=pb.StepReport(
                step=step, learning_rate=1e-4, update_sq_sum=1e-6, param_sq_sum=1.0,
                watched_tensors=4, watched_params=1000, optimizer_params=1000)),
            pb.Event(seq=seq + 1, time_seconds=time.time(), log=pb.LogReport(
                step=step, values={"loss": 2.0, "grad_norm": 0.5, "learning_rate": 1e-4}))]


def ingest_in_process(steps: int, heartbeats: int, cap: int) -> tuple[list[float], list[float]]:
    """Seconds of Registry.ingest per attack step and per heartbeat, with the adapter cap."""
    from deadweight.sidecar.logs import configure
    from deadweight.sidecar.registry import Registry

    configure(level="error")
    kept = step_point.MAX_ADAPTERS_PER_STEP
    step_point.MAX_ADAPTERS_PER_STEP = cap
    try:
        registry = Registry()
        registry.ingest(pb.StreamRequest(run_id="attack", events=[
            pb.Event(seq=1, run_start=attack_start())]))
        step_times, beat_times = [], []
        for step in range(1, steps + 1):
            request = pb.StreamRequest(run_id="attack", events=[attack_step(step, step + 1)])
            start = time.perf_counter()
            registry.ingest(request)
            step_times.append(time.perf_counter() - start)
        for _ in range(heartbeats):
            request = pb.StreamRequest(run_id="attack", events=[heartbeat(steps)])
            start = time.perf_counter()
            registry.ingest(request)
            beat_times.append(time.perf_counter() - start)
        return step_times, beat_times
    finally:
        step_point.MAX_ADAPTERS_PER_STEP = kept


class _Attacker(threading.Thread):
    """Heartbeats (and every step_every-th batch a 1024-group step) as fast as acked."""

    def __init__(self, sidecar: SidecarProcess, run_id: str, step_every: int) -> None:
        super().__init__(daemon=True)
        self.stream = _Stream(sidecar.socket_path)
        self.run_id = run_id
        self.step_every = step_every
        self.stop = threading.Event()
        self.heartbeats = 0
        self.steps = 0
        self.beat_times: list[float] = []
        self.seq = 1
        self.stream.send(pb.StreamRequest(run_id=run_id, events=[
            pb.Event(seq=self.seq, run_start=attack_start())]))
        for _ in range(60):  # fill the step window first
            self._step()

    def _step(self) -> None:
        self.seq += 1
        self.steps += 1
        self.stream.send(pb.StreamRequest(run_id=self.run_id, events=[
            attack_step(self.steps, self.seq)]))

    def run(self) -> None:
        batch = 0
        while not self.stop.is_set():
            batch += 1
            if self.step_every and batch % self.step_every == 0:
                self._step()
                continue
            start = time.perf_counter()
            self.stream.send(pb.StreamRequest(run_id=self.run_id,
                                              events=[heartbeat(self.steps)]))
            self.beat_times.append(time.perf_counter() - start)
            self.heartbeats += 1

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        self.stream.close()


def _round_trips(stream: _Stream, run_id: str, first: int, count: int) -> list[float]:
    """The normal job's step -> ack seconds for count steps, at a training loop's pace."""
    times = []
    for step in range(first, first + count):
        request = pb.StreamRequest(run_id=run_id, events=_normal_step(step, 2 * step))
        start = time.perf_counter()
        stream.send(request)
        times.append(time.perf_counter() - start)
        time.sleep(0.005)  # the rest of the training step
    return times


def heartbeat_flood(sidecar: SidecarProcess, samples: int) -> list[list[str]]:
    """Rows: the normal job's round trip idle / under heartbeats / under heartbeats + steps,
    and the sidecar's CPU per attacker heartbeat."""
    from .sidecar_load import _cpu_seconds

    assert sidecar.process is not None
    normal = _Stream(sidecar.socket_path)
    normal.send(pb.StreamRequest(run_id="normal", events=[pb.Event(
        seq=1, run_start=pb.RunStart(trainer="SFTTrainer", world_size=1))]))
    rows = []
    idle = _round_trips(normal, "normal", 1, samples)
    rows.append(["normal job step -> ack, idle", fmt_time(statistics.median(idle)),
                 fmt_time(_pct(idle, 0.99)), "reference"])
    step = 1 + samples
    for label, step_every in (("heartbeats only", 0), ("9 heartbeats : 1 step", 10)):
        attacker = _Attacker(sidecar, f"attack-{step_every}", step_every)
        cpu0 = _cpu_seconds(sidecar.process.pid)
        attacker.start()
        under = _round_trips(normal, "normal", step, samples)
        attacker.finish()
        cpu = _cpu_seconds(sidecar.process.pid) - cpu0
        step += samples
        rows.append([f"normal job step -> ack, under {ADAPTERS}x{ADAPTERS} flood ({label})",
                     fmt_time(statistics.median(under)), fmt_time(_pct(under, 0.99)),
                     f"{attacker.heartbeats} heartbeats + {attacker.steps - 60} steps sent"])
        if not step_every:
            rows.append([f"attacker heartbeat round trip / sidecar CPU per heartbeat "
                         f"({ADAPTERS} adapters)",
                         fmt_time(statistics.median(attacker.beat_times)),
                         fmt_time(cpu / max(attacker.heartbeats, 1)),
                         "CPU includes the normal job's steps"])
    normal.close()
    return rows


# -- scrapes ------------------------------------------------------------------------------


def _scrape(port: int) -> tuple[float, str]:
    """Seconds and outcome ("ok", "503", an error name) of one GET /metrics.

    A bare socket client, as cheap as a Go scraper is: 50 urllib clients in one interpreter
    would time their own contention for the GIL, not the sidecar."""
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            head = conn.recv(65536)
            received = len(head)
            while chunk := conn.recv(1 << 20):
                received += len(chunk)
        status = head.split(b" ", 2)[1] if head.startswith(b"HTTP/") else b"?"
        outcome = "ok" if status == b"200" and received > 1000 else status.decode()
    except OSError as err:
        outcome = type(err).__name__
    return time.perf_counter() - start, outcome


def scrape_flood(sidecar: SidecarProcess, idle: int, rounds: int) -> list[str]:
    """SCRAPERS threads each get rounds scrapes served while idle silent connections stay
    open; a 503 is counted and tried again 0.25 s later (a scraper's next attempt)."""
    held = [socket.create_connection(("127.0.0.1", sidecar.metrics_port), timeout=30)
            for _ in range(idle)]
    served: list[float] = []
    refused: list[float] = []
    failed: list[str] = []
    first_served: list[float] = []
    lock = threading.Lock()

    def scraper() -> None:
        begin = time.perf_counter()
        got = 0
        while got < rounds and time.perf_counter() - begin < 60:
            seconds, outcome = _scrape(sidecar.metrics_port)
            with lock:
                if outcome == "ok":
                    if not got:
                        first_served.append(time.perf_counter() - begin)
                    got += 1
                    served.append(seconds)
                elif outcome == "503":
                    refused.append(seconds)
                else:
                    failed.append(outcome)
            if outcome != "ok":
                time.sleep(0.25)  # the scraper's next attempt

    wall = in_threads(scraper, SCRAPERS)
    for conn in held:
        conn.close()
    return [f"{SCRAPERS} parallel scrapers x {rounds}, {idle} idle connections held",
            f"{fmt_time(statistics.median(served))} / {fmt_time(_pct(served, 0.99))} / "
            f"{fmt_time(max(served))}" if served else "none served",
            f"{len(served)} served, {len(refused)} x 503 (slowest "
            f"{fmt_time(max(refused, default=0.0))}), {len(failed)} failed; every scraper "
            f"served within {max(first_served, default=float('nan')):.2f} s; {wall:.1f} s wall",
            "slowest was 4.4 s before the fix"]


def _with_runs(sidecar: SidecarProcess) -> None:
    """RUNS live runs with some steps, as in the /metrics row of sidecar_load."""
    for run in range(RUNS):
        stream = _Stream(sidecar.socket_path)
        for request in _requests(run, 2, 16):
            stream.send(request)
        stream.close()


def run(repeats: int, quick: bool) -> list[list[str]]:
    """Heartbeat-flood and scrape-flood rows."""
    del repeats
    logging.getLogger("deadweight").setLevel(logging.ERROR)
    rows: list[list[str]] = []
    steps, beats = (20, 200) if quick else (60, 1000)
    for cap, label in ((step_point.MAX_ADAPTERS_PER_STEP, "capped (now)"),
                       (ADAPTERS, "cap lifted (earlier code)")):
        step_times, beat_times = ingest_in_process(steps, beats // (1 if cap < 1024 else 10),
                                                   cap)
        rows.append([f"in-process Registry.ingest, {ADAPTERS} adapters, {label}: "
                     "heartbeat / 1024-group step",
                     f"{fmt_time(statistics.median(beat_times))} / "
                     f"{fmt_time(statistics.median(step_times))}",
                     f"{fmt_time(_pct(beat_times, 0.99))} / {fmt_time(_pct(step_times, 0.99))}",
                     "median / p99; lock held this long"])
    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
        rows += heartbeat_flood(sidecar, 100 if quick else 300)
    with tempfile.TemporaryDirectory() as tmp, SidecarProcess(Path(tmp)) as sidecar:
        _with_runs(sidecar)
        for idle in (0, 16, 200):
            rows.append(scrape_flood(sidecar, idle, 4 if quick else 10))
    table("sidecar under resource attacks (issue 12, real sidecar process)",
          ["what", "median (/ p99 / max)", "p99 / counts", "note"], rows)
    return rows
