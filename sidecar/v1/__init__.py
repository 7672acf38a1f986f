"""Generated gRPC code for proto/sidecar/v1/sidecar.proto (committed).

Regenerate after editing the proto (tests/test_proto.py fails while it is stale)::

    .venv/bin/python -m sidecar.v1.generate
"""
