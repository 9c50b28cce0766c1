"""Checkpoint watcher faults inside a real ``deadweight serve``: skipped or flagged, never fatal.

Each test registers a run whose output folder the sidecar watches, plants one bad checkpoint
(still being written, truncated, corrupt header, symlinked outside the folder, deleted or
truncated while hashed, a pickle), and reads the sidecar's JSON log for the line that names
the path and the reason. After every fault a good checkpoint must still be inspected: the
watcher keeps running, and the daemon is still up.
"""

from __future__ import annotations

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
from deadweight.sidecar.checkpoints.inspector import inspect_path
from tests.support.checkpoint_files import Watched, adapter, sparse_safetensors
from tests.support.faults import Pipe
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow


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
    final = adapter(run.out.parent / "final")  # the bytes the writer will end with
    data = (final / "adapter_model.safetensors").read_bytes()
    folder.mkdir()
    target = folder / "adapter_model.safetensors"
    with target.open("wb") as handle:  # a slow writer: the watcher must wait (settle 2 s)
        for i in range(0, len(data), len(data) // 5 + 1):
            handle.write(data[i:i + len(data) // 5 + 1])
            handle.flush()
            time.sleep(0.3)  # the slowness under test: the writer pauses between chunks
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

    finding = wait_for(empty, 20, what="empty_adapter on the 0-byte adapter")
    assert finding.firing and finding.evidence["tensors"] == "0"
    run.still_works()


def test_symlinks_leaving_the_output_folder_are_not_followed(
    run: Watched, tmp_path: Path
) -> None:
    outside = adapter(tmp_path / "elsewhere")
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


def _open_by(pid: int, path: Path, deleted: bool = False) -> bool:
    """Whether process pid holds path open (``deleted``: open, and unlinked since)."""
    name = f"{path} (deleted)" if deleted else str(path)
    try:
        return any(os.readlink(fd) == name for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_folder_deleted_while_hashed(run: Watched) -> None:
    """The folder goes while the watcher hashes its weights (it holds the file open): the
    hash ends on the open file, the folder listing after it fails, and the checkpoint is
    logged as not inspected, naming the missing path."""
    assert run.sidecar.process is not None
    pid = run.sidecar.process.pid
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    weights = folder / "adapter_model.safetensors"
    sparse_safetensors(weights, 512 << 20)  # seconds of hashing: the deletion lands inside
    run.report(folder)
    wait_for(lambda: _open_by(pid, weights), 20, what="the watcher to open the file")
    shutil.rmtree(folder)
    assert _open_by(pid, weights, deleted=True), "the hash ended before the folder was deleted"
    line = run.wait_line(folder, "checkpoint_not_inspected", "checkpoint_inspected")
    assert line["event"] == "checkpoint_not_inspected", line
    assert "No such file" in line["error"] and str(folder) in line["error"], line
    run.still_works()


def test_a_file_truncated_while_hashed_does_not_kill_the_sidecar(run: Watched) -> None:
    """Rewriting a checkpoint in place shrinks the file under the reader (a mapped read dies
    of SIGBUS here); the sidecar must log it and live on."""
    assert run.sidecar.process is not None
    pid = run.sidecar.process.pid
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    weights = folder / "adapter_model.safetensors"
    sparse_safetensors(weights, 4 << 30)
    run.report(folder)
    wait_for(lambda: _open_by(pid, weights), 20, what="the watcher to open the file")
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

    finding = wait_for(pickle_finding, 20, what="pickle_checkpoint to fire")
    assert finding.firing and "adapter_model.bin" in str(dict(finding.evidence))
    assert not marker.exists()  # deadweight never unpickles anything
    run.still_works()
