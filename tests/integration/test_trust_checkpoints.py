"""Checkpoint paths under attack, against a real ``deadweight serve``: FIFOs, huge headers,
paths outside the allowed roots, thousands of folders, hostile headers for ``deadweight inspect``.

Each test performs the attack for real (real FIFOs swapped in with ``rename``, a real 78 MB
header, a real second process) and then shows what held: the refusal in the sidecar's log,
the watcher still inspecting a good checkpoint afterwards, the daemon's thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto import pb
from deadweight.sidecar.checkpoints.inspector import (
    MAX_TENSORS,
    CheckpointRefused,
    inspect_file,
)
from tests.support.checkpoint_files import Watched, adapter, header_file, many_tensors
from tests.support.faults import Pipe
from tests.support.realprocs import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory,
            root: Path) -> Iterator[tuple[SidecarProcess, Pipe]]:
    with SidecarProcess(tmp_path_factory.mktemp("trust-watcher"), watch_roots=[root],
                        extra_args=["--max-runs-per-process", "1000",
                                    "--max-runs-per-uid", "1000"]) as process:
        pipe = Pipe(process.address)
        yield process, pipe
        pipe.close()


@pytest.fixture
def run(sidecar: tuple[SidecarProcess, Pipe], root: Path,
        request: pytest.FixtureRequest) -> Watched:
    process, pipe = sidecar
    name = f"trust-{request.node.name}"[:100]
    return Watched(process, pipe, name, root / name / "out")


def _threads(process: SidecarProcess) -> int:
    assert process.process is not None
    status = Path(f"/proc/{process.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("Threads:")))


# -- item 4: FIFOs ---------------------------------------------------------------------------


def test_a_fifo_is_refused_at_open_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "adapter_model.safetensors"
    os.mkfifo(fifo)  # a blocking open() would wait here for a writer that never comes
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: _capture(outcome, fifo), daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "opening a FIFO blocked the reader"
    assert isinstance(outcome[0], CheckpointRefused) and "not a regular file" in str(outcome[0])


def _capture(outcome: list[BaseException], path: Path) -> None:
    try:
        inspect_file(path)
    except BaseException as err:
        outcome.append(err)


def test_a_weights_file_swapped_with_a_fifo_never_blocks_the_watcher(run: Watched) -> None:
    data = (adapter(run.out.parent / "model") / "adapter_model.safetensors").read_bytes()
    newest: list[Path] = []
    stop = threading.Event()

    def swap() -> None:  # atomic renames: the newest weights file is a file, a FIFO, a file ...
        spare_file, spare_fifo = run.out / "f2", run.out / "p2"
        while not stop.is_set():
            if not newest:
                continue
            target = newest[-1] / "adapter_model.safetensors"
            spare_file.write_bytes(data)
            os.rename(spare_file, target)
            os.mkfifo(spare_fifo)
            os.rename(spare_fifo, target)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    try:
        for step in range(1, 25):  # each report makes the sidecar open a swapping path
            folder = run.out / f"checkpoint-{step}"
            folder.mkdir()
            newest.append(folder)
            run.report(folder)
            run.wait_line(folder, "checkpoint_inspected", "checkpoint_not_inspected",
                          "checkpoint_refused")
    finally:
        stop.set()
        swapper.join(10)
    run.still_works()


# -- item 4: header caps -----------------------------------------------------------------------


def test_a_78_mb_header_is_refused_before_parsing_within_a_small_memory(
    run: Watched, tmp_path: Path
) -> None:
    big = many_tensors(tmp_path / "big.safetensors", 1_300_000)
    assert big.stat().st_size > 75_000_000
    peak = tmp_path / "peak_kb"
    result = subprocess.run(  # GNU time reports the peak RSS of the command after its exec
        ["/usr/bin/time", "-f", "%M", "-o", str(peak), sys.executable, "-m",
         "deadweight.sidecar.commands.cli", "inspect", str(big)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "over the cap" in result.stderr and "Traceback" not in result.stderr
    # The whole command, interpreter included, stayed far below the 1 GB the parse cost.
    assert int(peak.read_text().split()[-1]) < 300 * 1024
    folder = run.out / "checkpoint-1"
    folder.mkdir()
    os.replace(big, folder / "adapter_model.safetensors")
    run.report(folder)
    line = run.wait_line(folder, "checkpoint_refused")
    assert "over the cap" in line["reason"], line
    run.still_works()


def test_too_many_tensors_are_refused_with_a_finding(run: Watched) -> None:
    folder = run.out / "checkpoint-1"
    many_tensors(folder / "adapter_model.safetensors", MAX_TENSORS + 1)
    run.report(folder)
    line = run.wait_line(folder, "checkpoint_refused")
    assert f"more than {MAX_TENSORS} tensors" in line["reason"], line
    run.still_works()


# -- item 4: allowed roots -----------------------------------------------------------------------


def test_paths_outside_the_watch_roots_are_refused(
    sidecar: tuple[SidecarProcess, Pipe], root: Path, tmp_path: Path
) -> None:
    process, pipe = sidecar
    outside = tmp_path / "secret"
    adapter(outside / "checkpoint-1")
    escape = root / "escape"
    escape.symlink_to(outside, target_is_directory=True)  # inside by name, outside for real
    for run_id, folder in (("outside", outside), ("escape", escape), ("usr", Path("/usr"))):
        watched = Watched(process, pipe, f"trust-{run_id}", root / f"trust-{run_id}")
        assert not pipe.send(pb.StreamRequest(run_id=watched.run_id, events=[pb.Event(
            run_start=pb.RunStart(trainer="SFTTrainer", output_dir=str(folder)))])).error
        watched.report(folder / "checkpoint-1")
        line = watched.wait_line(folder, "checkpoint_refused")
        assert "outside the allowed roots" in line["reason"], line
        assert not [x for x in watched.lines(folder) if x["event"] == "checkpoint_inspected"]
    refused = next(float(x.split()[-1]) for x in process.metrics().splitlines()
                   if x.startswith("deadweight_checkpoint_refused_total "))
    assert refused >= 3


def test_without_a_watch_root_the_runs_own_checkpoints_are_read(tmp_path: Path) -> None:
    """The quiet safe default: no --watch-root, a folder of the run's own uid is read."""
    out = tmp_path / "out"
    with SidecarProcess(tmp_path / "sidecar", watch_roots=[]) as process:
        pipe = Pipe(process.address)
        try:
            watched = Watched(process, pipe, "no-roots-own", out)
            folder = adapter(out / "checkpoint-1")
            watched.report(folder)
            watched.wait_line(folder, "checkpoint_inspected")
            assert not [x for x in watched.lines(out) if x["event"] == "checkpoint_refused"]
            status = process.run_status("no-roots-own")
            assert status is not None
            assert "checkpoint_refused" not in {f.detector for f in status.findings}
        finally:
            pipe.close()


