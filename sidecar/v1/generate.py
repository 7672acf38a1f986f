"""Regenerate (or check) the committed gRPC stubs from proto/sidecar/v1/*.proto.

``python -m sidecar.v1.generate`` rewrites sidecar/v1/sidecar_pb2*.py (the KVSidecar service) and
sidecar/v1/llmd_indexer_pb2*.py (llm-d's IndexerService, served for llm-d's scheduler);
``python -m sidecar.v1.generate --check`` exits 1 if they are stale. The stubs are committed so
that installing the sidecar needs no protoc; grpcio-tools is a test extra.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("sidecar/v1/sidecar.proto", "sidecar/v1/llmd_indexer.proto")
OUTPUTS = tuple(f"{Path(p).stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / "proto" / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")


def stale_files() -> list[str]:
    """Names of committed stub files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "sidecar" / "v1"
        here = ROOT / "sidecar" / "v1"
        return [n for n in OUTPUTS if not (here / n).exists() or not filecmp.cmp(fresh / n, here / n, shallow=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only check that the stubs are current")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated files: {stale}; run python -m sidecar.v1.generate", file=sys.stderr)
            return 1
        print("generated stubs are current")
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
