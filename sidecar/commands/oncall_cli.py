"""``deadweight stop`` and ``deadweight silence``: on-call's commands against a live sidecar.

Both talk to the sidecar's unix socket only, after fetching a one-time nonce from its
attestation socket, so the sidecar learns the caller's uid from the kernel and allows only its
own uid or root (``sidecar/ingest/oncall.py``). ``add`` registers them on the CLI's parser.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_ADDRESS = "unix:///run/deadweight/deadweight.sock"
DEFAULT_SILENCE = "1h"


def _duration(text: str) -> float:
    from ..actions.silences import BadDuration, parse_duration

    try:
        return parse_duration(text)
    except BadDuration as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _socket_of(address: str) -> str | None:
    from ...proto.transport import grpc_target, unix_socket_path

    return unix_socket_path(grpc_target(address))


def _nonce(socket_path: str, timeout: float = 5.0) -> str:
    """A one-time nonce from the sidecar's attestation socket ('' when it gives none: the
    sidecar then refuses the call and says why). The sidecar reads this process's uid from
    the kernel when it connects."""
    import socket

    from ...proto.transport import attest_path

    data = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(attest_path(socket_path)))
            while not data.endswith(b"\n") and len(data) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return ""
    status, _, nonce = data.decode(errors="replace").strip().partition(" ")
    return nonce if status == "OK" else ""


def _call(args: argparse.Namespace, method: str, request: object) -> object | None:
    """The sidecar's answer to one attested call; None (after printing why) when refused."""
    import grpc

    from ...proto import monitor_stub
    from ...proto.transport import grpc_target, open_channel

    command = args.command
    socket_path = _socket_of(args.address)
    if socket_path is None:
        print(f"deadweight {command}: {args.address} is not a unix socket; stop and silence "
              "are allowed over the sidecar's unix socket only", file=sys.stderr)
        return None
    request.attestation = _nonce(socket_path)  # type: ignore[attr-defined]
    with open_channel(grpc_target(args.address)) as channel:
        try:
            answer: object = getattr(monitor_stub(channel), method)(request,
                                                                    timeout=args.timeout)
            return answer
        except grpc.RpcError as err:
            print(f"deadweight {command}: {err.code().name}: {err.details()}", file=sys.stderr)
            return None


def _stop(args: argparse.Namespace) -> int:
    from ...proto import pb

    answer = _call(args, "Stop", pb.StopRequest(run_id=args.run_id, reason=args.reason or ""))
    if answer is None:
        return 2
    assert isinstance(answer, pb.StopResponse)
    print(f"deadweight stop: {answer.message}")
    return 0


def _silence(args: argparse.Namespace) -> int:
    from ...proto import pb

    answer = _call(args, "Silence", pb.SilenceRequest(
        run_id=args.run_id, detector=args.detector, seconds=args.duration,
        reason=args.reason or ""))
    if answer is None:
        return 2
    assert isinstance(answer, pb.SilenceResponse)
    print(f"deadweight silence: {answer.message}")
    return 0


def add(commands: Commands) -> None:
    """Register ``stop`` and ``silence`` on the CLI's sub-commands."""
    stop = commands.add_parser(
        "stop", help="send STOP to one run now (journaled; operators only: root, serve "
        "--operator-uid)")
    stop.add_argument("run_id", metavar="RUN_ID")
    stop.add_argument("--reason", default=None, help="why, shown on the trainer's console "
                      "and kept in the journal")
    stop.set_defaults(func=_stop)

    silence = commands.add_parser(
        "silence", help="keep one detector of one run from paging for a while (journaled; "
        "operators only: root, serve --operator-uid)")
    silence.add_argument("run_id", metavar="RUN_ID")
    silence.add_argument("detector", metavar="DETECTOR")
    silence.add_argument("--for", dest="duration", type=_duration, default=_duration(
        DEFAULT_SILENCE), metavar="DURATION", help="30s, 15m, 2h, 1d (default "
        f"{DEFAULT_SILENCE}); it pages then if it still fires")
    silence.add_argument("--reason", default=None, help="kept in the journal and shown by "
                         "deadweight status")
    silence.set_defaults(func=_silence)
    for parser in (stop, silence):
        parser.add_argument("--address", default=DEFAULT_ADDRESS,
                            help="the sidecar's unix socket (default %(default)s)")
        parser.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
