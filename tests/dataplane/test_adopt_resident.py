"""RESIDENT state has one writer outside the registry: the data plane. ``DataPlane.adopt_resident``
takes in a chunk whose payload the tiers already hold (a manifest import's prefetch), and no
other package sets an entry's state. Real registry, real tiers."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np

from sidecar.app import build
from sidecar.identity import CacheIdentity
from sidecar.registry.entry import EntryState
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[2]
IDENT = CacheIdentity(model_id="adopt-model", kv_layout="", rope_fingerprint="rope")
#: the registry keeps its own entries' state; the data plane keeps it true to the tiers
STATE_WRITERS = ("sidecar/registry/", "sidecar/dataplane/")


def test_adopt_inserts_a_new_chunk_resident_at_its_tier():
    dp = build(make_config()).dataplane
    tokens = np.arange(1, 301, dtype=np.uint32)
    entries, _ = dp.index.entries(tokens, tokens.astype("<u4").tobytes(), IDENT, "t")
    e = dataclasses.replace(entries[0], state=EntryState.RESIDENT, tier="disk")
    assert dp.adopt_resident(e) is True
    got = dp.index.registry.peek(e.key)
    assert got is not None and (got.state, got.tier) == (EntryState.RESIDENT, "disk")
    assert dp.adopt_resident(dataclasses.replace(e)) is False  # known here: not new


def test_adopt_upgrades_an_observed_entry_to_the_stored_copy():
    dp = build(make_config()).dataplane
    tokens = np.arange(1, 301, dtype=np.uint32)
    data = tokens.astype("<u4").tobytes()
    dp.index.register(tokens, data, IDENT, "t")  # metadata only: OBSERVED
    old = dp.index.registry.peek(dp.index.entries(tokens, data, IDENT, "t")[0][0].key)
    assert old is not None and old.state is EntryState.OBSERVED
    stored = dataclasses.replace(old, state=EntryState.RESIDENT, tier="cpu", source_pos=old.source_pos + 40,
                                 prefix_digest=12345, left_context=b"\x01\x00\x00\x00")
    assert dp.adopt_resident(stored) is False
    now = dp.index.registry.peek(old.key)
    assert now is old  # the same entry, now describing the stored copy
    assert (now.state, now.tier, now.source_pos, now.prefix_digest, now.left_context) == (
        EntryState.RESIDENT, "cpu", stored.source_pos, 12345, b"\x01\x00\x00\x00"
    )


def test_only_the_registry_and_the_data_plane_set_entry_state():
    writers = []
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(STATE_WRITERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_state":
                writers.append(f"{rel}:{node.lineno}")
    assert writers == [], f"entry state written outside the registry and the data plane: {writers}"
