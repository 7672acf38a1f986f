"""SGLang integrations for KV Sidecar (docs/sglang.md).

* ``clients.sglang.hicache.SidecarHiCacheStorage``: a HiCache L3 storage backend for SGLang's
  dynamic storage factory; pages live in the sidecar's tiers, shared by engines on any host.
* ``clients.sglang.radix``: a radix-cache backend plug-in (``--radix-cache-backend
  kv_sidecar``) that adds the sidecar's content-hash hits (shifted chunks, RoPE-rotated) and
  Splice directive plans to SGLang's token-granular pools.

Both import SGLang; nothing is imported here so ``import clients.sglang`` stays cheap.
"""
