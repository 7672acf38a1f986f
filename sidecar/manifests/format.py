"""The manifest line format: one JSON object per line, one line per unique chunk.

::

    {"v":1,"content_hash":"9f0c...","identity":"5be1...","scope":"team-a",
     "tokens":"<base64 of packed LE uint32>","num_tokens":128,"source_pos":0,
     "prefix_digest":"0000000000000000","count":3,"first_seen":1764000000.12,"last_seen":1764000090.5}

* ``content_hash``: the registry key (16 hex digits): ``ChunkHash`` of the chunk's tokens under
  ``identity`` and ``scope``. It is recomputed from the tokens on import and a line whose hash
  does not match is malformed (a manifest cannot point a key at other content).
* ``identity``: ``CacheIdentity.fingerprint`` (the identity salt, 16 hex digits). Keys are salted
  with it, so the salt alone is enough to recompute every key; KV never crosses identities.
* ``scope``: the tenant the chunk belongs to, or ``shared``.
* ``tokens``: base64 of the packed little-endian uint32 token ids (4 bytes per token, ~5.3
  characters per token). A JSON list of ids is accepted too, as is the seed's ``chunk_tokens``.
* ``source_pos`` / ``prefix_digest``: where the chunk was first computed and the chained digest
  of everything before it (``chunker``); with them a warm-up plan rebuilds the original token
  sequences, so re-computed chunks land at the same positions with the same left context (the
  same EXACT hits a long-running sidecar serves). Optional: without them a chunk is warmed alone.
* ``count``: times the chunk was registered or served, as of ``last_seen``. The producer writes
  later lines for the same key as the count grows; readers merge lines by key taking the largest
  ``count`` and ``last_seen`` and the smallest ``first_seen`` (``merge``).

Parsing is strict per line and lenient per file: ``parse_line`` raises ``ValueError`` naming the
field; ``read_lines`` yields ``None`` for a malformed line so callers skip and count it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from sidecar.registry.entry import ChunkHash, chain_reference

FORMAT_VERSION = 1
_U32 = np.dtype("<u4")
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class ManifestEntry:
    """One manifest line, decoded. ``tokens`` is packed LE uint32 bytes."""

    content_hash: ChunkHash
    identity: int  # the identity salt (CacheIdentity.salt)
    scope: str
    tokens: bytes
    count: int = 1
    source_pos: int | None = None
    prefix_digest: int | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def identity_fingerprint(self) -> str:
        return f"{self.identity:016x}"


def chunk_key(identity_salt: int, scope: str, tokens: bytes) -> ChunkHash:
    """The registry key of a chunk (identical to what ``chunker.chunk_tokens`` computes):
    ``chain(scope_seed, xxh64(tokens, seed=salt))``. One call per chunk, never per token."""
    seed = xxhash.xxh64_intdigest(scope.encode(), seed=identity_salt)
    return ChunkHash(chain_reference(seed, content_digest(identity_salt, tokens)))


def content_digest(identity_salt: int, tokens: bytes) -> int:
    """The scope-free chunk digest that prefix digests chain over."""
    return xxhash.xxh64_intdigest(tokens, seed=identity_salt)


def next_prefix_digest(entry: ManifestEntry) -> int | None:
    """The prefix digest of the chunk that follows ``entry`` in its original sequence."""
    if entry.prefix_digest is None:
        return None
    return chain_reference(entry.prefix_digest, content_digest(entry.identity, entry.tokens))


def encode_line(e: ManifestEntry) -> bytes:
    """One line, newline included (UTF-8; base64 tokens keep it ASCII)."""
    obj = {
        "v": FORMAT_VERSION,
        "content_hash": f"{e.content_hash:016x}",
        "identity": f"{e.identity:016x}",
        "scope": e.scope,
        "tokens": base64.b64encode(e.tokens).decode("ascii"),
        "num_tokens": e.num_tokens,
        "count": e.count,
        "first_seen": round(e.first_seen, 3),
        "last_seen": round(e.last_seen, 3),
    }
    if e.source_pos is not None:
        obj["source_pos"] = e.source_pos
    if e.prefix_digest is not None:
        obj["prefix_digest"] = f"{e.prefix_digest:016x}"
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _hex64(obj: dict, field: str, required: bool) -> int | None:
    v = obj.get(field)
    if v is None:
        if required:
            raise ValueError(f"{field}: required")
        return None
    if not isinstance(v, str) or not 1 <= len(v) <= 16:
        raise ValueError(f"{field}: expected up to 16 hex digits, got {v!r:.40}")
    try:
        return int(v, 16)
    except ValueError:
        raise ValueError(f"{field}: not hexadecimal: {v!r:.40}") from None


def _uint(obj: dict, field: str, default: int | None) -> int | None:
    v = obj.get(field, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{field}: expected a non-negative integer, got {v!r:.40}")
    return v


def _tokens(obj: dict) -> bytes:
    raw = obj.get("tokens", obj.get("chunk_tokens"))
    if raw is None:
        raise ValueError("tokens: required")
    if isinstance(raw, str):
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("tokens: not valid base64") from None
        if len(data) % 4:
            raise ValueError(f"tokens: {len(data)} bytes is not a multiple of 4 (packed LE uint32)")
    elif isinstance(raw, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise ValueError("tokens: a list must hold integer token ids")
        arr = np.asarray(raw, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("tokens: ids must fit uint32")
        data = arr.astype(_U32).tobytes()
    else:
        raise ValueError("tokens: expected base64 text or a list of token ids")
    if not data:
        raise ValueError("tokens: empty")
    n = obj.get("num_tokens")
    if n is not None and n != len(data) // 4:
        raise ValueError(f"num_tokens: {n!r:.20} but tokens hold {len(data) // 4}")
    return data


def parse_line(line: bytes | str) -> ManifestEntry:
    """Decode and validate one line. Raises ``ValueError`` naming the offending field,
    including ``content_hash`` when the tokens do not hash to it."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("line: not valid JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("line: expected a JSON object")
    v = obj.get("v", FORMAT_VERSION)
    if v != FORMAT_VERSION:
        raise ValueError(f"v: unsupported manifest version {v!r:.20}")
    scope = obj.get("scope")
    if not isinstance(scope, str) or not scope or len(scope) > 128:
        raise ValueError("scope: required, a tenant id or 'shared'")
    identity = _hex64(obj, "identity", True)
    tokens = _tokens(obj)
    key = chunk_key(identity, scope, tokens)
    given = _hex64(obj, "content_hash", False)
    if given is not None and given != key:
        raise ValueError(f"content_hash: {given:016x} is not the hash of the line's tokens under its identity and scope")
    first = obj.get("first_seen", 0.0)
    last = obj.get("last_seen", first)
    if not isinstance(first, (int, float)) or not isinstance(last, (int, float)):
        raise ValueError("first_seen/last_seen: expected numbers (unix seconds)")
    count = _uint(obj, "count", 1)
    return ManifestEntry(
        content_hash=key,
        identity=identity,
        scope=scope,
        tokens=tokens,
        count=count,
        source_pos=_uint(obj, "source_pos", None),
        prefix_digest=_hex64(obj, "prefix_digest", False),
        first_seen=float(first),
        last_seen=float(last),
    )


def read_lines(lines: Iterable[bytes | str]) -> Iterator[ManifestEntry | None]:
    """Parsed entries of ``lines`` in order; ``None`` for each malformed line (blank lines are
    skipped). A torn last line (a crash mid-write) is just one malformed line."""
    for line in lines:
        if not line.strip():
            continue
        try:
            yield parse_line(line)
        except ValueError:
            yield None


def merge(entries: Iterable[ManifestEntry]) -> list[ManifestEntry]:
    """One entry per (identity, scope, key), first-seen order: largest ``count`` and
    ``last_seen``, smallest ``first_seen``; position fields from the first line that has them."""
    out: dict[tuple[int, str, int], ManifestEntry] = {}
    for e in entries:
        k = (e.identity, e.scope, e.content_hash)
        old = out.get(k)
        if old is None:
            out[k] = e
            continue
        old.count = max(old.count, e.count)
        old.last_seen = max(old.last_seen, e.last_seen)
        if e.first_seen and (not old.first_seen or e.first_seen < old.first_seen):
            old.first_seen = e.first_seen
        if old.source_pos is None and e.source_pos is not None:
            old.source_pos, old.prefix_digest = e.source_pos, e.prefix_digest
    return list(out.values())
