"""Nobody can guess the TCP bearer token at speed, and on-call's commands never put it in argv.

A real ``deadweight serve`` on TLS with a token (``--auth-failure-burst 5``, a credit back
every 5 s): a host that
fires a thousand wrong tokens as fast as it can is cut off after five, logged (the peer,
never the token) and counted; its right token is refused too while it is cut off, and
accepted once its credit came back. ``deadweight status`` and ``deadweight runs`` read the
token from ``--token-file`` or ``DEADWEIGHT_TOKEN``; ``--token`` still works and warns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deadweight.demo.sidecar_process import SidecarProcess, free_port
from deadweight.proto import monitor_stub, pb
from deadweight.proto.transport import bearer_metadata
from tests.support.realprocs import wait_for
from tests.support.tls import self_signed

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token-for-auth-tests"
GUESSES = 1000
BURST = 5
#: Seconds until a cut-off host may try once more: longer than the flood takes to answer.
REFILL = 5.0


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    self_signed(folder)
    return folder


@pytest.fixture(scope="module")
def sidecar(cert: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[SidecarProcess, int]]:
    folder = tmp_path_factory.mktemp("auth")
    (folder / "token").write_text(TOKEN + "\n")
    port = free_port()
    args = ["--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert / "cert.pem"),
            "--tls-key", str(cert / "key.pem"), "--token-file", str(folder / "token"),
            "--auth-failure-burst", str(BURST), "--auth-failure-refill", str(REFILL)]
    with SidecarProcess(folder / "sc", extra_args=args) as process:
        yield process, port


def _command(cert: Path, port: int, *args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight.sidecar.commands.cli", *args, "--address",
         f"127.0.0.1:{port}", "--tls-ca", str(cert / "cert.pem")],
        capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if k != "DEADWEIGHT_TOKEN"},
             **(env or {})})


def test_status_and_runs_read_the_token_from_a_file_or_the_environment(
        sidecar: tuple[SidecarProcess, int], cert: Path, tmp_path: Path) -> None:
    _, port = sidecar
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    from_file = _command(cert, port, "status", "--token-file", str(token_file))
    assert from_file.returncode == 0, from_file.stderr
    assert "warning" not in from_file.stderr
    from_env = _command(cert, port, "runs", env={"DEADWEIGHT_TOKEN": TOKEN})
    assert from_env.returncode == 0, from_env.stderr
    assert "warning" not in from_env.stderr
    in_argv = _command(cert, port, "runs", "--token", TOKEN)
    assert in_argv.returncode == 0, in_argv.stderr
    assert "--token shows in the process list" in in_argv.stderr
    assert "--token-file" in in_argv.stderr
    absent = _command(cert, port, "status", "--token-file", str(tmp_path / "absent"))
    assert absent.returncode == 2 and "absent" in absent.stderr


def _status(channel: grpc.Channel, token: str) -> grpc.StatusCode:
    try:
        monitor_stub(channel).Status(pb.StatusRequest(), timeout=10,
                                     metadata=bearer_metadata(token))
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _failures(sidecar: SidecarProcess) -> dict[str, float]:
    out = {}
    for line in sidecar.metrics().splitlines():
        if line.startswith("deadweight_auth_failures_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_thousand_wrong_tokens_are_cut_off_logged_and_counted(
        sidecar: tuple[SidecarProcess, int], cert: Path) -> None:
    process, port = sidecar
    before = _failures(process)
    creds = grpc.ssl_channel_credentials(root_certificates=(cert / "cert.pem").read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        assert _status(channel, TOKEN) == grpc.StatusCode.OK  # the control: it works
        codes = Counter(_status(channel, f"guess-{i:04d}") for i in range(GUESSES))
        # Cut off after the burst (a credit may come back while they run: a few more are
        # compared, each one failed and counted).
        assert codes[grpc.StatusCode.UNAUTHENTICATED] >= BURST
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= GUESSES // 2, codes
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.RESOURCE_EXHAUSTED}
        after = _failures(process)
        assert after["wrong_token"] - before.get("wrong_token", 0) == codes[
            grpc.StatusCode.UNAUTHENTICATED]
        assert after["throttled"] - before.get("throttled", 0) == codes[
            grpc.StatusCode.RESOURCE_EXHAUSTED]
        # The host is cut off: even the right token waits for a credit, then goes through.
        assert _status(channel, TOKEN) == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_for(lambda: _status(channel, TOKEN) == grpc.StatusCode.OK, 30,
                 what="the right token accepted once a credit came back")
    log = process.log_path.read_text()
    assert "guess-" not in log and TOKEN not in log  # the peer, never the token
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    failed = [e for e in events if e.get("event") == "auth_failed"]
    throttled = [e for e in events if e.get("event") == "auth_throttled"]
    assert len(failed) == codes[grpc.StatusCode.UNAUTHENTICATED]  # one line per compared one
    assert throttled and all(e["peer"] == "127.0.0.1" for e in failed + throttled)
    # A flood writes about one line per compared token, never one per call.
    assert len(failed) + len(throttled) < GUESSES // 4
