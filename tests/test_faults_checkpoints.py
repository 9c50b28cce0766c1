"""Checkpoint watcher faults inside a real ``deadweight serve``: skipped or flagged, never fatal.

Each test registers a run whose output folder the sidecar watches, plants one bad checkpoint
(still being written, truncated, corrupt header, symlinked outside the folder, deleted or
truncated while hashed, a pickle), and reads the sidecar's JSON log for the line that names
the path and the reason. After every fault a good checkpoint must still be inspected: the
watcher keeps running, and the daemon is still up.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.checkpoint_inspector import inspect_path
from tests.faults import Pipe, poll

pytestmark = pytest.mark.slow


class Watched:
    """One registered run on the shared sidecar, and the sidecar's log lines about paths."""

    def __init__(self, sidecar: SidecarProcess, pipe: Pipe, run_id: str, out: Path) -> None:
        self.sidecar, self.pipe, self.run_id, self.out = sidecar, pipe, run_id, out
        self.seq = 0
        out.mkdir(parents=True)
        start = pb.RunStart(trainer="SFTTrainer", output_dir=str(out))
        assert not pipe.send(pb.StreamRequest(run_id=run_id,
                                              events=[pb.Event(run_start=start)])).error

    def report(self, folder: Path) -> None:
        """What the callback's on_save sends: the folder is complete (trusted)."""
        self.seq += 1
        event = pb.Event(seq=self.seq, checkpoint=pb.CheckpointReport(step=self.seq,
                                                                      path=str(folder)))
        assert not self.pipe.send(pb.StreamRequest(run_id=self.run_id, events=[event])).error

    def lines(self, path: Path) -> list[dict[str, Any]]:
        found = []
        for raw in self.sidecar.log_path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and str(path) in str(line.get("path", "")):
                found.append(line)
        return found

    def wait_line(self, path: Path, *events: str) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((x for x in self.lines(path) if x.get("event") in events), None)

        line: dict[str, Any] = poll(find, timeout=20, what=f"{events} for {path.name}")
        return line

    def still_works(self, name: str = "checkpoint-999") -> None:
        """A good checkpoint after the fault is inspected: the watcher kept running."""
        good = _adapter(self.out / name)
        self.report(good)
        self.wait_line(good, "checkpoint_inspected")
        assert self.sidecar.process is not None and self.sidecar.process.poll() is None


