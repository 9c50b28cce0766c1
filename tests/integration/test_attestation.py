"""Kernel-verified peer identity: nonces name the connecting process, never a claimed pid.

Real unix sockets, real child processes; the registry is driven directly where a test needs
a specific identity, and through a real gRPC server where the transport's answer matters.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deadweight.callbacks.stream_client import fetch_attestation
from deadweight.proto import monitor_stub, pb
from deadweight.proto.transport import attest_path, unix_socket_path
from deadweight.sidecar.ingest.attestation import AttestationServer
from deadweight.sidecar.ingest.server import ServerConfig
from deadweight.sidecar.model.nonces import Attestor
from deadweight.sidecar.model.process import ProcessIdentity, boot_id, is_alive, start_time
from deadweight.sidecar.registry import Peer, Registry
from deadweight.sidecar.serve import Sidecar
from tests.support.raw_client import frozen_events, run_start

UNIX = "unix:"


@pytest.fixture()
def attest(tmp_path: Path) -> Iterator[tuple[Path, Attestor]]:
    """A live attestation socket next to a (not yet existing) gRPC socket path."""
    socket_path = tmp_path / "deadweight.sock"
    attestor = Attestor()
    server = AttestationServer(attest_path(socket_path), attestor)
    server.start()
    yield socket_path, attestor
    server.stop()


def _child_nonce(socket_path: Path) -> tuple[subprocess.Popen[str], str]:
    """A child process that fetches a nonce, prints it and stays alive until stdin closes."""
    code = (
        "import sys; from deadweight.callbacks.stream_client import fetch_attestation; "
        f"print(fetch_attestation({str(socket_path)!r}), flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def _end(child: subprocess.Popen[str]) -> None:
    if child.stdin is not None:
        child.stdin.close()
    child.wait(30)


def test_start_time_survives_odd_command_names(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"
    odd.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(odd), "60"])
    try:
        text = Path(f"/proc/{child.pid}/stat").read_text()
        assert "(a) b (c)" in text
        expected = int(text[text.rfind(")") + 2:].split()[19])
        assert start_time(child.pid) == expected
        identity = ProcessIdentity(child.pid, os.getuid(), os.getgid(), expected, boot_id())
        assert is_alive(identity)
        assert not is_alive(ProcessIdentity(child.pid, 0, 0, expected + 1, boot_id()))
        assert not is_alive(ProcessIdentity(child.pid, 0, 0, expected, "another-boot"))
    finally:
        child.kill()
        child.wait()
    assert not is_alive(identity)  # reaped: the pid runs nothing


def test_nonce_names_the_connecting_process_once(attest: tuple[Path, Attestor]) -> None:
    socket_path, attestor = attest
    assert stat.S_IMODE(attest_path(socket_path).stat().st_mode) == 0o660
    child, nonce = _child_nonce(socket_path)
    try:
        assert nonce and nonce != "None"
        identity = attestor.redeem(nonce)
        assert identity is not None
        assert identity.pid == child.pid != os.getpid()
        assert identity.uid == os.getuid()
        assert identity.start_time == start_time(child.pid)
        assert attestor.redeem(nonce) is None  # one time only
        assert attestor.redeem(str(child.pid)) is None  # a pid is not a nonce
        assert attestor.redeem("") is None
    finally:
        _end(child)


def test_nonce_of_an_exited_process_is_worthless(attest: tuple[Path, Attestor]) -> None:
    socket_path, attestor = attest
    child, nonce = _child_nonce(socket_path)
    _end(child)
    assert attestor.redeem(nonce) is None


def test_stale_nonce_is_refused(tmp_path: Path) -> None:
    socket_path = tmp_path / "s.sock"
    attestor = Attestor(ttl_seconds=0.0)
    server = AttestationServer(attest_path(socket_path), attestor)
    server.start()
    try:
        nonce = fetch_attestation(str(socket_path))
        assert nonce is not None
        assert attestor.redeem(nonce) is None
    finally:
        server.stop()


def test_no_attestation_socket_means_no_nonce(tmp_path: Path) -> None:
    assert fetch_attestation(str(tmp_path / "absent.sock"), timeout=0.2) is None
    assert unix_socket_path("unix:///run/x.sock") == "/run/x.sock"
    assert unix_socket_path("unix:/run/x.sock") == "/run/x.sock"
    assert unix_socket_path("127.0.0.1:5000") is None


def _start(registry: Registry, run_id: str, rank: int, peer: Peer,
           attestation: str = "") -> pb.StreamResponse:
    start = run_start(attestation=attestation)
    return registry.ingest(pb.StreamRequest(run_id=run_id, rank=rank, events=[
        pb.Event(seq=0, run_start=start)]), peer)


def test_registry_binds_ranks_to_the_attested_process_only(
    attest: tuple[Path, Attestor],
) -> None:
    socket_path, attestor = attest
    registry = Registry(attestor=attestor)
    owner, nonce = _child_nonce(socket_path)
    other, other_nonce = _child_nonce(socket_path)
    try:
        owner_peer = Peer(address=UNIX)
        assert not _start(registry, "r", 0, owner_peer, nonce).error
        bound = registry.identities("r")[0]
        assert bound.pid == owner.pid
        assert registry.store.bindings("r") == {0: bound}
        # The owner's stream keeps reporting.
        ok = registry.ingest(pb.StreamRequest(run_id="r", rank=0, events=frozen_events(1, 1)),
                             owner_peer)
        assert not ok.error and ok.ack_seq == 2

        # A stream that did not attest cannot report for the bound rank ...
        stranger = Peer(address=UNIX)
        refused = registry.ingest(pb.StreamRequest(run_id="r", rank=0,
                                                   events=frozen_events(2, 3)), stranger)
        assert "requires attestation" in refused.error and stranger.rejected
        # ... nor can an unattested stream add a rank to an attested run ...
        joiner = Peer(address=UNIX)
        assert "requires attestation" in _start(registry, "r", 1, joiner).error
        assert registry.identities("r") == {0: bound}
        # ... and a different live process attesting for the bound rank is refused (two
        # jobs, one run id): the owner keeps its rank and its stream, the run is flagged.
        impostor = Peer(address=UNIX)
        refused = _start(registry, "r", 0, impostor, other_nonce)
        assert "in use by another live process" in refused.error
        assert f"pid {owner.pid}" in refused.error
        assert registry.identities("r") == {0: bound}
        assert registry.findings("r")["run_id_in_use"].firing
        kept = registry.ingest(pb.StreamRequest(run_id="r", rank=0,
                                                events=frozen_events(3, 4)), owner_peer)
        assert not kept.error and "run_id_in_use" in kept.firing
        # Once the owner is gone, the newcomer's RunStart starts a new incarnation.
        _end(owner)
        successor = Peer(address=UNIX)
        other_started = start_time(other.pid)  # its first nonce was spent on the refusal
        assert other_started is not None
        renewed = attestor.issue(ProcessIdentity(other.pid, bound.uid, bound.gid,
                                                 other_started, boot_id()))
        again = _start(registry, "r", 0, successor, renewed)
        assert not again.error, again.error
        assert registry.identities("r")[0].pid == other.pid
        closed = registry.ingest(pb.StreamRequest(run_id="r", rank=0,
                                                  events=frozen_events(5, 6)), owner_peer)
        assert "incarnation" in closed.error and owner_peer.rejected

        # A nonce sent over TCP counts for nothing.
        owner2, nonce2 = _child_nonce(socket_path)
        try:
            tcp_peer = Peer(address="ipv4:127.0.0.1:5555")
            assert not _start(registry, "tcp-run", 0, tcp_peer, nonce2).error
            assert registry.identities("tcp-run") == {}
        finally:
            _end(owner2)
    finally:
        _end(owner)
        _end(other)


def test_a_new_rank_must_attest_as_the_same_uid(attest: tuple[Path, Attestor]) -> None:
    socket_path, attestor = attest
    assert os.getuid() == 0, "needs root to start a process under another uid (CI runs as root)"
    registry = Registry(attestor=attestor)
    owner, nonce = _child_nonce(socket_path)
    nobody = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    try:
        assert not _start(registry, "r", 0, Peer(address=UNIX), nonce).error
        started = start_time(nobody.pid)
        assert started is not None
        foreign = attestor.issue(ProcessIdentity(nobody.pid, 65534, 65534, started, boot_id()))
        assert "same uid" in _start(registry, "r", 1, Peer(address=UNIX), foreign).error
        assert 1 not in registry.identities("r")
    finally:
        _end(owner)
        nobody.kill()
        nobody.wait()


def test_server_ends_a_stream_that_reports_for_someone_elses_rank(
    tmp_path: Path,
) -> None:
    socket_path = tmp_path / "sock" / "deadweight.sock"
    registry = Registry(attestor=Attestor())
    server = Sidecar(registry, None, ServerConfig(socket_path=str(socket_path),
                                                        metrics_address=None))
    server.start()
    owner, nonce = _child_nonce(socket_path)
    try:
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o660
        assert not _start(registry, "victim", 0, Peer(address=UNIX), nonce).error
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            batches = iter([
                pb.StreamRequest(run_id="victim", rank=0, events=frozen_events(1, 1)),
                pb.StreamRequest(run_id="victim", rank=0, events=frozen_events(2, 3)),
            ])
            with pytest.raises(grpc.RpcError) as err:
                list(monitor_stub(channel).Stream(batches, timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        run = registry.run("victim")
        assert run is not None and run.step == 0  # nothing of the stranger's was applied
    finally:
        _end(owner)
        server.stop()
