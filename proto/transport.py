"""How both ends of the stream reach each other: targets, channel options, token, attestation path.

The callback (client) and the sidecar (server, ``deadweight status``) both import this module and
nothing from each other, so an address, a size limit or the token header is spelled once.
It needs only grpc: the sidecar image, free of the training stack, imports it too.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

import grpc

#: Largest message either side accepts; larger ones are refused with a clear error.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024

#: Message size limits, the same on the client's channel and the sidecar's server.
MESSAGE_SIZE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

#: The client resends unacknowledged events itself; grpc's own retries would duplicate them.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (*MESSAGE_SIZE_OPTIONS, ("grpc.enable_retries", 0))

#: The attestation socket sits next to the gRPC unix socket under this suffix.
ATTEST_SUFFIX = ".attest"

#: gRPC metadata key that carries the bearer token on TCP.
AUTHORIZATION_KEY = "authorization"


def grpc_target(address: str) -> str:
    """``unix:///path`` and ``unix:/path`` pass through; a bare path becomes a unix target."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/"):
        return "unix://" + address
    return address


def unix_socket_path(target: str) -> str | None:
    """The filesystem path of a ``unix:`` gRPC target, None for anything else."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def attest_path(socket_path: str | Path) -> Path:
    """The attestation socket that belongs to the gRPC unix socket at ``socket_path``."""
    return Path(f"{socket_path}{ATTEST_SUFFIX}")


def open_channel(target: str, tls_root: bytes | None = None,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """TLS (with the given CA) for TCP targets when a CA is set; plain for unix sockets.

    ``max_receive_bytes`` raises the answer limit where one answer may be larger (Status)."""
    options = [o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    if tls_root is not None and unix_socket_path(target) is None:
        creds = grpc.ssl_channel_credentials(root_certificates=tls_root)
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token``; empty without one."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()


def bearer_matches(metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Whether the call's metadata presents ``token``, compared in constant time."""
    offered = str(dict(metadata or ()).get(AUTHORIZATION_KEY, ""))
    expected = f"Bearer {token}"
    return hmac.compare_digest(offered.encode(), expected.encode())


__all__ = [
    "ATTEST_SUFFIX",
    "AUTHORIZATION_KEY",
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "MESSAGE_SIZE_OPTIONS",
    "attest_path",
    "bearer_matches",
    "bearer_metadata",
    "grpc_target",
    "open_channel",
    "unix_socket_path",
]
