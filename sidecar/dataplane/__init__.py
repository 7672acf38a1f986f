"""The data plane: chunk KV in the tiered store, kept consistent with the registry.

``plane`` (``DataPlane``: Lookup, Store, sync with the tiers' events, Evict / Delete, recovery;
the parts below composed), ``intake`` (the checks of a Store: header, parts as they arrive,
commit; payloads staged), ``fetch_query`` (a Fetch from its query to its answers), ``reads``
(chunk reads in windows, rotated), ``spans`` (span items of a Fetch: expanded to chunks, joined
back), ``shards`` and ``cuts`` (items planned under another shard or TP cut), ``held_reads``
(held sessions: FetchSession), ``pool`` (the shared pool's leases and reservations),
``records`` (result types and the payload's ``aux``).
"""

from sidecar.dataplane.fetch_query import FetchAnswer, FetchQuery
from sidecar.dataplane.plane import DataPlane
from sidecar.dataplane.records import DataPlaneCounters, FetchResult, SessionRun, StoreOutcome

__all__ = ["DataPlane", "DataPlaneCounters", "FetchAnswer", "FetchQuery", "FetchResult", "SessionRun", "StoreOutcome"]
