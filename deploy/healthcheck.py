"""Container health probe: ask the sidecar's gRPC health service whether it is SERVING.

    python healthcheck.py [HOST:PORT]      # default 127.0.0.1:$KV_SIDECAR_PORT (else 50051)

Exit 0 when ``grpc.health.v1.Health/Check`` answers SERVING for ``sidecar.v1.KVSidecar``; exit 1
otherwise (not listening, NOT_SERVING while draining after SIGTERM, timeout), with the reason on
stderr. Needs only grpcio and grpcio-health-checking (no torch or LMCache import, so a probe
costs ~0.1 s). The health service needs no bearer token, so the probe works with auth on.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "sidecar.v1.KVSidecar"
TIMEOUT_S = 3.0


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else f"127.0.0.1:{os.environ.get('KV_SIDECAR_PORT', '50051')}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT_S
            )
        except grpc.RpcError as exc:
            print(f"healthcheck: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"healthcheck: {target}: {SERVICE} is {name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
