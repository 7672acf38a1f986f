"""The KVSidecar service as the proto declares it: its descriptor, and each method's message classes.

The server registers its handlers from this (``sidecar.server.service``), so a method the proto
declares cannot be left without a handler; the SDK builds its calls from the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["KVSidecar"]
SERVICE_NAME = SERVICE.full_name
#: the generated client stub class (``Stub(channel)``), for the SDK and raw-gRPC callers
Stub = pb_grpc.KVSidecarStub


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its name, full path (``/sidecar.v1.KVSidecar/Lookup``), message classes and
    streaming kind."""

    name: str
    path: str
    request: type
    response: type
    client_streaming: bool
    server_streaming: bool


#: every RPC of the service, in declaration order
METHODS = tuple(
    Method(m.name, f"/{SERVICE_NAME}/{m.name}", getattr(pb, m.input_type.name), getattr(pb, m.output_type.name),
           m.client_streaming, m.server_streaming)
    for m in SERVICE.methods
)
METHOD_NAMES = tuple(m.name for m in METHODS)
