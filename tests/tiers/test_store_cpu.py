"""CPU tier (LMCache L1): round trip, idempotence, recency, quotas, bad inputs, integrity."""

from __future__ import annotations

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import (
    CapacityError,
    EventKind,
    QuotaExceededError,
    Reason,
    TenantQuota,
    Tier,
    TierUnavailableError,
    chunk_key,
    decode_payload,
)
from sidecar.tiers.envelope import HEADER_NBYTES
from tests.tiers.conftest import NUM_TOKENS, key, make_payload


def _snapshot(store) -> tuple:
    st = store.stats()
    return (
        sorted(m.key for m in store.list_chunks()),
        {t: (s.used_bytes, s.objects) for t, s in st.tiers.items()},
        st.puts,
        store.tenant_usage("a"),
    )


def test_cpu_round_trip(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    data = make_payload(1, payload_size)
    res = store.put(key(1), data, layout=layout, num_tokens=NUM_TOKENS, tenant="a", source_position=40, aux=b"tok")
    assert (res.tier, res.stored, res.published) == (Tier.CPU, True, False)
    got = store.get(key(1))
    assert got is not None and got.tier == Tier.CPU
    assert torch.equal(got.payload, data)
    assert got.meta.source_position == 40 and got.meta.aux == b"tok" and got.meta.tenant == "a"
    assert got.meta.layout_fingerprint == layout.fingerprint() and got.meta.num_tokens == NUM_TOKENS
    # The caller owns the payload: rotating it in place does not touch the stored copy.
    decode_payload(got.payload, layout, NUM_TOKENS).rotary_parts()[0].tensor.zero_()
    assert torch.equal(store.get(key(1)).payload, data)
    assert store.get(key(2)) is None
    st = store.stats()
    assert (st.puts, st.gets, st.hits, st.misses) == (1, 3, 2, 1)
    assert st.tiers[Tier.CPU].objects == 1 and st.tiers[Tier.CPU].hits == 2


def test_put_accepts_bytes_numpy_and_typed_tensors(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    data = make_payload(2, payload_size)
    store.put(key(1), bytes(data.numpy()), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    store.put(key(2), data.numpy(), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    store.put(key(3), data.view(torch.bfloat16).view(NUM_TOKENS, -1), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    store.put(chunk_key(2**64 - 1), data, layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    for k in (key(1), key(2), key(3), chunk_key(2**64 - 1)):
        assert torch.equal(store.get(k).payload, data)


def test_put_is_idempotent_per_key(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    first = make_payload(1, payload_size)
    assert store.put(key(1), first, layout=layout, num_tokens=NUM_TOKENS, tenant="a").stored
    again = store.put(key(1), make_payload(2, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert (again.stored, again.tier) == (False, Tier.CPU)
    assert torch.equal(store.get(key(1)).payload, first)
    assert store.stats().duplicate_puts == 1 and store.tenant_usage("a") == payload_size


def test_get_many_is_ordered(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    for i in range(4):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    got = store.get_many([key(3), key(9), key(0), key(3)])
    assert got[1] is None
    assert [g.meta.key for g in (got[0], got[2], got[3])] == [key(3), key(0), key(3)]
    assert torch.equal(got[2].payload, make_payload(0, payload_size))


def test_cpu_hit_refreshes_recency(make_store, layout: KVLayout, payload_size: int, obj_size: int) -> None:
    # Only the CPU tier: a full tier evicts its least recently *used* chunk.
    store = make_store(cpu_bytes=3 * obj_size)
    for i in range(3):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert store.get(key(0)) is not None  # 0 becomes the most recent: 1 is now the LRU
    store.put(key(3), make_payload(3, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    events = store.take_events()
    assert [(e.kind, e.key, e.source, e.reason, e.present) for e in events] == [
        (EventKind.EVICTED, key(1), Tier.CPU, Reason.CAPACITY, False)
    ]
    assert [store.locate(key(i)) for i in range(4)] == [Tier.CPU, None, Tier.CPU, Tier.CPU]
    assert store.get(key(1)) is None
    st = store.stats()
    assert st.evictions_by_reason[Reason.CAPACITY] == 1 and st.tiers[Tier.CPU].used_bytes == 3 * obj_size
    assert store.tenant_usage("a") == 3 * payload_size


def test_quota_refusal_leaves_store_unchanged(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20, tenant_quotas={"a": TenantQuota(max_bytes=2 * payload_size)})
    for i in range(2):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    before = _snapshot(store)
    with pytest.raises(QuotaExceededError) as info:
        store.put(key(2), make_payload(2, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    err = info.value
    assert (err.tenant, err.requested_bytes, err.used_bytes, err.quota_bytes) == (
        "a",
        payload_size,
        2 * payload_size,
        2 * payload_size,
    )
    assert _snapshot(store) == before and store.take_events() == []
    assert store.stats().quota_refusals == 1
    # Other tenants are not limited by "a"'s quota; deleting frees "a"'s quota.
    store.put(key(3), make_payload(3, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="b")
    assert store.delete([key(0)]) == 1
    assert store.put(key(2), make_payload(2, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a").stored


def test_per_tier_tenant_share_demotes_own_chunks_only(
    make_store, tmp_path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    store = make_store(
        cpu_bytes=4 * obj_size,
        disk_path=str(tmp_path / "disk"),
        disk_bytes=8 * obj_size,
        tenant_quotas={"noisy": TenantQuota(max_bytes_per_tier={Tier.CPU: 2 * obj_size})},
    )
    store.put(key(0), make_payload(0, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="quiet")
    for i in range(1, 5):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="noisy")
    events = store.take_events()
    assert [(e.kind, e.key, e.source, e.target, e.reason) for e in events] == [
        (EventKind.DEMOTED, key(1), Tier.CPU, Tier.DISK, Reason.QUOTA),
        (EventKind.DEMOTED, key(2), Tier.CPU, Tier.DISK, Reason.QUOTA),
    ]
    assert store.locate(key(0)) == Tier.CPU  # the quiet tenant's chunk was not flushed


def test_bad_inputs_raise_and_leave_store_unchanged(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    store.put(key(0), make_payload(0, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    before = _snapshot(store)
    good = make_payload(1, payload_size)
    cases = [
        (ValueError, "payload is", dict(payload=good[:-1])),
        (ValueError, "payload is", dict(num_tokens=NUM_TOKENS + 1)),
        (ValueError, "num_tokens", dict(num_tokens=0)),
        (ValueError, "num_tokens", dict(num_tokens=True)),
        (ValueError, "key", dict(key=b"")),
        (ValueError, "key", dict(key=b"x" * 65)),
        (TypeError, "key", dict(key="chunk")),
        (ValueError, "tenant", dict(tenant="")),
        (ValueError, "scope", dict(scope="s" * 300)),
        (TypeError, "layout", dict(layout="gqa")),
        (ValueError, "aux", dict(aux=b"x" * 2000)),
        (ValueError, "source_position", dict(source_position=-1)),
        (TypeError, "payload", dict(payload=[1, 2, 3])),
        (ValueError, "contiguous", dict(payload=good.view(2, -1).t())),
    ]
    for exc, match, override in cases:
        args = dict(key=key(1), payload=good, layout=layout, num_tokens=NUM_TOKENS, tenant="a")
        args.update(override)
        k, p = args.pop("key"), args.pop("payload")
        with pytest.raises(exc, match=match):
            store.put(k, p, **args)
        assert _snapshot(store) == before, override
    with pytest.raises(TypeError):
        store.get_many(["not-bytes"])
    assert store.take_events() == [] and store.get(key(1)) is None


def test_chunk_larger_than_every_tier_is_a_capacity_error(make_store, layout: KVLayout, obj_size: int) -> None:
    store = make_store(cpu_bytes=obj_size)
    big = KVLayout.gqa(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")
    with pytest.raises(CapacityError) as info:
        store.put(
            key(1),
            torch.zeros(big.bytes_per_token * NUM_TOKENS, dtype=torch.uint8),
            layout=big,
            num_tokens=NUM_TOKENS,
            tenant="a",
        )
    assert info.value.tier is None and info.value.requested_bytes > obj_size
    assert store.stats().capacity_refusals == 1 and store.list_chunks() == []


def test_corrupted_memory_is_detected_as_a_miss(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    store.put(key(1), make_payload(1, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    cpu = store._mem[Tier.CPU]  # flip one payload byte in the LMCache L1 buffer
    view = cpu.acquire(key(1))
    view[HEADER_NBYTES + 5] ^= 0xFF
    cpu.release(key(1))
    assert store.get(key(1)) is None
    (ev,) = store.take_events()
    assert (ev.kind, ev.source, ev.reason, ev.present) == (EventKind.LOST, Tier.CPU, Reason.CORRUPTION, False)
    st = store.stats()
    assert st.checksum_failures == 1 and st.tiers[Tier.CPU].objects == 0 and st.tiers[Tier.CPU].used_bytes == 0
    assert cpu.allocator_usage()[0] == 0  # the L1 object was freed
    assert store.tenant_usage("a") == 0


def test_delete_and_closed_store(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    store.put(key(1), make_payload(1, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert store.delete([key(1), key(2)]) == 1 and store.delete([key(1)]) == 0
    (ev,) = store.take_events()
    assert (ev.kind, ev.source, ev.present) == (EventKind.DELETED, Tier.CPU, False)
    assert store.get(key(1)) is None and store.stats().tiers[Tier.CPU].used_bytes == 0
    store.close()
    store.close()
    with pytest.raises(TierUnavailableError):
        store.get(key(1))
    with pytest.raises(TierUnavailableError):
        store.put(key(1), make_payload(1, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")


def test_chunks_pinned_by_readers_cause_backpressure_not_loss(
    make_store, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    store = make_store(cpu_bytes=2 * obj_size, pin_wait_s=0.05)
    for i in range(2):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    entries = [store._entries[key(i)] for i in range(2)]
    with store._core.lock:  # two readers in the middle of copying both chunks out
        for e in entries:
            store._core.pin(e, Tier.CPU)
    with pytest.raises(CapacityError) as info:
        store.put(key(2), make_payload(2, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert (info.value.tier, info.value.pinned_bytes, info.value.reason) == (
        Tier.CPU,
        2 * obj_size,
        "pinned by readers",
    )
    assert store.take_events() == [] and store.stats().capacity_refusals == 1
    with store._core.lock:
        for e in entries:
            store._core.unpin(e, Tier.CPU)
    assert store.put(key(2), make_payload(2, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a").stored
    assert [e.key for e in store.take_events()] == [key(0)]


def test_event_buffer_overflow_is_counted(make_store, layout: KVLayout, payload_size: int, obj_size: int) -> None:
    store = make_store(cpu_bytes=obj_size, max_events=2)
    for i in range(4):  # three evictions, room for two events
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert [e.key for e in store.take_events()] == [key(1), key(2)]
    assert store.stats().events_dropped == 1 and store.take_events() == []
