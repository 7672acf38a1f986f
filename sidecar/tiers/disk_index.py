"""The disk tier's index: an append-only log of checksummed records, compacted.

A restart reads this one file instead of the header of every object file. The log lives next
to the objects as ``<disk_path>/<namespace>.kvindex``; every record is framed so a damaged one
costs only its own chunk::

    offset  size
    0       4     magic b"KVIX"
    4       4     body length n (little-endian)
    8       8     xxh3-64 of the body
    16      n     body: op (b"A" add / b"D" delete) + u16 key length + key
                  + for "A": u64 object bytes, u64 payload checksum, u64 payload bytes,
                    i64 tokens, i64 source position, f64 created_at, u16 lengths of
                    tenant, scope, layout fingerprint (UTF-8) and aux, then those four

Binary rather than the header's JSON: 100,000 records decode in well under a second.

Rules (the disk objects stay the source of truth; the index is a cache of their headers):

* an object is appended as ``A`` after its file is complete (a crash in between leaves a file
  without a record: recovery reads that file's header, as the full scan would);
* a removal appends ``D`` (a crash before it leaves a record without a file: recovery drops it);
* ``load`` skips a record whose checksum fails and resynchronizes on the next magic, so one
  damaged record loses one chunk (its file has no record any more: its header is read);
* when the log holds more than ``2 x live + 1024`` records it is rewritten (``compact``: the
  live records in write order to ``.kvindex.tmp``, fsync, rename), at recovery and on append.

Thread-safe (one lock around the file and the live map).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from sidecar.tiers.types import ChunkKey, ChunkMeta

logger = logging.getLogger(__name__)

MAGIC = b"KVIX"
_FRAME = struct.Struct("<4sIQ")
_KEYLEN = struct.Struct("<H")
_ADD = struct.Struct("<QQQqqdHHHH")
_MAX_BODY = 1 << 16


@dataclass(frozen=True, slots=True)
class IndexedObject:
    """What the index says about one object file."""

    meta: ChunkMeta
    nbytes: int


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body


def _add_body(meta: ChunkMeta, nbytes: int) -> bytes:
    tenant, scope, layout = (x.encode() for x in (meta.tenant, meta.scope, meta.layout_fingerprint))
    fixed = _ADD.pack(nbytes, meta.checksum, meta.payload_nbytes, meta.num_tokens, meta.source_position,
                      meta.created_at, len(tenant), len(scope), len(layout), len(meta.aux))
    return b"".join((b"A", _KEYLEN.pack(len(meta.key)), meta.key, fixed, tenant, scope, layout, meta.aux))


def _delete_body(key: ChunkKey) -> bytes:
    return b"D" + _KEYLEN.pack(len(key)) + key


def _parse_body(body: bytes, strings: dict[bytes, str]) -> tuple[str, ChunkKey, IndexedObject | None]:
    """(op, key, object for an add); raises ValueError for a body that does not parse.
    ``strings`` interns the few distinct tenants, scopes and layouts across records."""
    op = body[:1]
    (klen,) = _KEYLEN.unpack_from(body, 1)
    key = ChunkKey(body[3:3 + klen])
    if len(key) != klen or not klen:
        raise ValueError("key truncated")
    if op == b"D":
        return "D", key, None
    if op != b"A":
        raise ValueError(f"unknown op {op!r}")
    pos = 3 + klen
    nbytes, csum, payload, ntok, src, created, lt, ls, ll, la = _ADD.unpack_from(body, pos)
    pos += _ADD.size
    if pos + lt + ls + ll + la != len(body):
        raise ValueError("lengths do not add up")
    out = []
    for n in (lt, ls, ll):
        raw = body[pos:pos + n]
        text = strings.get(raw)
        if text is None:
            text = strings[raw] = raw.decode()
        out.append(text)
        pos += n
    meta = ChunkMeta(key=key, tenant=out[0], scope=out[1], layout_fingerprint=out[2], num_tokens=ntok,
                     payload_nbytes=payload, source_position=src, aux=body[pos:pos + la], checksum=csum,
                     created_at=created)
    return "A", key, IndexedObject(meta, nbytes)


class DiskIndex:
    """The index log of one disk tier directory (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._live: OrderedDict[ChunkKey, IndexedObject] = OrderedDict()  # write order
        self._records = 0
        self._damaged = 0  # skipped at load: the next compaction drops them
        self._fd: int | None = None

    def load(self) -> tuple[list[IndexedObject], int] | None:
        """The objects the log names (write order, deletes applied) and how many damaged
        records were skipped; ``None`` when there is no log (the caller scans instead). Opens
        the log for appending."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._open()
            return None
        live = self._live
        bad = records = pos = 0
        strings: dict[bytes, str] = {}
        n = len(raw)
        while pos < n:
            if raw[pos:pos + 4] != MAGIC or pos + _FRAME.size > n:
                nxt = raw.find(MAGIC, pos + 1)
                bad += 1
                if nxt < 0:
                    break
                pos = nxt
                continue
            _, length, digest = _FRAME.unpack_from(raw, pos)
            end = pos + _FRAME.size + length
            body = raw[pos + _FRAME.size:end]
            try:
                if length > _MAX_BODY or end > n or xxhash.xxh3_64_intdigest(body) != digest:
                    raise ValueError("checksum")
                op, key, obj = _parse_body(body, strings)
            except (ValueError, struct.error):
                bad += 1
                nxt = raw.find(MAGIC, pos + 1)
                if nxt < 0:
                    break
                pos = nxt
                continue
            records += 1
            live.pop(key, None)
            if op == "A":
                live[key] = obj
            pos = end
        self._records = records
        self._damaged = bad
        self._open()
        if bad:
            logger.warning("disk index %s: %d damaged records skipped", self.path, bad)
        return list(live.values()), bad

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(self, meta: ChunkMeta, nbytes: int) -> None:
        rec = _frame(_add_body(meta, nbytes))
        with self._lock:
            self._live.pop(meta.key, None)
            self._live[meta.key] = IndexedObject(meta, nbytes)
            self._append(rec)

    def delete(self, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            recs = [_frame(_delete_body(k)) for k in keys if self._live.pop(k, None) is not None]
            if recs:
                self._append(b"".join(recs), len(recs))

    def retain(self, keys: Iterable[ChunkKey]) -> None:
        """Keep only ``keys`` (recovery: records whose file is gone), then compact if due."""
        keep = set(keys)
        with self._lock:
            gone = [k for k in self._live if k not in keep]
            for k in gone:
                del self._live[k]
            if gone or self._damaged or self._due():
                self._compact()

    def set(self, objects: Iterable[IndexedObject]) -> None:
        """Replace the log with ``objects`` in order (recovery after a scan)."""
        with self._lock:
            self._live = OrderedDict((o.meta.key, o) for o in objects)
            self._compact()

    def _due(self) -> bool:
        return self._records > 2 * len(self._live) + 1024

    def _append(self, data: bytes, records: int = 1) -> None:
        if self._fd is None:
            return  # closed: the next recovery reads the headers of what it does not name
        try:
            os.write(self._fd, data)
        except OSError as exc:
            logger.warning("disk index append failed (%s); the next restart scans what it misses", exc)
            return
        self._records += records
        if self._due():
            self._compact()

    def _compact(self) -> None:
        """Rewrite the log with the live records only. Lock held."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(_frame(_add_body(o.meta, o.nbytes)) for o in self._live.values()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("disk index compaction failed: %s", exc)
            tmp.unlink(missing_ok=True)
            return
        if self._fd is not None:
            os.close(self._fd)
        self._open()
        self._records = len(self._live)
        self._damaged = 0

    @property
    def records(self) -> int:
        """Records in the log now (live ones plus garbage until the next compaction)."""
        with self._lock:
            return self._records

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
