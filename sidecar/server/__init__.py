"""The gRPC transport: one module of handlers per API area, registered from the service descriptor.

``kv`` (Lookup, Store, Fetch, Evict, Delete, Stats, Ping), ``sessions`` (sessions, Splice,
FetchSession), ``claims`` (resident claims), ``manifests`` (warm start); ``edge`` (what every
handler shares: tenant, stream slot, the status of an error), ``service`` (registration),
``tenancy``, ``metrics`` (the Prometheus exporter: only here, at the edge).

Handlers translate wire <-> domain through ``sidecar.api`` and call domain code; the parts are
built and wired by the composition root, ``sidecar.app`` (``create_server``, ``ServerThread``).
"""
