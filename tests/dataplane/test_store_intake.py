"""``StoreIntake`` (sidecar/dataplane/intake.py), the one place a Store is checked: how it stages
payload parts (a chunk in one part is kept as received, a chunk in several is written into one
buffer of its exact size) and that a refused part leaves nothing staged. On a real server's
data plane (chunking by its registry)."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.app import create_server
from sidecar.errors import InvalidArgument
from tests.claims.helpers import BLOCK, IDENT, LAYOUT, blocks, config

PER_CHUNK = LAYOUT.bytes_per_token * BLOCK


@pytest.fixture
async def plane():
    server, _ = await create_server(config(200))
    yield server.dataplane
    await server.stop(0.1)


def intake(plane, n: int = 3):
    tokens = blocks(n, 0)
    return plane.store_intake(tokens, tokens.tobytes(), IDENT, "default", 0, lambda: LAYOUT, 64 << 20)


async def test_parts_are_staged_in_place(plane) -> None:
    it = intake(plane)
    rng = np.random.default_rng(1)
    one = memoryview(rng.integers(0, 256, PER_CHUNK, dtype=np.uint8).tobytes())
    it.add(0, one, True)
    assert it.payloads[0] is one  # a chunk in one part: the received bytes themselves
    whole = rng.integers(0, 256, PER_CHUNK, dtype=np.uint8).tobytes()
    cuts = [0, 1000, 1001, 3000, PER_CHUNK]
    it.add(BLOCK, memoryview(whole)[: cuts[1]], False)
    staged = it.payloads[BLOCK]
    assert len(staged) == PER_CHUNK  # its exact size from the first part on
    for a, b in zip(cuts[1:-1], cuts[2:]):
        it.add(BLOCK, memoryview(whole)[a:b], b == PER_CHUNK)
        assert it.payloads[BLOCK] is staged  # written into place, never regrown
    assert bytes(staged) == whole
    assert it.close(2, 2 * PER_CHUNK) == {0: one, BLOCK: staged}


async def test_refused_part_stages_nothing(plane) -> None:
    it = intake(plane)
    it.add(0, memoryview(b"\1" * 100), False)
    before = (dict(it.payloads), it.nbytes, bytes(it.payloads[0][:100]))
    for start, data, last, field in [
        (0, b"\2" * PER_CHUNK, False, "payload.data"),  # past the chunk's size
        (0, b"\2" * 10, True, "payload.data"),  # ends the chunk short
        (1, b"\2", False, "payload.chunk_start"),  # not a boundary
        (3 * BLOCK, b"\2", False, "payload.chunk_start"),  # past the last chunk
    ]:
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            it.add(start, memoryview(data), last)
        assert (dict(it.payloads), it.nbytes, bytes(it.payloads[0][:100])) == before
    with pytest.raises(InvalidArgument, match="^payload.last"):
        it.close(1, 100)
