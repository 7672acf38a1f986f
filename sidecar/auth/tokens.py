"""Bearer tokens as the configuration stores them: ``sha256:<hex>`` digests (or plaintext).

``auth.tokens`` maps a token entry to the tenants it may act as. An entry is either

* ``sha256:<64 hex digits>``: the SHA-256 of the token (``kv-sidecar auth hash-token`` prints
  it), so a leaked configuration file does not leak a usable credential; or
* the token itself (plaintext): still accepted, with a warning at startup.

Why SHA-256 and not a salted slow KDF (scrypt, PBKDF2): the tokens are random secrets (``kv-sidecar
auth hash-token --generate`` draws 256 bits from ``secrets``; the helper refuses tokens shorter
than ``MIN_TOKEN_CHARS``), not passwords. Guessing a 256-bit secret from its digest is as hard as
guessing it outright, so salting or stretching buys nothing against an offline attacker, while a
slow KDF on every call would cost each request (and each unknown token an attacker sends) tens
of milliseconds of CPU, or force a cache of presented secrets. One SHA-256 of the presented token
(under a microsecond for a 43-character token) and one dict probe keep the hot path O(1) and
allocation-light, so no verification cache is needed.

Comparison: the table is indexed by the digest's first 8 bytes and the full 32-byte digest is
then compared with ``hmac.compare_digest``. Timing can at most reveal how much of SHA-256 of
the attacker's own guess matches a stored digest, which does not help find a preimage.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import NewType

#: A token entry's 32-byte SHA-256 digest.
TokenDigest = NewType("TokenDigest", bytes)

HASH_PREFIX = "sha256:"
#: ``hash-token`` refuses shorter tokens: entropy, not hashing, is what protects a token.
MIN_TOKEN_CHARS = 16
_PROBE = 8  # bytes of the digest used as the dict key


def digest(token: str) -> TokenDigest:
    return TokenDigest(hashlib.sha256(token.encode()).digest())


def hash_token(token: str) -> str:
    """The ``auth.tokens`` entry for ``token``: ``sha256:<hex>``."""
    return HASH_PREFIX + digest(token).hex()


def generate_token() -> str:
    """A new random bearer token (256 bits, URL-safe base64, 43 characters)."""
    return secrets.token_urlsafe(32)


def is_hashed(entry: str) -> bool:
    return entry.startswith(HASH_PREFIX)


def parse_entry(entry: str) -> TokenDigest:
    """The digest a configured entry stands for; ``ValueError`` naming the entry if malformed.

    A malformed ``sha256:`` entry is never taken as a plaintext token (a typo must not turn a
    hash into a password)."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"auth.tokens: token entries must be non-empty strings, got {entry!r}")
    if is_hashed(entry):
        hexpart = entry[len(HASH_PREFIX) :]
        if len(hexpart) != 64:
            raise ValueError(
                f"auth.tokens: entry {entry[:16]!r}... is not sha256:<64 hex digits> ({len(hexpart)} digits); "
                "generate entries with `kv-sidecar auth hash-token`"
            )
        try:
            return TokenDigest(bytes.fromhex(hexpart))
        except ValueError:
            raise ValueError(
                f"auth.tokens: entry {entry[:16]!r}... is not sha256:<64 hex digits> (non-hex characters)"
            ) from None
    return digest(entry)


class TokenTable:
    """Presented bearer token -> the tenants it may act as (see the module docstring).

    Built once from ``auth.tokens``; ``allowed`` is O(1) per call and safe to call from the
    event loop (no I/O, no locks). ``plaintext_entries`` counts entries stored in clear (the
    server warns about them at startup)."""

    def __init__(self, tokens: Mapping[str, tuple[str, ...]]) -> None:
        self._by_probe: dict[bytes, list[tuple[TokenDigest, tuple[str, ...]]]] = {}
        self.plaintext_entries = 0
        seen: set[bytes] = set()
        for entry, tenants in tokens.items():
            d = parse_entry(entry)
            if d in seen:
                raise ValueError(
                    f"auth.tokens: entry {entry[:16]!r}... names a token that another entry already names "
                    "(a token and its sha256: form, or the same hash twice)"
                )
            seen.add(d)
            if not is_hashed(entry):
                self.plaintext_entries += 1
            self._by_probe.setdefault(d[:_PROBE], []).append((d, tuple(tenants)))

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_probe.values())

    def allowed(self, token: str) -> tuple[str, ...] | None:
        """Tenants ``token`` may act as, or None for an unknown token."""
        d = digest(token)
        for stored, tenants in self._by_probe.get(d[:_PROBE], ()):
            if hmac.compare_digest(stored, d):
                return tenants
        return None
