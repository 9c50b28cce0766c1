"""The sidecar's peak memory with every cap reached at once, against the manifest's limit.

A real ``deadweight serve`` child process runs with the memory-relevant flags of the
Kubernetes manifest (``--max-runs``, ``--max-ranks``, ``--state-dir``, ``--watch-root``) and
is driven by a hostile client to every cap together:

- ``--max-runs`` runs, each RunStart as large as a message may be (config values of 4096
  characters up to the 4 MiB message cap), all kept by the sidecar;
- ``--max-ranks`` ranks across them, each with ``STEP_WINDOW`` steps of
  ``MAX_ADAPTERS_PER_STEP`` adapter groups whose names are ``MAX_GROUP_NAME`` long and distinct;
- per run ``MAX_LOG_KEYS`` log keys of ``MAX_LOG_KEY_LENGTH`` characters, ``LOG_WINDOW``
  values each;
- per run ``CHECKPOINT_WINDOW`` checkpoint reports, the newest ones with a per-tensor digest
  map as large as a message may hold, and for each run a checkpoint folder under the watch
  root whose safetensors header is just under ``MAX_HEADER_BYTES`` with ``MAX_TENSORS``
  tensors, inspected by the watcher;
- then concurrent Status requests (answers up to ``STATUS_MAX_BYTES``) and ``/metrics``
  scrapes.

The peak is the process's ``VmHWM`` (``/proc/<pid>/status``). The unix socket's attestation is
lifted (``--allow-unattested``): it changes who may write, not what a writer may make the
sidecar hold. ``scale`` < 1 shrinks the counts (runs, ranks, steps, keys, tensors) for a quick
run of the same shape.
"""

from __future__ import annotations

import itertools
import json
import struct
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import MAX_MESSAGE_BYTES, monitor_stub, pb
from deadweight.sidecar.checkpoints.inspector import MAX_HEADER_BYTES, MAX_TENSORS
from deadweight.sidecar.commands import status
from deadweight.sidecar.model import limits, step_point
from deadweight.sidecar.model import run_state as state

from .common import in_threads, table, verdict

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "training-job.yaml"
#: Flags of the manifest's sidecar that bound what it holds.
MEMORY_FLAGS = ("--max-runs", "--max-ranks")
#: Room left in each message for everything but the payload that fills it.
MESSAGE_SLACK = 64 * 1024
MIB = 1024 * 1024


@dataclass(frozen=True)
class Manifest:
    """What the Kubernetes manifest gives the sidecar: flags and memory."""

    flags: dict[str, int]
    limit_bytes: int
    request_bytes: int


