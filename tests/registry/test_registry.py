"""Registry: LRU eviction order by entries and bytes, hit counts, token verification."""

from __future__ import annotations

import pytest

from sidecar.registry.entry import ENTRY_OVERHEAD_BYTES, ChunkEntry, ChunkHash
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig


def entry(key: int, ntok: int = 4, scope: str = "t", fill: int | None = None) -> ChunkEntry:
    val = key if fill is None else fill
    return ChunkEntry(
        key=ChunkHash(key), scope=scope, tokens=val.to_bytes(4, "little") * ntok, source_pos=100 + key,
        prefix_digest=key, left_context=b"",
    )


def test_lru_eviction_order_by_entries():
    reg = InMemoryRegistry(RegistryConfig(capacity_entries=3))
    for k in (1, 2, 3):
        assert reg.insert(entry(k))
    reg.touch(reg.peek(1))  # 1 becomes most recent: order 2, 3, 1
    assert reg.keys_lru() == [2, 3, 1]
    reg.insert(entry(4))  # evicts 2
    assert reg.keys_lru() == [3, 1, 4]
    reg.insert(entry(3))  # refresh: 3 moves to the end, nothing evicted
    assert reg.keys_lru() == [1, 4, 3]
    reg.insert(entry(5))
    assert reg.keys_lru() == [4, 3, 5]
    events = reg.take_events()
    assert [(e.key, e.reason) for e in events] == [(2, "capacity_entries"), (1, "capacity_entries")]
    assert reg.take_events() == []
    assert reg.stats.evictions == 2


def test_eviction_by_bytes():
    one = entry(1, ntok=10).nbytes
    assert one == 40 + ENTRY_OVERHEAD_BYTES
    reg = InMemoryRegistry(RegistryConfig(capacity_bytes=3 * one))
    for k in range(1, 6):
        reg.insert(entry(k, ntok=10))
    assert reg.keys_lru() == [3, 4, 5]
    assert reg.nbytes == 3 * one
    big = entry(9, ntok=2 * 10 + 64)  # needs two victims
    reg.insert(big)
    assert reg.keys_lru() == [5, 9]
    assert reg.nbytes == one + big.nbytes
    assert [e.reason for e in reg.take_events()] == ["capacity_bytes"] * 4


def test_entry_larger_than_capacity_is_refused():
    reg = InMemoryRegistry(RegistryConfig(capacity_bytes=100))
    assert not reg.insert(entry(1, ntok=100))
    assert len(reg) == 0 and reg.nbytes == 0


def test_hits_and_recency():
    reg = InMemoryRegistry(RegistryConfig())
    reg.insert(entry(1))
    reg.insert(entry(2))
    e = reg.peek(1)
    assert e.hits == 0 and reg.keys_lru() == [1, 2]  # peek changes nothing
    reg.touch(e)
    reg.touch(e)
    assert e.hits == 2 and reg.stats.hits == 2 and reg.keys_lru() == [2, 1]


def test_refresh_keeps_canonical_source():
    reg = InMemoryRegistry(RegistryConfig())
    reg.insert(entry(1))
    moved = entry(1)
    moved.source_pos = 9999
    assert not reg.insert(moved)
    assert reg.peek(1).source_pos == 101


def test_token_verification_rejects_collisions():
    """Same 64-bit key, different tokens: never served, never overwritten."""
    reg = InMemoryRegistry(RegistryConfig())
    reg.insert(entry(7, fill=1))
    impostor = entry(7, fill=2)
    assert not reg.insert(impostor)
    stored = reg.peek(7)
    assert stored.tokens == entry(7, fill=1).tokens
    assert not reg.verify(stored, impostor.tokens)
    assert reg.verify(stored, entry(7, fill=1).tokens)
    assert reg.stats.verify_failures == 2


def test_delete():
    reg = InMemoryRegistry(RegistryConfig())
    reg.insert(entry(1))
    assert reg.delete(1) and not reg.delete(1)
    assert len(reg) == 0 and reg.nbytes == 0
    assert [e.reason for e in reg.take_events()] == ["deleted"]


@pytest.mark.parametrize("kwargs", [dict(capacity_entries=0), dict(capacity_bytes=0), dict(left_context_tokens=-1)])
def test_bad_config(kwargs):
    with pytest.raises(ValueError, match="registry"):
        RegistryConfig(**kwargs)


def test_scope_entry_counts():
    reg = InMemoryRegistry(RegistryConfig(capacity_entries=2))
    reg.insert(entry(1, scope="a"))
    reg.insert(entry(2, scope="shared"))
    assert (reg.scope_entries("a"), reg.scope_entries("shared")) == (1, 1)
    reg.insert(entry(3, scope="a"))  # evicts 1
    assert (reg.scope_entries("a"), reg.scope_entries("shared")) == (1, 1)
    reg.delete(2)
    assert reg.scope_entries("shared") == 0 and reg.scope_entries("b") == 0
