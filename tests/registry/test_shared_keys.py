"""Shared-registry key names, Cluster slots, record format and configuration (no Redis)."""

from __future__ import annotations

import numpy as np
import pytest
from redis.crc import key_slot

from sidecar.cli import main as cli_main
from sidecar.config import load_config
from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.registry.chunker import ChunkerConfig
from sidecar.registry.entry import ChunkEntry, EntryState, token_digest
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from sidecar.registry.shared_keys import KeySpace, SharedRecord, SharedRegistryConfig, scope_tag
from tests.conftest import ANCHORS, message

IDENT = CacheIdentity(model_id="m")


def lookup_keys(tokens: np.ndarray, scope: str) -> list[bytes]:
    """The Redis keys one Lookup of ``tokens`` by ``scope`` may ask for (own scope + shared)."""
    index = ChunkIndex(ChunkerConfig(anchor_tokens=ANCHORS), InMemoryRegistry(RegistryConfig()))
    chunks = index.chunk(tokens, IDENT, (scope, SHARED_SCOPE))
    ks = KeySpace("kvs")
    return ks.chunk_keys(scope, chunks.fingerprints[0].tolist()) + ks.chunk_keys(
        SHARED_SCOPE, chunks.fingerprints[1].tolist()
    )


def test_a_lookups_keys_fall_on_one_slot_per_scope(rng):
    tokens = np.concatenate([message(rng, 2000, ANCHORS[0]), message(rng, 3000, ANCHORS[1])])
    keys = lookup_keys(tokens, "team-a")
    n = len(keys) // 2
    assert n > 10
    own, shared = {key_slot(k) for k in keys[:n]}, {key_slot(k) for k in keys[n:]}
    assert len(own) == 1 and len(shared) == 1
    # the count key of a scope sits on the scope's slot too
    assert key_slot(KeySpace("kvs").count_key("team-a")) in own


def test_keys_are_scope_salted_and_tagged(rng):
    tokens = message(rng, 1000)
    a, b = lookup_keys(tokens, "team-a"), lookup_keys(tokens, "team-b")
    n = len(a) // 2
    assert not set(a[:n]) & set(b[:n])  # same tokens, other tenant: other keys
    assert a[n:] == b[n:]  # the shared scope's keys are the same for everyone
    assert a[0].startswith(f"kvs:{{{scope_tag('team-a')}}}:".encode())


def test_record_round_trip_and_entry_states():
    tokens = np.arange(100, 164, dtype="<u4").tobytes()
    e = ChunkEntry(key=7, scope="team-a", tokens=tokens, source_pos=40, prefix_digest=123, left_context=b"\x01\0\0\0" * 3,
                   state=EntryState.RESIDENT, tier="cpu")
    rec = SharedRecord.decode(SharedRecord.of(e, "sidecar-a", "127.0.0.1:6379/ns").encode())
    assert rec == SharedRecord("team-a", 40, 123, 64, token_digest(tokens), b"\x01\0\0\0" * 3, True, "cpu", "sidecar-a",
                               "127.0.0.1:6379/ns")
    served = rec.entry(7, servable=True)
    assert (served.state, served.tier, served.tokens, served.num_tokens) == (EntryState.RESIDENT, "remote", b"", 64)
    assert served.matches(tokens) and served.tokens == tokens  # verified by the digest, then adopted
    assert not rec.entry(7, servable=True).matches(tokens[:-4] + b"\xff\0\0\0")
    assert rec.entry(7, servable=False).state is EntryState.OBSERVED
    observed = ChunkEntry(key=8, scope="s", tokens=tokens, source_pos=0, prefix_digest=0, left_context=b"")
    rec2 = SharedRecord.decode(SharedRecord.of(observed, "x", "127.0.0.1:6379/ns").encode())
    assert (rec2.resident, rec2.tier, rec2.shared_tier) == (False, "", "")  # no location for metadata-only


@pytest.mark.parametrize("raw", [b"", b"\x02" + b"\0" * 60, b"\x01" * 10, SharedRecord(
    "s", 0, 0, 1, b"\0" * 16, b"\0\0\0", True, "cpu", "o", "")  # left context not whole tokens
    .encode()])
def test_unreadable_records_are_ignored(raw):
    assert SharedRecord.decode(raw) is None


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("shared_registry.redis_url", "http://127.0.0.1:6379", "shared_registry.redis_url"),
        ("shared_registry.redis_url", "redis://127.0.0.1:notaport", "shared_registry.redis_url"),
        ("shared_registry.redis_url", "redis://:6379", "shared_registry.redis_url"),
        ("shared_registry.key_prefix", "a{b}", "shared_registry.key_prefix"),
        ("shared_registry.timeout_s", 0, "shared_registry.timeout_s"),
        ("shared_registry.max_pending", 0, "shared_registry.max_pending"),
        ("shared_registry.entry_ttl_s", -1, "shared_registry.entry_ttl_s"),
    ],
)
def test_bad_config_names_the_field(key, value, needle, capsys):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        load_config(env={}, overrides={key: value})
    assert cli_main(["config", "--set", f"{key}={value}"]) == 2
    assert needle in capsys.readouterr().err


def test_config_by_flag_and_env_and_off_by_default():
    assert not load_config(env={}).shared_registry.enabled
    cfg = load_config(env={"KV_SIDECAR_SHARED_REGISTRY__CLUSTER": "true"},
                      overrides={"shared_registry.redis_url": "redis://10.0.0.5:7000", "shared_registry.timeout_s": 0.2})
    sr = cfg.shared_registry
    assert (sr.enabled, sr.cluster, sr.redis_url, sr.timeout_s) == (True, True, "redis://10.0.0.5:7000", 0.2)
    assert SharedRegistryConfig().publish_interval_s <= 0.1
