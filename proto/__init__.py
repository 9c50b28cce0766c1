"""The ``deadweight.v1`` wire schema: the ``.proto`` source and its generated code.

Import the messages as ``from deadweight.proto import pb`` and the service stubs as
``from deadweight.proto import pb_grpc``. Regenerate with ``python -m deadweight.proto.generate``.
"""

from typing import Any

from .deadweight.v1 import deadweight_pb2 as pb
from .deadweight.v1 import deadweight_pb2_grpc as pb_grpc
from .transport import MAX_MESSAGE_BYTES


def monitor_stub(channel: Any) -> Any:
    """A MonitorService client stub (the generated code carries no annotations)."""
    return pb_grpc.MonitorServiceStub(channel)  # type: ignore[no-untyped-call]


def add_monitor_servicer(servicer: Any, server: Any) -> None:
    """Register a MonitorService implementation on a grpc (or grpc.aio) server."""
    pb_grpc.add_MonitorServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]


__all__ = ["MAX_MESSAGE_BYTES", "add_monitor_servicer", "monitor_stub", "pb", "pb_grpc"]
