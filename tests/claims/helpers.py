"""A real sidecar whose one CPU tier holds exactly ``usable`` blocks of 16 tokens.

Chunking is fixed at 16 tokens (``min_size == max_size``), so one chunk is one block; a block's
payload is 16 x 256 B = 4 KiB, its stored object (4 KiB header + payload) 8 KiB, exactly one
aligned CPU-pool slot. ``resident``/``active`` build disjoint token runs of N blocks."""

from __future__ import annotations

import numpy as np
import torch

from sidecar.app import create_server
from sidecar.claims import ClaimsConfig
from sidecar.client import SidecarClient
from sidecar.config import AuthConfig
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.chunker import ChunkerConfig
from sidecar.registry.entry import EntryState
from sidecar.registry.registry import RegistryConfig
from sidecar.tiers import StoreConfig
from tests.conftest import make_config

BLOCK = 16
LAYOUT = KVLayout.gqa(num_layers=1, num_kv_heads=2, head_dim=32, dtype="float16")  # 256 B per token
IDENT = CacheIdentity(model_id="claims-model", kv_layout=LAYOUT.fingerprint(), rope_fingerprint="rope")
SLOT = 8192  # stored object bytes of one block


def config(usable_blocks: int, **claims_kw):
    # one stored copy per block (registry.copies_per_chunk 1): a block Stored again at another
    # position is the same slot, as in the suite's pool model
    return make_config(
        chunker=ChunkerConfig(min_size=BLOCK, max_size=BLOCK),
        registry=RegistryConfig(copies_per_chunk=1),
        store=StoreConfig(cpu_bytes=usable_blocks * SLOT, pin_wait_s=0.0),
        claims=ClaimsConfig(**claims_kw),
        auth=AuthConfig(shared_writers=("t1",)),  # t1 may Store shared chunks (operator grant)
    )


async def start(usable_blocks: int = 80, **claims_kw):
    server, port = await create_server(config(usable_blocks, **claims_kw))
    return server, f"127.0.0.1:{port}"


def blocks(n: int, base: int) -> np.ndarray:
    """n blocks of distinct tokens (``base`` separates runs)."""
    return (np.arange(n * BLOCK, dtype=np.uint32) + np.uint32(base))


def payloads(tokens: np.ndarray) -> dict[int, torch.Tensor]:
    per = LAYOUT.bytes_per_token * BLOCK
    return {a: torch.full((per,), a % 251, dtype=torch.uint8) for a in range(0, len(tokens), BLOCK)}


async def store(c: SidecarClient, tokens: np.ndarray, shared: bool = False):
    return await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=payloads(tokens), shared=shared)


def held_blocks(server, tokens: np.ndarray, scope: str = "t1") -> tuple[int, int]:
    """(leading blocks held from position 0, blocks held anywhere) of ``tokens``: the registry's
    view (RESIDENT = some tier holds the payload). Read directly: any Lookup or Fetch that
    would tell would also refresh recency and change what is evicted next."""
    entries, _ = server.index.entries(tokens, tokens.astype("<u4").tobytes(), IDENT, scope)
    held = [(e := server.index.registry.peek(x.key)) is not None and e.state is EntryState.RESIDENT for x in entries]
    leading = next((i for i, h in enumerate(held) if not h), len(held))
    return leading, sum(held)


async def events(c: SidecarClient) -> list:
    return [e async for e in c.watch_events()]
