"""Generated gRPC code for proto/sidecar/v1/sidecar.proto (committed).

Regenerate after editing the proto (tests/cli/test_config_cli.py fails while they are stale)::

    .venv/bin/python -m sidecar.v1.generate
"""