def _adapter(folder: Path, value: float = 0.5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.q_proj.lora_A.weight": np.full((4, 8), value, np.float32),
               "base_model.model.q_proj.lora_B.weight": np.full((8, 4), value, np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def _sparse_safetensors(path: Path, nbytes: int) -> None:
    """A valid safetensors file with one huge all-zero tensor, sparse on disk."""
    header = json.dumps({"base_model.model.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}).encode()
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + nbytes)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Pipe]]:
    with SidecarProcess(tmp_path_factory.mktemp("watcher")) as process:
        pipe = Pipe(process.address)
        yield process, pipe
        pipe.close()


@pytest.fixture
def run(sidecar: tuple[SidecarProcess, Pipe], tmp_path: Path,
        request: pytest.FixtureRequest) -> Watched:
    process, pipe = sidecar
    return Watched(process, pipe, f"ckpt-{request.node.name}"[:100], tmp_path / "out")


def test_a_checkpoint_still_being_written_is_inspected_once_complete(run: Watched) -> None:
    folder = run.out / "checkpoint-1"
    final = _adapter(run.out.parent / "final")  # the bytes the writer will end with
    data = (final / "adapter_model.safetensors").read_bytes()
    folder.mkdir()
    target = folder / "adapter_model.safetensors"
    with target.open("wb") as handle:  # a slow writer: the watcher must wait (settle 2 s)
        for i in range(0, len(data), len(data) // 5 + 1):
            handle.write(data[i:i + len(data) // 5 + 1])
            handle.flush()
            time.sleep(0.3)
    line = run.wait_line(folder, "checkpoint_inspected")
    assert line["digest"] == inspect_path(final).adapter_digest
    assert [x["event"] for x in run.lines(folder)] == ["checkpoint_inspected"]
    run.still_works()


def _truncated(path: Path) -> None:
    save_file({"lora_A.weight": np.ones((64, 64), np.float32)}, str(path))
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _huge_header_length(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 2**60) + b"{}")


def _header_not_json(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 8) + b"{not js}" + b"\0" * 16)


@pytest.mark.parametrize(("make", "reason"), [
    (_truncated, "invalid data_offsets"),
    (_huge_header_length, "header length"),
    (_header_not_json, "header is not JSON"),
    (lambda path: path.write_bytes(b"\0" * 4), "too short"),
])
def test_broken_safetensors_are_skipped_with_the_reason(
    run: Watched, make: Any, reason: str
) -> None:
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    make(folder / "adapter_model.safetensors")
    run.report(folder)
    line = run.wait_line(folder, "checkpoint_not_inspected", "checkpoint_inspected")
    assert line["event"] == "checkpoint_not_inspected" and reason in line["error"], line
    run.still_works()


def test_a_zero_byte_adapter_is_inspected_and_called_empty(run: Watched) -> None:
    """A 0-byte adapter file is what an ungathered partitioned save can leave: it is not a
    broken file to skip but weights that were never written (``empty_adapter``)."""
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"")
    run.report(folder)
    line = run.wait_line(folder, "checkpoint_not_inspected", "checkpoint_inspected")
    assert line["event"] == "checkpoint_inspected" and line["bytes"] == 0, line

    def empty() -> pb.Finding | None:
        status = run.sidecar.run_status(run.run_id)
        found = [f for f in status.findings if f.detector == "empty_adapter"] if status else []
        return found[0] if found else None

    finding = poll(empty, timeout=20, what="empty_adapter on the 0-byte adapter")
    assert finding.firing and finding.evidence["tensors"] == "0"
    run.still_works()


def test_symlinks_leaving_the_output_folder_are_not_followed(
    run: Watched, tmp_path: Path
) -> None:
    outside = _adapter(tmp_path / "elsewhere")
    linked_folder = run.out / "checkpoint-1"
    linked_folder.symlink_to(outside, target_is_directory=True)
    linked_file = run.out / "checkpoint-2"
    linked_file.mkdir()
    (linked_file / "adapter_model.safetensors").symlink_to(
        outside / "adapter_model.safetensors")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening this would block the watcher forever
    linked_fifo = run.out / "checkpoint-3"
    linked_fifo.mkdir()
    (linked_fifo / "adapter_model.safetensors").symlink_to(fifo)
    for folder in (linked_folder, linked_file, linked_fifo):
        run.report(folder)
    for folder in (linked_folder, linked_file, linked_fifo):
        line = run.wait_line(folder, "checkpoint_skipped", "checkpoint_not_inspected",
                             "checkpoint_inspected")
        assert line["event"] in ("checkpoint_skipped", "checkpoint_not_inspected"), line
    for folder in (linked_folder, linked_file):
        line = run.wait_line(folder, "checkpoint_skipped")
        assert "outside" in line["reason"], line
    run.still_works()


def test_a_folder_deleted_while_hashed(run: Watched) -> None:
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    _sparse_safetensors(folder / "adapter_model.safetensors", 1 << 30)
    run.report(folder)
    shutil.rmtree(folder)
    line = run.wait_line(folder, "checkpoint_not_inspected", "checkpoint_inspected")
    if line["event"] == "checkpoint_not_inspected":
        assert "No such file" in line["error"] or "no such file" in line["error"], line
    run.still_works()


def _open_by(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_file_truncated_while_hashed_does_not_kill_the_sidecar(run: Watched) -> None:
    """Rewriting a checkpoint in place shrinks the file under the reader (a mapped read dies
    of SIGBUS here); the sidecar must log it and live on."""
    assert run.sidecar.process is not None
    pid = run.sidecar.process.pid
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    weights = folder / "adapter_model.safetensors"
    _sparse_safetensors(weights, 4 << 30)
    run.report(folder)
    poll(lambda: _open_by(pid, weights), timeout=20, what="the watcher to open the file")
    os.truncate(weights, 100)
    line = run.wait_line(folder, "checkpoint_not_inspected", "checkpoint_inspected")
    assert run.sidecar.process.poll() is None, "the sidecar died while hashing"
    assert line["event"] == "checkpoint_not_inspected", line
    run.still_works()


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_pickle_checkpoint_is_flagged_and_never_opened(run: Watched, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    (folder / "adapter_model.bin").write_bytes(pickle.dumps(_Boom(marker)))
    run.report(folder)
    run.wait_line(folder, "checkpoint_inspected")

    def pickle_finding() -> Any:
        status = run.sidecar.run_status(run.run_id)
        findings = {f.detector: f for f in status.findings} if status else {}
        return findings.get("pickle_checkpoint")

    finding = poll(pickle_finding, what="pickle_checkpoint to fire")
    assert finding.firing and "adapter_model.bin" in str(dict(finding.evidence))
    assert not marker.exists()  # deadweight never unpickles anything
    run.still_works()
