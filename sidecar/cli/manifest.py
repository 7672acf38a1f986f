"""``kv-sidecar manifest import|export|publish|inspect`` (docs/manifests.md).

* ``import FILE... --target HOST:PORT``: ImportManifest in batches of whole lines (progress bar);
  ``--shared`` imports into the shared scope (the tenant needs ``auth.shared_writers``).
* ``export --target HOST:PORT --identity JSON -o OUT``: the running sidecar's chunks of one
  identity as a manifest; ``export --from FILE... -o OUT``: merge files into one compact manifest.
* ``publish FILE... --redis URL --stream KEY``: XADD every line, pipelined in batches.
* ``inspect FILE...``: entries, tokens, scopes, identities, malformed lines.

Exit status: 0 done, 1 the sidecar or Redis refused, 2 bad arguments or unreadable files.
Malformed lines are skipped and counted, never fatal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("manifest", help="import, export, publish or inspect warm-start manifests (docs/manifests.md)")
    msub = p.add_subparsers(dest="manifest_command", metavar="ACTION", required=True)

    def target(q: argparse.ArgumentParser) -> None:
        q.add_argument("--target", default="127.0.0.1:50051", help="the sidecar's gRPC address (default %(default)s)")
        q.add_argument("--tenant", help="x-tenant-id to act as")
        q.add_argument("--token", help="bearer token (auth)")

    imp = msub.add_parser("import", help="import manifest files into a running sidecar")
    imp.add_argument("files", nargs="+", type=Path)
    target(imp)
    imp.add_argument("--shared", action="store_true", help="import into the shared scope (operator permission)")
    imp.add_argument("--no-prefetch", dest="no_prefetch", action="store_true",
                     help="plan every entry for warm-up instead of reading the shared tier")
    imp.add_argument("--batch", type=int, default=2000, help="lines per ImportManifest call (default %(default)s)")
    imp.add_argument("--quiet", action="store_true", help="no progress bar")

    exp = msub.add_parser("export", help="write a running sidecar's registry (or merged files) as a manifest")
    target(exp)
    exp.add_argument("--identity", help='the engine\'s CacheIdentity as JSON, e.g. \'{"model_id": "m", "kv_layout": "..."}\'')
    exp.add_argument("--include-shared", dest="include_shared", action="store_true", help="also the shared scope's chunks")
    exp.add_argument("--from", dest="from_files", nargs="+", type=Path, help="merge these manifest files instead")
    exp.add_argument("-o", "--output", type=Path, help="output file (default: stdout)")

    pub = msub.add_parser("publish", help="push manifest lines to a Redis stream (sidecars import it at startup)")
    pub.add_argument("files", nargs="+", type=Path)
    pub.add_argument("--redis", required=True, help="redis://host:port")
    pub.add_argument("--stream", required=True, help="stream key (manifests.import_redis_stream)")
    pub.add_argument("--batch", type=int, default=500, help="XADDs per pipelined round trip (default %(default)s)")
    pub.add_argument("--quiet", action="store_true", help="no progress bar")

    ins = msub.add_parser("inspect", help="summarize manifest files")
    ins.add_argument("files", nargs="+", type=Path)
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")


def _lines(files: list[Path]) -> Iterator[bytes]:
    for f in files:
        with open(f, "rb") as fh:
            yield from fh


def _batches(files: list[Path], n: int) -> Iterator[tuple[bytes, int]]:
    buf: list[bytes] = []
    size = 0
    for line in _lines(files):
        if not line.endswith(b"\n"):
            line += b"\n"
        buf.append(line)
        size += len(line)
        if len(buf) >= n:
            yield b"".join(buf), size
            buf, size = [], 0
    if buf:
        yield b"".join(buf), size


def _bar(total: int, quiet: bool, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, disable=quiet, file=sys.stderr, desc="manifest")


def summarize(files: list[Path]) -> dict[str, Any]:
    from sidecar.manifests import merge, read_lines

    parsed = list(read_lines(_lines(files)))
    valid = [e for e in parsed if e is not None]
    entries = merge(valid)
    return {
        "lines": len(parsed),
        "malformed": len(parsed) - len(valid),
        "entries": len(entries),
        "tokens": sum(e.num_tokens for e in entries),
        "count_total": sum(e.count for e in entries),
        "scopes": dict(Counter(e.scope for e in entries).most_common()),
        "identities": dict(Counter(e.identity_fingerprint for e in entries).most_common()),
        "with_positions": sum(1 for e in entries if e.source_pos is not None),
    }


def run(args: argparse.Namespace) -> int:
    try:
        return _ACTIONS[args.manifest_command](args)
    except OSError as exc:
        print(f"kv-sidecar manifest: {exc}", file=sys.stderr)
        return 2


def _import(args: argparse.Namespace) -> int:
    from sidecar.client import SyncSidecarClient
    from sidecar.errors import SidecarError

    if args.batch < 1:
        print("kv-sidecar manifest import: --batch must be >= 1", file=sys.stderr)
        return 2
    total = sum(f.stat().st_size for f in args.files)
    sums: Counter = Counter()
    with SyncSidecarClient(args.target, tenant=args.tenant, token=args.token, timeout_s=300) as client, \
            _bar(total, args.quiet, "B") as bar:
        for body, size in _batches(args.files, args.batch):
            try:
                r = client.import_manifest(body, shared=args.shared, prefetch=not args.no_prefetch)
            except SidecarError as exc:
                print(f"kv-sidecar manifest import: {exc.code.name}: {exc}", file=sys.stderr)
                return 1
            for k in ("lines", "prefetched", "planned", "present", "malformed", "refused"):
                sums[k] += getattr(r, k)
            sums["warmup_pending"] = r.warmup_pending
            bar.update(size)
    print(json.dumps(dict(sums)))
    return 0


def _export(args: argparse.Namespace) -> int:
    out = open(args.output, "wb") if args.output else sys.stdout.buffer
    try:
        if args.from_files:
            from sidecar.manifests import encode_line, merge, read_lines

            for e in merge(x for x in read_lines(_lines(args.from_files)) if x is not None):
                out.write(encode_line(e))
            return 0
        if not args.identity:
            print("kv-sidecar manifest export: --identity (JSON) or --from FILE... is required", file=sys.stderr)
            return 2
        from sidecar.client import SyncSidecarClient
        from sidecar.errors import SidecarError
        from sidecar.identity import CacheIdentity

        try:
            identity = CacheIdentity(**json.loads(args.identity))
        except (ValueError, TypeError) as exc:
            print(f"kv-sidecar manifest export: --identity: {exc}", file=sys.stderr)
            return 2
        with SyncSidecarClient(args.target, tenant=args.tenant, token=args.token, timeout_s=300) as client:
            try:
                out.write(client.export_manifest(identity, include_shared=args.include_shared))
            except SidecarError as exc:
                print(f"kv-sidecar manifest export: {exc.code.name}: {exc}", file=sys.stderr)
                return 1
        return 0
    finally:
        if args.output:
            out.close()
        else:
            out.flush()


def _publish(args: argparse.Namespace) -> int:
    import redis

    from sidecar.manifests import stream

    if args.batch < 1:
        print("kv-sidecar manifest publish: --batch must be >= 1", file=sys.stderr)
        return 2
    total = sum(1 for _ in _lines(args.files))
    client = redis.Redis.from_url(args.redis, socket_timeout=30)
    try:
        with _bar(total, args.quiet, "line") as bar:
            n = stream.publish(client, args.stream, _lines(args.files), batch=args.batch, progress=bar.update)
    except redis.RedisError as exc:
        print(f"kv-sidecar manifest publish: {args.redis}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps({"published": n, "stream": args.stream}))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    s = summarize(args.files)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"lines {s['lines']}  entries {s['entries']}  tokens {s['tokens']}  malformed {s['malformed']}  "
          f"count total {s['count_total']}  with positions {s['with_positions']}")
    print("scopes:     " + ", ".join(f"{k} {v}" for k, v in s["scopes"].items()))
    print("identities: " + ", ".join(f"{k} {v}" for k, v in s["identities"].items()))
    return 0


_ACTIONS = {"import": _import, "export": _export, "publish": _publish, "inspect": _inspect}
