"""The ``deadweight.v1`` wire schema: the ``.proto`` source and its generated code.

Import the messages as ``from deadweight.proto import pb`` and the service stubs as
``from deadweight.proto import pb_grpc``. Regenerate with ``python -m deadweight.proto.generate``.
"""

from deadweight.proto.deadweight.v1 import deadweight_pb2 as pb
from deadweight.proto.deadweight.v1 import deadweight_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
