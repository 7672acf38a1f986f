"""The content-hash chunk registry behind Lookup and Store (no gRPC here).

::

    chunker         content-defined chunking and chunk fingerprints (numba; Python reference)
    anchors         chunker anchor tokens from a tokenizer's chat template
    entry           ChunkEntry, ChunkHash, EntryState: what is registered per chunk
    registry        InMemoryRegistry: capacity-bounded LRU of entries, token verification
    entry_table     EntryTable: the registry's flat mirror (hash table, arena, seed map)
    seeds           seed windows: entry points into stored chunks finer than a chunk
    lookup_plan     LookupPlan: the one result type of a Lookup
    chunk_index     ChunkIndex: chunker + registry; Lookup, Store registration
    shaping         plan shaping in Python: the reference planner (with ChunkIndex.lookup_reference)
    lookup_kernel   the compiled planner: one numba call over the mirror (+ shaping_kernel),
    shaping_kernel  held to the reference's plans by tests/registry/test_compiled_lookup.py
    shared          the Redis-shared registry (the local registry becomes its near cache)
    shared_keys     its configuration, key names and record format
"""
