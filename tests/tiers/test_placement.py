"""The placement policy on its own: plain numbers, no backends, no I/O."""

from __future__ import annotations

import pytest

from sidecar.tiers import QuotaExceededError, TenantQuota, Tier
from sidecar.tiers.placement import Entry, Guard, Placement
from sidecar.tiers.types import ChunkKey, ChunkMeta

CHAIN = (Tier.CPU, Tier.DISK)


def _placement(cpu: int = 400, disk: int = 1000, quotas: dict[str, TenantQuota] | None = None,
               align: int = 1) -> Placement:
    quotas = quotas or {}

    def footprint(tier: Tier, n: int) -> int:
        return -(-n // align) * align if tier == Tier.CPU else n

    return Placement(CHAIN, {Tier.CPU: cpu, Tier.DISK: disk}, footprint, lambda t: quotas.get(t, TenantQuota()))


def _entry(i: int, nbytes: int = 100, tenant: str = "a") -> Entry:
    meta = ChunkMeta(key=ChunkKey(b"k%d" % i), tenant=tenant, scope=tenant, layout_fingerprint="L",
                     num_tokens=1, payload_nbytes=nbytes - 10)
    return Entry(meta=meta, obj_nbytes=nbytes)


def _put(p: Placement, e: Entry, tier: Tier) -> Entry:
    p.add(e)
    p.attach(e, tier)
    return e


def test_attach_detach_keep_exact_accounting_and_lru_order() -> None:
    p = _placement(align=64)
    a, b, c = (_put(p, _entry(i, 100 + i), Tier.CPU) for i in range(3))
    assert p.used[Tier.CPU] == 3 * 128 and p.tenant_used[("a", Tier.CPU)] == 3 * 128
    assert p.tenant_bytes["a"] == 90 + 91 + 92
    p.touch(a, Tier.CPU)
    assert list(p.lru[Tier.CPU]) == [b.key, c.key, a.key]
    p.detach(b, Tier.CPU)
    p.attach(b, Tier.DISK)
    assert (p.used[Tier.CPU], p.used[Tier.DISK]) == (2 * 128, 101) and b.local == Tier.DISK
    p.detach(b, Tier.DISK)
    p.forget(b)
    assert b.key not in p.entries and p.tenant_bytes["a"] == 90 + 92 and p.used[Tier.DISK] == 0


def test_reservation_counts_until_attached_or_released() -> None:
    p = _placement(cpu=300)
    p.reserve(Tier.CPU, "a", 200)
    assert not p.fits(Tier.CPU, 200, "a") and p.fits(Tier.CPU, 100, "a")
    e = _entry(1, 200)
    p.add(e)
    p.attach(e, Tier.CPU, reserved=True)  # converts the reservation: nothing counted twice
    assert p.used[Tier.CPU] == 200 and p.tenant_used[("a", Tier.CPU)] == 200
    p.reserve(Tier.CPU, "a", 100)
    p.release(Tier.CPU, "a", 100)
    assert p.used[Tier.CPU] == 200


def test_victims_are_lru_first_and_skip_busy_and_held_chunks() -> None:
    p = _placement()
    e0, e1, e2 = (_put(p, _entry(i), Tier.CPU) for i in range(3))
    assert p.pick_victim(Tier.CPU, None) is e0
    e0.readers[Tier.CPU] = 1  # pinned by a reader
    e1.moving = True  # being moved by a writer
    assert p.pick_victim(Tier.CPU, None) is e2
    p.set_guard(e2.key, Guard.HOLD)
    assert p.pick_victim(Tier.CPU, None) is None
    assert p.guarded_bytes(Tier.CPU) == 100


def test_soft_guard_gets_one_more_lap() -> None:
    p = _placement()
    e0, e1 = (_put(p, _entry(i), Tier.CPU) for i in range(2))
    p.set_guard(e0.key, Guard.SOFT)
    assert p.pick_victim(Tier.CPU, None) is e1  # e0 skipped once and moved to the recent end
    assert list(p.lru[Tier.CPU]) == [e1.key, e0.key]
    e1.readers[Tier.CPU] = 1
    assert p.pick_victim(Tier.CPU, None) is e0  # its second chance is used up


def test_no_drop_may_be_demoted_but_never_dropped_from_the_last_tier() -> None:
    p = _placement()
    c = _put(p, _entry(0), Tier.CPU)
    d = _put(p, _entry(1), Tier.DISK)
    for e in (c, d):
        p.set_guard(e.key, Guard.NO_DROP)
    assert p.pick_victim(Tier.CPU, None) is c
    assert p.pick_victim(Tier.DISK, None) is None
    assert p.guarded_bytes(Tier.DISK) == 100 and p.guarded_bytes(Tier.CPU) == 0


def test_candidates_need_reclaimable_room_and_respect_tenant_shares() -> None:
    p = _placement(cpu=300, disk=300, quotas={"b": TenantQuota(max_bytes_per_tier={Tier.CPU: 150})})
    held = [_put(p, _entry(i), Tier.CPU) for i in range(3)]  # CPU full
    assert p.candidates(100, "a") == [Tier.CPU, Tier.DISK]  # CPU by demoting its LRU chunk
    for e in held:
        e.readers[Tier.CPU] = 1
    assert p.candidates(100, "a") == [Tier.DISK]
    assert p.candidates(400, "a") == []  # larger than any tier
    assert p.first_tier_that_holds(400) is None and p.first_tier_that_holds(300) is Tier.CPU
    assert p.candidates(200, "b") == [Tier.DISK]  # over b's CPU share whatever is free
    assert p.over(Tier.DISK, 250, "a") == (False, False) and p.over(Tier.DISK, 301, "a") == (False, True)


def test_quota_reservation_refuses_past_max_bytes_and_changes_nothing() -> None:
    p = _placement(quotas={"a": TenantQuota(max_bytes=150)})
    p.reserve_quota("a", 100)
    with pytest.raises(QuotaExceededError):
        p.reserve_quota("a", 100)
    assert p.tenant_bytes["a"] == 100
    e = _entry(0, 110)  # payload 100
    p.add(e, quota_reserved=True)
    p.attach(e, Tier.CPU)
    assert p.tenant_bytes["a"] == 100
    p.detach(e, Tier.CPU)
    p.forget(e)
    assert "a" not in p.tenant_bytes


def test_room_reports_capacity_used_and_guarded() -> None:
    p = _placement(cpu=200, disk=200)
    e = _put(p, _entry(0), Tier.DISK)
    assert p.room(300) is None
    p.set_guard(e.key, Guard.NO_DROP)
    assert p.room(301) == (400, 100, 100)
    assert p.lower(Tier.CPU) == (Tier.DISK,) and p.lower(Tier.DISK) == ()
