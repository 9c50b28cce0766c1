"""The ingest bench's floor: the sidecar's gRPC transport with nothing behind it.

A child process serving ``deadweight.v1.MonitorService.Stream`` on a unix socket the way the
sidecar does (``grpc.aio``, the sidecar's options, each batch answered with its ack on the
event loop, as the sidecar answers a batch that waits for nothing) but applying nothing. Its
CPU per record is what the transport alone costs, so the ingest row can say how much of the
sidecar's cost is its own work.

Run as ``python -m bench.transport_floor SOCKET``; prints ``ready`` once it listens.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from deadweight.proto import add_monitor_servicer, pb, pb_grpc
from deadweight.sidecar.ingest.server import ServerConfig


def _ack(request: pb.StreamRequest) -> pb.StreamResponse:
    return pb.StreamResponse(ack_seq=request.events[-1].seq if request.events else 0)


class AckOnly(pb_grpc.MonitorServiceServicer):  # type: ignore[misc]
    """Answers every batch with its last sequence number, on the event loop."""

    async def Stream(self, request_iterator: AsyncIterator[pb.StreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StreamResponse]:
        async for request in request_iterator:
            yield _ack(request)


async def _serve(socket_path: str) -> None:
    server = grpc.aio.server(options=ServerConfig().grpc_options)
    add_monitor_servicer(AckOnly(), server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1]))
