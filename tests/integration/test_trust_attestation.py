"""Attestation under attack, with a real ``deadweight serve`` and real processes: a flood of
connections on the ``.attest`` socket, the socket file deleted, a peer that exits before it is
identified.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deadweight.demo.sidecar_process import SidecarProcess
from deadweight.proto.transport import attest_path
from deadweight.sidecar.ingest.attestation import _peer_pidfd, peer_identity
from deadweight.sidecar.store.journal import Store
from tests.support.realprocs import wait_for
from tests.support.trust_client import attest_as, flood_command

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

#: A training process in miniature: fetch a nonce, register rank 0 with it, stay alive.
REGISTER = textwrap.dedent("""
    import sys, queue, grpc
    from deadweight.callbacks.stream_client import fetch_attestation, grpc_target
    from deadweight.proto import monitor_stub, pb
    socket_path, run_id = sys.argv[1], sys.argv[2]
    print("attesting", flush=True)
    nonce = fetch_attestation(socket_path) or ""
    channel = grpc.insecure_channel(grpc_target("unix://" + socket_path))
    requests = queue.Queue()
    responses = monitor_stub(channel).Stream(iter(requests.get, None))
    requests.put(pb.StreamRequest(run_id=run_id, events=[pb.Event(
        run_start=pb.RunStart(trainer="SFTTrainer", attestation=nonce))]))
    answer = next(responses)
    print("nonce" if nonce else "no-nonce", answer.error or "ok", flush=True)
    sys.stdin.read()
""")

@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[SidecarProcess, Path]]:
    state = tmp_path / "state"
    with SidecarProcess(tmp_path / "sidecar", extra_args=["--state-dir", str(state)]) as p:
        yield p, state


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _end(children: list[subprocess.Popen[str]]) -> None:
    for child in children:
        if child.stdin is not None and not child.stdin.closed:
            child.stdin.close()
        child.wait(30)


def test_a_flood_on_the_attest_socket_does_not_leave_real_processes_unattested(
    sidecar: tuple[SidecarProcess, Path],
) -> None:
    process, state = sidecar
    # An attacker of the same uid: connections without end, never read, many held open.
    flood = subprocess.Popen(flood_command(str(attest_path(process.socket_path)), False),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
    trainers = [_spawn(REGISTER, str(process.socket_path), f"flooded-{i}") for i in range(5)]
    try:
        for child in trainers:  # every trainer asks for its nonce while the flood runs ...
            assert child.stdout is not None and child.stdout.readline().strip() == "attesting"
        _end([flood])  # ... and the flood ends some time later: the trainers' retries win
        answers = []
        for child in trainers:
            assert child.stdout is not None
            answers.append(child.stdout.readline().strip())
        assert answers == ["nonce ok"] * 5, answers
        store = Store(state)
        for i, child in enumerate(trainers):  # every rank bound to its real process
            bindings = store.bindings(f"flooded-{i}")
            assert bindings[0].pid == child.pid, bindings
        store.close()
    finally:
        _end(trainers)
        if flood.poll() is None:
            _end([flood])


def test_a_deleted_attest_socket_is_created_again(sidecar: tuple[SidecarProcess, Path]) -> None:
    process, state = sidecar
    path = attest_path(process.socket_path)
    path.unlink()
    wait_for(path.exists, what="the .attest socket to be listened on again")
    trainer = _spawn(REGISTER, str(process.socket_path), "after-delete")
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "attesting"
        assert trainer.stdout.readline().strip() == "nonce ok"
        store = Store(state)
        assert store.bindings("after-delete")[0].pid == trainer.pid
        store.close()
        assert "attestation_socket_missing" in process.log_path.read_text()
    finally:
        _end([trainer])


def test_a_peer_that_exited_before_it_was_identified_gets_no_identity(tmp_path: Path) -> None:
    path = tmp_path / "s.attest"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(4)
        alive = subprocess.Popen([sys.executable, "-c",
                                  "import socket,sys; s=socket.socket(socket.AF_UNIX); "
                                  f"s.connect({str(path)!r}); sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
        conn, _ = server.accept()
        with conn:
            pidfd = _peer_pidfd(conn)
            assert pidfd is not None  # this kernel (6.5+) hands out a pidfd of the peer
            os.close(pidfd)
            identity = peer_identity(conn)
            assert identity is not None and identity.pid == alive.pid
        assert alive.stdin is not None
        alive.stdin.close()
        alive.wait(30)
        gone = subprocess.Popen([sys.executable, "-c",
                                 "import socket; s=socket.socket(socket.AF_UNIX); "
                                 f"s.connect({str(path)!r}); import os; os._exit(0)"])
        gone.wait(30)  # exited and reaped: its pid is free for anyone
        conn, _ = server.accept()
        with conn:
            assert peer_identity(conn) is None


def _readline(child: subprocess.Popen[str], timeout: float) -> str:
    """The child's next output line, waited for at most timeout (a hang fails, never blocks)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(child.stdout.readline()  # type: ignore[union-attr]
                                                          .strip()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert lines, f"no line from pid {child.pid} within {timeout}s"
    return lines[0]


def test_a_trainer_registers_while_another_uid_floods_the_attest_socket() -> None:
    """5: processes of another uid (in the socket's group) flood ``.attest`` without end;
    the sidecar's trainer uids are known (the default: its own and root), so their
    connections are closed before any work, and a real trainer gets its nonce and registers
    attested while the flood still runs."""
    from bench.attest_flood import OTHER_UID, start_flooders, stop_flooders

    folder = Path(tempfile.mkdtemp(prefix="deadweight-flood-", dir="/tmp"))
    os.chmod(folder, 0o755)  # the flooding uid reaches the socket through its group
    state = folder / "state"
    with SidecarProcess(folder / "sidecar", extra_args=["--state-dir", str(state)]) as process:
        flooders = start_flooders(process.socket_path, 4)
        trainer = _spawn(REGISTER, str(process.socket_path), "flooded-by-uid")
        try:
            assert _readline(trainer, 60) == "attesting"
            assert _readline(trainer, 60) == "nonce ok"
            assert all(f.poll() is None for f in flooders)  # registered during the flood
            # A connection of the flooding uid is closed with no answer at all.
            probe = attest_as(OTHER_UID, attest_path(process.socket_path))
            assert probe.stdout.strip() == "b''", probe
        finally:
            stop_flooders(flooders)
            _end([trainer])
        store = Store(state)
        assert store.bindings("flooded-by-uid")[0].pid == trainer.pid
        store.close()
