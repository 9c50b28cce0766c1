"""TCP only with TLS and a bearer token: refused without them, and a wrong token is rejected.

Real ``deadweight serve`` processes, a self-signed certificate made with the ``openssl`` CLI
(a required program, checked by conftest), real gRPC channels (TLS and plaintext) and the
real stream client.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deadweight.callbacks.stream_client import StreamClient
from deadweight.demo.sidecar_process import SidecarProcess, free_port
from deadweight.proto import monitor_stub, pb
from deadweight.proto.transport import AUTHORIZATION_KEY, bearer_metadata
from deadweight.sidecar.store.journal import Store
from tests.support.realprocs import wait_for
from tests.support.tls import self_signed

TOKEN = "s3cret-token-for-tests"


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadweight.sidecar.commands.cli", "serve", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key): self-signed for localhost and 127.0.0.1."""
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("given", ["nothing", "tls_only", "token_only"])
def test_tcp_without_tls_and_token_refuses_to_start(
    given: str, cert: tuple[Path, Path], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    args = ["--socket", str(tmp_path / "s.sock"), "--listen", f"127.0.0.1:{free_port()}",
            "--metrics-address", f"127.0.0.1:{free_port()}"]
    if given == "tls_only":
        args += ["--tls-cert", str(cert[0]), "--tls-key", str(cert[1])]
    if given == "token_only":
        args += ["--token-file", str(token_file)]
    result = _serve(*args)
    assert result.returncode == 2, result.stderr
    assert "refusing to listen on TCP" in result.stderr
    missing = {"nothing": "--tls-cert, --tls-key, --token-file", "tls_only": "--token-file",
               "token_only": "--tls-cert, --tls-key"}[given]
    assert f"without {missing}" in result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_insecure_tcp_starts_and_says_it_cannot_kill(tmp_path: Path) -> None:
    port = free_port()
    with SidecarProcess(tmp_path, extra_args=["--listen", f"127.0.0.1:{port}",
                                              "--insecure"]) as sidecar:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert monitor_stub(channel).Status(pb.StatusRequest(), timeout=10) is not None
        log = sidecar.log_path.read_text()
    assert "tcp_insecure" in log and "tcp_cannot_kill" in log


@pytest.fixture(scope="module")
def tls_sidecar(
    cert: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SidecarProcess, int, Path]]:
    folder = tmp_path_factory.mktemp("tls-sidecar")
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    args = ["--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert[0]), "--tls-key",
            str(cert[1]), "--token-file", str(token_file), "--state-dir", str(folder / "state")]
    with SidecarProcess(folder / "sidecar", extra_args=args) as sidecar:
        yield sidecar, port, folder / "state"


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The token as the client sends it; an empty one as a bare ``Bearer `` (hostile caller)."""
    if token == "":
        return ((AUTHORIZATION_KEY, "Bearer "),)
    return bearer_metadata(token)


def _status(channel: grpc.Channel, token: str | None) -> pb.StatusResponse:
    metadata = _metadata(token)
    response: pb.StatusResponse = monitor_stub(channel).Status(
        pb.StatusRequest(), timeout=10, metadata=metadata)
    return response


def _tls_channel(cert: Path, port: int) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN + "x", TOKEN[:-1]])
def test_a_wrong_or_missing_token_is_rejected(
    token: str | None, tls_sidecar: tuple[SidecarProcess, int, Path], cert: tuple[Path, Path]
) -> None:
    _, port, _ = tls_sidecar
    with _tls_channel(cert[0], port) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _status(channel, token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = _metadata(token)
        batches = iter([pb.StreamRequest(run_id="intruder", rank=0)])
        with pytest.raises(grpc.RpcError) as err:
            list(monitor_stub(channel).Stream(batches, timeout=10, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_right_token_over_tls_reports_a_run_that_can_never_be_signalled(
    tls_sidecar: tuple[SidecarProcess, int, Path], cert: tuple[Path, Path]
) -> None:
    sidecar, port, state = tls_sidecar
    with _tls_channel(cert[0], port) as channel:
        assert _status(channel, TOKEN) is not None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:  # no TLS: no handshake
        with pytest.raises(grpc.RpcError) as err:
            _status(plain, TOKEN)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    client = StreamClient(f"127.0.0.1:{port}", "over-tcp", 0,
                          lambda kind, record: pb.Event(run_start=record),
                          token=TOKEN, tls_ca=str(cert[0]))
    client.start(pb.RunStart(trainer="SFTTrainer", attestation="1"))
    try:
        assert client.wait_registered(30)
        run = wait_for(lambda: sidecar.run_status("over-tcp"), 10, what="the run")
        assert run.trainer == "SFTTrainer"
    finally:
        client.close()
    assert sidecar.status().runs  # the unix socket needs no token: its mode guards it
    assert Store(state).bindings("over-tcp") == {}  # no kernel identity over TCP


def test_status_command_reaches_a_tls_sidecar_with_ca_and_token(
    tls_sidecar: tuple[SidecarProcess, int, Path], cert: tuple[Path, Path], tmp_path: Path
) -> None:
    import re
    import subprocess
    import sys

    from tests.support.faults import Pipe

    sidecar, port, _ = tls_sidecar
    command = [sys.executable, "-m", "deadweight.sidecar.commands.cli", "status",
               "--address", f"127.0.0.1:{port}", "--tls-ca", str(cert[0])]
    pipe = Pipe(sidecar.address)  # a run on the unix socket, listed over TLS
    try:
        start = pb.Event(run_start=pb.RunStart(trainer="DPOTrainer"))
        assert not pipe.send(pb.StreamRequest(run_id="tls-status", events=[start])).error
        good = subprocess.run([*command, "--token", TOKEN], capture_output=True, text=True,
                              timeout=60)
    finally:
        pipe.close()
    assert good.returncode == 0, good.stderr
    listed = [line for line in good.stdout.splitlines() if not line.startswith("WARNING: ")]
    assert listed[0].split() == ["RUN", "TRAINER", "RANKS", "STEP", "SEEN", "STATE"]
    assert re.search(r"^tls-status +DPOTrainer +1 +0 +\d+s  running; FIRING empty_optimizer$",
                     good.stdout, re.MULTILINE), good.stdout
    wrong = subprocess.run([*command, "--token", "wrong"], capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 2 and "UNAUTHENTICATED" in wrong.stderr


def test_a_tcp_token_holder_that_pre_registers_a_run_id_never_steers_the_attested_job(
    tls_sidecar: tuple[SidecarProcess, int, Path], cert: tuple[Path, Path]
) -> None:
    """The TCP token holder registers the attested job's run id first and pushes rank 0's
    sequence numbers to 2^62. The attested unix job then starts a new incarnation: none of
    the holder's numbers survive (every real event counts, its frozen steps fire), the run
    says ``run_id_in_use``, and the holder can neither write to it nor take it back."""
    from tests.support.faults import Pipe
    from tests.support.raw_client import frozen_events, run_start

    sidecar, port, state = tls_sidecar
    run_id = "tcp-squatted"
    metadata = bearer_metadata(TOKEN)
    with _tls_channel(cert[0], port) as channel:
        import queue

        sent: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        answers = monitor_stub(channel).Stream(iter(sent.get, None), metadata=metadata)

        def tcp(*events: pb.Event) -> pb.StreamResponse:
            sent.put(pb.StreamRequest(run_id=run_id, events=list(events)))
            response: pb.StreamResponse = next(answers)
            return response

        assert not tcp(pb.Event(seq=0, run_start=run_start())).error
        assert tcp(*frozen_events(1, 2**62)).ack_seq == 2**62 + 1
        job = Pipe(sidecar.address)  # this process, attested over the unix socket
        try:
            assert not job.send(pb.StreamRequest(run_id=run_id, events=[
                pb.Event(seq=0, run_start=run_start())])).error
            for step in range(1, 6):
                answer = job.send(pb.StreamRequest(run_id=run_id,
                                                   events=frozen_events(step, 2 * step - 1)))
                assert not answer.error and answer.ack_seq == 2 * step  # nothing dropped
            status = sidecar.run_status(run_id)
            assert status is not None and status.step == 5
            firing = {f.detector: f for f in status.findings if f.firing}
            assert "frozen_weights" in firing
            assert "unattested" in firing["run_id_in_use"].evidence["newcomer"]
            # The holder's stream belongs to the closed incarnation; a new RunStart is refused.
            assert "incarnation" in tcp(*frozen_events(2, 2**62 + 2)).error
        finally:
            job.close()
    with _tls_channel(cert[0], port) as channel:
        again = monitor_stub(channel).Stream(iter([pb.StreamRequest(
            run_id=run_id, events=[pb.Event(seq=0, run_start=run_start())])]),
            metadata=metadata, timeout=10)
        assert "attested processes only" in next(again).error  # then the stream is ended
    store = Store(state)
    assert {i.pid for i in store.bindings(run_id).values()} == {os.getpid()}
    store.close()
