"""Manifests on a Redis stream: operators publish (XADD, pipelined in batches), sidecars read
the whole stream at startup (XRANGE in batches). One stream entry holds one manifest line in
its ``line`` field, so a stream is a manifest and every tool that reads one reads the other."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import redis

FIELD = b"line"


def publish(client: redis.Redis, stream: str, lines: Iterable[bytes], *, batch: int = 500,
            progress: Callable[[int], None] | None = None) -> int:
    """XADD every non-blank line, ``batch`` per pipelined round trip; returns lines published."""
    n = 0
    pipe = client.pipeline(transaction=False)
    queued = 0
    for line in lines:
        line = line.rstrip(b"\n")
        if not line.strip():
            continue
        pipe.xadd(stream, {FIELD: line})
        queued += 1
        if queued >= batch:
            pipe.execute()
            n += queued
            if progress is not None:
                progress(queued)
            queued = 0
    if queued:
        pipe.execute()
        n += queued
        if progress is not None:
            progress(queued)
    return n


def read(client: redis.Redis, stream: str, *, batch: int = 1000, after: str = "-") -> Iterator[list[bytes]]:
    """Every line of ``stream`` (after entry id ``after``), one list per XRANGE round trip."""
    start = after
    while True:
        rows = client.xrange(stream, min=start, max="+", count=batch)
        if not rows:
            return
        yield [fields.get(FIELD, b"") for _, fields in rows]
        last = rows[-1][0]
        last = last.decode() if isinstance(last, bytes) else last
        start = "(" + last
        if len(rows) < batch:
            return