def quantity(text: str) -> int:
    """A Kubernetes memory quantity (``512Mi``, ``1Gi``, ``1000M``) in bytes."""
    units = {"Ki": 1024, "Mi": MIB, "Gi": 1024 * MIB, "K": 1000, "M": 1000**2, "G": 1000**3}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def manifest() -> Manifest:
    doc = yaml.safe_load(MANIFEST.read_text())
    spec = doc["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "deadweight")
    args: list[str] = sidecar.get("args", [])
    flags = {flag: int(args[args.index(flag) + 1]) for flag in MEMORY_FLAGS if flag in args}
    resources = sidecar["resources"]
    return Manifest(flags, quantity(resources["limits"]["memory"]),
                    quantity(resources["requests"]["memory"]))


@dataclass
class Shape:
    """How far each cap is driven."""

    runs: int
    ranks: int
    steps: int
    adapters: int
    log_keys: int
    log_values: int
    checkpoints: int
    tensors: int

    @classmethod
    def worst(cls, runs: int, ranks: int, scale: float = 1.0) -> Shape:
        def part(full: int) -> int:
            return max(1, int(full * scale))
        return cls(runs=part(runs), ranks=part(ranks), steps=part(state.STEP_WINDOW),
                   adapters=step_point.MAX_ADAPTERS_PER_STEP, log_keys=part(state.MAX_LOG_KEYS),
                   log_values=part(state.LOG_WINDOW), checkpoints=part(state.CHECKPOINT_WINDOW),
                   tensors=part(MAX_TENSORS))


def _name(prefix: str, index: int, length: int) -> str:
    """A distinct name of exactly length characters (nothing shared, nothing interned)."""
    head = f"{prefix}.{index}."
    return head + "x" * (length - len(head))


def write_checkpoint(folder: Path, tensors: int, header_limit: int = MAX_HEADER_BYTES) -> int:
    """A safetensors file of F32 scalars whose header is just under header_limit; its size."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    entry = len(json.dumps({"x": {"dtype": "F32", "shape": [1],
                                  "data_offsets": [10**8, 10**8 + 4]}})) - 1
    name_length = max(16, (header_limit - 64) // tensors - entry - 1)
    header: dict[str, Any] = {}
    for index in range(tensors):
        header[_name(f"base_model.model.layers.{index}.lora_A", index, name_length)] = {
            "dtype": "F32", "shape": [1], "data_offsets": [index * 4, index * 4 + 4]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= header_limit, (len(raw), header_limit)
    path = folder / "adapter_model.safetensors"
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        out.write(b"\x00" * (4 * tensors))
    return len(raw)


class Client:
    """One stream per (run, rank); batches are sent and answered one at a time."""

    def __init__(self, socket_path: Path) -> None:
        self.channel = grpc.insecure_channel(
            f"unix://{socket_path}",
            options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_receive_message_length", 64 * MIB)])
        self.stub = monitor_stub(self.channel)
        #: The last sequence number sent per (run, rank): a later stream continues it.
        self.seqs: dict[tuple[str, int], int] = {}

    def send(self, run_id: str, rank: int, batches: Iterator[list[pb.Event]]) -> list[str]:
        """Send every batch on one stream; the errors the sidecar answered."""
        errors: list[str] = []

        def requests() -> Iterator[pb.StreamRequest]:
            for events in batches:
                for event in events:
                    event.seq = self.seqs.get((run_id, rank), 0) + 1
                    self.seqs[(run_id, rank)] = event.seq
                yield pb.StreamRequest(run_id=run_id, rank=rank, events=events)

        for response in self.stub.Stream(requests()):
            if response.error:
                errors.append(response.error)
        return errors


def _run_start(run: int, output_dir: Path) -> pb.Event:
    """A RunStart as large as one message may be: config values of MAX_TEXT_LENGTH."""
    value = "v" * limits.MAX_TEXT_LENGTH
    entries = min(limits.MAX_MAP_ENTRIES,
                  (MAX_MESSAGE_BYTES - MESSAGE_SLACK) // (limits.MAX_TEXT_LENGTH + 64))
    config_text = {_name(f"run{run}.config", i, 48): value for i in range(entries)}
    return pb.Event(time_seconds=time.time(), run_start=pb.RunStart(
        trainer="SFTTrainer", world_size=1, output_dir=str(output_dir),
        config_text=config_text,
        membership=pb.OptimizerMembership(optimizer_params=1000, trainable_params=1000,
                                          adapter_params=1000, adapter_tensors=4)))


def _batched(events: Iterator[pb.Event]) -> Iterator[list[pb.Event]]:
    """events in batches of about half a message each (two fit in what the sidecar accepts)."""
    batch: list[pb.Event] = []
    size = 0
    for event in events:
        size += event.ByteSize()
        batch.append(event)
        if size > (MAX_MESSAGE_BYTES - MESSAGE_SLACK) // 2:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _steps(run: int, rank: int, shape: Shape) -> Iterator[list[pb.Event]]:
    """shape.steps optimizer steps, each with shape.adapters distinct adapter groups."""
    def step_events() -> Iterator[pb.Event]:
        for step in range(1, shape.steps + 1):
            groups = [pb.GroupUpdate(name=_name(f"r{run}.k{rank}.s{step}", g,
                                                step_point.MAX_GROUP_NAME),
                                     kind="adapter", update_sq_sum=1e-3 * (g + 1), tensors=2,
                                     unchanged_tensors=0, optimizer_tensors=2)
                      for g in range(shape.adapters)]
            yield pb.Event(time_seconds=time.time(), step=pb.StepReport(
                step=step, learning_rate=1e-4, update_sq_sum=1.0, param_sq_sum=2.0,
                watched_tensors=2 * shape.adapters, watched_params=1000, optimizer_params=1000,
                groups=groups))

    return _batched(step_events())


def _logs(run: int, shape: Shape) -> Iterator[list[pb.Event]]:
    """shape.log_values log reports, each with shape.log_keys long distinct keys."""
    keys = [_name(f"run{run}.log", k, limits.MAX_LOG_KEY_LENGTH) for k in range(shape.log_keys)]
    return _batched(pb.Event(time_seconds=time.time(), log=pb.LogReport(
        step=step, values={key: step + 0.5 for key in keys}))
        for step in range(1, shape.log_values + 1))


def _checkpoints(run: int, shape: Shape, folder: Path) -> Iterator[list[pb.Event]]:
    """shape.checkpoints reports; the newest state.DIGEST_MAPS_KEPT + 1 with a per-tensor map
    as large as a message holds (older maps are dropped, so their size does not matter), the
    last one naming the inspected folder."""
    per_entry = (MAX_MESSAGE_BYTES - MESSAGE_SLACK) // min(limits.MAX_DIGEST_TENSORS,
                                                           shape.tensors)
    key_length = max(8, per_entry - 32 - 8)
    full = range(shape.checkpoints - state.DIGEST_MAPS_KEPT - 1, shape.checkpoints)
    for index in range(shape.checkpoints):
        tensors = {}
        if index in full:
            tensors = {_name(f"r{run}.c{index}", t, key_length): f"{t:032x}"
                       for t in range(min(limits.MAX_DIGEST_TENSORS, shape.tensors))}
        last = index == shape.checkpoints - 1
        path = folder if last else folder.parent / f"checkpoint-{index}"
        yield [pb.Event(time_seconds=time.time(), checkpoint=pb.CheckpointReport(
            step=index + 1, path=str(path), adapter=pb.AdapterDigest(
                combined=f"{index:032x}", tensors=tensors, bytes=4 * len(tensors))))]


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _status_storm(sidecar: SidecarProcess, parallel: int) -> int:
    """parallel concurrent Status calls; the largest answer in bytes (raises on a failure)."""
    sizes: list[int] = []
    failures: list[BaseException] = []

    def one() -> None:
        try:
            sizes.append(status.fetch(sidecar.address, timeout=120.0).ByteSize())
        except grpc.RpcError as err:
            failures.append(err)

    in_threads(one, parallel)
    if failures:
        raise failures[0]
    return max(sizes)


@dataclass
class Result:
    peak_bytes: int
    rss_bytes: int
    idle_peak_bytes: int
    refused_rank: str
    status_bytes: int
    inspected: int
    seconds: float


def measure(folder: Path, flags: dict[str, int], shape: Shape, parallel: int = 4) -> Result:
    """Start a sidecar with flags, drive it to shape, and read its peak RSS."""
    began = time.monotonic()
    roots = folder / "out"
    roots.mkdir(parents=True, exist_ok=True)
    # Info level: the watcher's checkpoint_inspected lines say when inspection is done.
    extra = ["--state-dir", str(folder / "state"), "--allow-unattested",
             *[str(v) for kv in flags.items() for v in kv]]
    log_path = folder / "sidecar.log"
    with SidecarProcess(folder / "sidecar", extra_args=extra, watch_roots=[roots],
                        log_path=log_path) as sidecar:
        assert sidecar.process is not None
        pid = sidecar.process.pid
        idle = _vm(pid, "VmHWM")
        client = Client(sidecar.socket_path)
        folders = []
        for run in range(shape.runs):
            ckpt = roots / f"run-{run}" / f"checkpoint-{shape.checkpoints - 1}"
            write_checkpoint(ckpt, shape.tensors,
                             header_limit=max(4096, int(MAX_HEADER_BYTES * shape.tensors
                                                        / MAX_TENSORS)))
            folders.append(ckpt)
            started = client.send(f"mem-{run}", 0, iter([[_run_start(run, ckpt.parent)]]))
            assert not started, started
        ranks_of = {run: [r for r in range(shape.ranks) if r % shape.runs == run]
                    for run in range(shape.runs)}
        work: list[tuple[str, int, Iterator[list[pb.Event]]]] = []
        for run in range(shape.runs):
            for rank in ranks_of[run]:
                batches = _steps(run, rank, shape)
                if rank // shape.runs == 0:  # the leader: run-wide logs and checkpoints too
                    batches = itertools.chain(batches, _logs(run, shape),
                                              _checkpoints(run, shape, folders[run]))
                work.append((f"mem-{run}", rank // shape.runs, batches))
        errors: list[str] = []
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    if not work:
                        return
                    run_id, rank, batches = work.pop()
                found = client.send(run_id, rank, batches)
                with lock:
                    errors.extend(found)

        in_threads(drain, parallel)
        assert not errors, errors[:3]
        # One rank beyond --max-ranks is refused (the cap that bounds all of the above).
        refused = client.send("mem-0", 10_000, iter([[pb.Event(
            time_seconds=time.time(), heartbeat=pb.Heartbeat(step=1))]]))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            inspected = log_path.read_text(errors="replace").count('"checkpoint_inspected"')
            if inspected >= shape.runs:
                break
            time.sleep(0.5)
        biggest = _status_storm(sidecar, parallel)
        for _ in range(parallel):
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=60) as answer:
                answer.read()
        result = Result(peak_bytes=_vm(pid, "VmHWM"), rss_bytes=_vm(pid, "VmRSS"),
                        idle_peak_bytes=idle, refused_rank=refused[0] if refused else "",
                        status_bytes=biggest, inspected=inspected,
                        seconds=time.monotonic() - began)
        client.channel.close()
    return result


def mib(size: int) -> str:
    return f"{size / MIB:,.0f} MiB"


def run(repeats: int, quick: bool) -> list[list[str]]:
    """Print the peak against the manifest's limit (repeats: unused, one pass is the figure)."""
    found = manifest()
    shape = Shape.worst(found.flags.get("--max-runs", 1000), found.flags.get("--max-ranks", 1024),
                        scale=0.25 if quick else 1.0)
    with tempfile.TemporaryDirectory(prefix="deadweight-memory-") as tmp:
        result = measure(Path(tmp), found.flags, shape)
    rows = [
        ["sidecar idle (started, nothing reported)", mib(result.idle_peak_bytes), "", ""],
        [f"every cap at once: {shape.runs} runs, {shape.ranks} ranks x {shape.steps} steps x "
         f"{shape.adapters} adapters, {shape.log_keys} log keys x {shape.log_values}, "
         f"{shape.checkpoints} checkpoints/run, {result.inspected} headers of "
         f"{shape.tensors} tensors inspected, Status {result.status_bytes / 1024:.0f} KiB",
         mib(result.peak_bytes), f"RSS after {mib(result.rss_bytes)}",
         f"<= limit {mib(found.limit_bytes)} "
         f"{verdict(result.peak_bytes <= found.limit_bytes)}"],
        [f"rank beyond --max-ranks {found.flags.get('--max-ranks')}",
         result.refused_rank[:60] or "ACCEPTED", "", ""],
    ]
    table(f"sidecar memory, manifest flags {found.flags} "
          f"({'quick, scale 0.25' if quick else 'full'}, {result.seconds:.0f} s)",
          ["what", "peak RSS (VmHWM)", "", "budget"], rows)
    return rows