OTHER_UID = 23101


def _as_other_uid(*command: str) -> None:
    """Run command as a real second uid (no supplementary groups), the way another user would."""
    subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                    "--clear-groups", *command], check=True, timeout=60)


def test_without_a_watch_root_another_uids_checkpoint_is_not_read() -> None:
    """A folder, or a file in the run's folder, written by another uid is refused: observed,
    not paged (the run names its own paths; a page would be on-call's noise at its will)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="deadweight-uid-"))
    try:
        base.chmod(0o755)  # the other uid may enter (pytest's own temp folder is 0700)
        source = adapter(base / "source")
        for entry in [source, *source.iterdir()]:
            entry.chmod(0o755 if entry.is_dir() else 0o644)
        out = base / "out"
        with SidecarProcess(base / "sidecar", watch_roots=[]) as process:
            pipe = Pipe(process.address)
            try:
                watched = Watched(process, pipe, "no-roots-foreign", out)
                out.chmod(0o777)  # the run's (root's) folder, writable by the other uid
                foreign = out / "checkpoint-1"
                _as_other_uid("cp", "-r", str(source), str(foreign))
                assert foreign.stat().st_uid == OTHER_UID
                watched.report(foreign)
                line = watched.wait_line(foreign, "checkpoint_refused")
                assert f"owned by uid {OTHER_UID}, not by the run's uid 0" in line["reason"]

                mixed = out / "checkpoint-2"  # the run's folder, another uid's weights file
                mixed.mkdir()
                mixed.chmod(0o777)
                _as_other_uid("cp", str(source / "adapter_model.safetensors"), str(mixed))
                watched.report(mixed)
                line = watched.wait_line(mixed, "checkpoint_refused")
                assert "adapter_model.safetensors in it is owned by uid" in line["reason"]
                assert not [x for x in watched.lines(out) if x["event"] == "checkpoint_inspected"]

                watched.still_works()  # the run's own checkpoint after both: read
                status = process.run_status("no-roots-foreign")
                assert status is not None
                refused = next(f for f in status.findings if f.detector == "checkpoint_refused")
                assert refused.policy == "observe"
                assert not [a for a in status.actions if a.detector == "checkpoint_refused"]
            finally:
                pipe.close()
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False, timeout=60)


def test_thousands_of_output_folders_cost_a_bounded_number_of_threads(
    sidecar: tuple[SidecarProcess, Pipe], root: Path
) -> None:
    process, pipe = sidecar
    before = _threads(process)
    base = root / "many"
    for i in range(300):  # 300 runs with a real folder each, then one run naming 300 more
        (base / f"run-{i}").mkdir(parents=True)
        assert not pipe.send(pb.StreamRequest(run_id=f"many-{i}", events=[pb.Event(
            run_start=pb.RunStart(trainer="SFTTrainer", output_dir=str(base / f"run-{i}")))])
        ).error
    for i in range(300):
        assert not pipe.send(pb.StreamRequest(run_id="many-one", events=[pb.Event(
            seq=i + 1,
            run_start=pb.RunStart(trainer="SFTTrainer", output_dir=str(base / f"run-{i}")))])
        ).error
    refused = wait_for(lambda: process.log_path.read_text().count('"run_id": "many-one"'),
                   what="the extra folders of one run refused")
    assert refused
    text = process.log_path.read_text()
    assert "output folders (cap 4)" in text
    # Kernel watches (one thread each) are capped at 64, whatever the number of folders.
    assert _threads(process) - before <= 64 + 2


# -- low: hostile headers for ``deadweight inspect`` -------------------------------------------


@pytest.mark.parametrize(("header", "reason"), [
    (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":["0","4"]}}', "data_offsets"),
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":null}}', "data_offsets"),
    (b'{"a":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}}', "shape"),
    (b'{"a":{"dtype":"F32","shape":null,"data_offsets":[0,4]}}', "shape"),
    (b'{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}', "shape"),
    (b'{"a":{"dtype":"F32","shape":[1' + b"0" * 400 + b'],"data_offsets":[0,4]}}', "shape"),
    (b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', "shape"),
    (b'{"a":{"dtype":null,"shape":[1],"data_offsets":[0,4]}}', "dtype"),
])
def test_inspect_exits_2_with_a_clear_message_on_hostile_headers(
    tmp_path: Path, header: bytes, reason: str
) -> None:
    path = header_file(tmp_path / "adapter_model.safetensors", header)
    result = subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", "inspect", str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and reason in result.stderr, result.stderr
    assert result.stderr.startswith("deadweight inspect:")
    assert len(result.stderr) < 2000  # the message names the problem, not the whole header


def test_json_header_fixture_is_valid_when_not_hostile(tmp_path: Path) -> None:
    """Control: the same hand-built header with sound values is inspected."""
    header = json.dumps({"a.lora_A.weight": {"dtype": "F32", "shape": [1],
                                             "data_offsets": [0, 4]}}).encode()
    path = header_file(tmp_path / "adapter_model.safetensors", header)
    assert inspect_file(path).tensor_bytes == 4
