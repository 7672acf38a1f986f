"""The KVSidecar service as the proto declares it: its descriptor, and each method's message classes.

The server registers its handlers from this (``sidecar.server.service``), so a method the proto
declares cannot be left without a handler; the SDK builds its calls from the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.v1 import llmd_indexer_pb2 as ipb
from sidecar.v1 import llmd_indexer_pb2_grpc as ipb_grpc
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


def methods_of(service, module) -> tuple[Method, ...]:
    """Every RPC of ``service`` (a service descriptor), message classes from ``module``."""
    return tuple(
        Method(m.name, f"/{service.full_name}/{m.name}", getattr(module, m.input_type.name),
               getattr(module, m.output_type.name), m.client_streaming, m.server_streaming)
        for m in service.methods
    )


#: every RPC of the service, in declaration order
METHODS = methods_of(SERVICE, pb)

#: llm-d's KV-cache indexer service (``GetPodScores``), served beside KVSidecar for llm-d's
#: inference scheduler (docs/routing.md)
INDEXER_SERVICE = ipb.DESCRIPTOR.services_by_name["IndexerService"]
INDEXER_SERVICE_NAME = INDEXER_SERVICE.full_name
INDEXER_METHODS = methods_of(INDEXER_SERVICE, ipb)
IndexerStub = ipb_grpc.IndexerServiceStub
#: every method name the server counts (both services)
METHOD_NAMES = tuple(m.name for m in (*METHODS, *INDEXER_METHODS))
