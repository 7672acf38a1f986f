"""Seeds: entry points into stored chunks finer than a chunk.

A chunk hit needs the prompt to be cut exactly where the stored sequence was cut. A short
document moved inside one message has no content-defined cut of its own: its chunk always
straddles the neighbouring documents, which change with the order, so it never matches. Seeds
find such text anyway::

    stored chunk   ....[ doc B ......... | doc C ... ]....        one chunk, cut elsewhere
    seed windows          ^w      ^w          ^w                   16-token windows chosen by content
    prompt         [doc C ...][ doc B ........... ][doc A ...]     same windows, found by hash
                              <---- extended ---->                 token by token, both ways

* **Windows.** Every ``SEED_TOKENS``-token window whose hash has its top ``bits`` bits zero is
  a seed (one in ``2**bits`` windows, ``registry.seed_interval``). The choice depends on
  the window's tokens only, so the same text yields the same seeds wherever it sits.
* **The seed map** (``entry_table.EntryTable``, kept with the mirror): seed key -> (slot, row) of
  the stored chunk holding the window, for every window inside a chunk whose tokens are known.
  Keys mix the window hash with the scope, so tenants never share an entry. The last chunk
  registered with a window owns it; deleting a chunk removes the windows it owns.
* **Lookup** (``lookup_kernel.plan_chunks`` and the reference ``chunk_index.lookup_reference``): after
  chunk hits are coalesced and extended, the prompt tokens no run reached are scanned for
  seeds. A seed is used when its chunk is in the caller's scope (or shared), served (RESIDENT;
  OBSERVED too for dry runs), the window's tokens equal the stored ones, and the chunk's key is
  the one this identity computes for its tokens (``chunk_key``): a window shared with another
  model's chunk is never served. The hit is extended token by token inside the chunk, then
  shaped like chunk hits (extension into stored neighbours, repair, carve-out, folding).

Memory: a map cell is 16 bytes and the map is 1/4 to 1/2 full (it doubles at 1/2), so 32-64
bytes a seed: 1-2 bytes a stored token at the default interval of 32, outside
``registry.capacity_bytes`` (``kv_sidecar_registry_seeds`` counts them).
"""

from __future__ import annotations

import numba
import numpy as np

from sidecar.registry.chunker import _chain, _xxh64_tokens

#: tokens in a seed window; also the shortest text a seed can recover
SEED_TOKENS = 16
#: a seed's row in its chunk is packed in the low bits of the map value (slot << ROW_BITS | row)
ROW_BITS = 16

_U = np.uint64
_W = SEED_TOKENS
_K1 = _U(0x9E3779B97F4A7C15)
_K2 = _U(0xC2B2AE3D27D4EB4F)
_K3 = _U(0x165667B19E3779F9)
_ROW_MASK = (1 << ROW_BITS) - 1


def interval_bits(interval: int) -> int:
    """``registry.seed_interval`` as the number of hash bits a seed must have zero; -1 = off."""
    if interval == 0:
        return -1
    if interval < 0 or interval & (interval - 1):
        raise ValueError(f"registry.seed_interval must be 0 or a power of two, got {interval}")
    return interval.bit_length() - 1


@numba.njit(inline="always")
def _fmix(k):
    k ^= k >> _U(33)
    k *= _U(0xFF51AFD7ED558CCD)
    k ^= k >> _U(33)
    k *= _U(0xC4CEB9FE1A85EC53)
    k ^= k >> _U(33)
    return k


@numba.njit(cache=True, nogil=True)
def windows(tok, lo, hi, bits):
    """The seed windows inside ``tok[lo:hi]``: their start positions (int64) and mixed hashes
    (uint64), in order. ``bits``: see ``interval_bits`` (>= 0). The window hash shifts each
    token in by 4 bits, so a token leaves it after 16 steps (the hash is a function of the
    window's tokens only) and the loop carries one shift-add (~1 ns a token); a window is
    chosen by the top bits of its hash times an odd constant, and only chosen ones are mixed."""
    count = hi - lo - _W + 1
    if count <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint64)
    pos = np.empty(count, dtype=np.int64)
    mix = np.empty(count, dtype=np.uint64)
    shift = _U(64 - bits) if bits > 0 else _U(0)
    h = _U(0)
    for i in range(_W - 1):
        h = (h << _U(4)) + _U(tok[lo + i])
    c = 0
    for p in range(lo, lo + count):
        h = (h << _U(4)) + _U(tok[p + _W - 1])
        if bits == 0 or ((h * _K2) >> shift) == _U(0):
            pos[c] = p
            mix[c] = _fmix(h ^ _K1)
            c += 1
    return pos[:c], mix[:c]


@numba.njit(inline="always")
def seed_key(mix, scope_id):
    """The map key of a window (``mix`` from ``windows``) in one scope (the mirror's scope id)."""
    return _fmix(mix ^ ((_U(scope_id) + _U(1)) * _K3))


@numba.njit(cache=True, nogil=True)
def chunk_key(tok, a, b, scope_seed, chain_seed):
    """The registry key the chunker gives tokens ``tok[a:b]`` as one chunk under an identity
    (``chain_seed``: its salt) in a scope (``scope_seed``): ``chunker._digests``' key."""
    return _chain(scope_seed, _xxh64_tokens(tok, a, b, chain_seed))


def unpack(value: int) -> tuple[int, int]:
    """(slot, row) of a map value."""
    return value >> ROW_BITS, value & _ROW_MASK
