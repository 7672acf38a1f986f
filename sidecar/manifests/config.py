"""Settings of the ``manifests`` section (off by default: no ``path``, nothing imported)."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.identity import SHARED_SCOPE


@dataclass(frozen=True, kw_only=True)
class ManifestsConfig:
    """Producer and startup import (docs/manifests.md).

    Producer: ``path`` (None: off) receives one line per newly registered chunk, written by a
    background thread every ``flush_interval_s``; the file rotates past ``max_bytes`` keeping
    ``keep`` older files; ``counts_interval_s`` (0: only at shutdown) writes count updates;
    ``fsync`` also syncs each batch to the device (machine crashes; off: process crashes lose at
    most the line being written either way).

    Startup import (an operator action: entries keep the scope their line names; lines without
    one go to ``import_scope``): ``import_paths`` (files, each read with its rotated siblings,
    oldest first) and ``import_redis_url`` + ``import_redis_stream`` (every entry of that
    stream, XRANGE in batches of ``import_batch``). ``prefetch``: read KV that a shared (remote)
    tier holds into the local tiers; what cannot be prefetched becomes the warm-up plan.
    """

    path: str | None = None
    max_bytes: int = 64 << 20
    keep: int = 3
    flush_interval_s: float = 0.2
    counts_interval_s: float = 60.0
    fsync: bool = False
    import_paths: tuple[str, ...] = ()
    import_redis_url: str | None = None
    import_redis_stream: str = ""
    import_scope: str = SHARED_SCOPE
    import_batch: int = 1000
    prefetch: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "import_paths", tuple(self.import_paths))
        if self.max_bytes < 4096:
            raise ValueError(f"manifests.max_bytes must be >= 4096, got {self.max_bytes}")
        if self.keep < 0:
            raise ValueError(f"manifests.keep must be >= 0, got {self.keep}")
        if not self.flush_interval_s > 0:
            raise ValueError(f"manifests.flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.counts_interval_s < 0:
            raise ValueError(f"manifests.counts_interval_s must be >= 0, got {self.counts_interval_s}")
        if self.import_batch < 1:
            raise ValueError(f"manifests.import_batch must be >= 1, got {self.import_batch}")
        if bool(self.import_redis_url) != bool(self.import_redis_stream):
            raise ValueError("manifests.import_redis_url and manifests.import_redis_stream go together")
        if not self.import_scope:
            raise ValueError("manifests.import_scope must be a tenant id or 'shared'")
