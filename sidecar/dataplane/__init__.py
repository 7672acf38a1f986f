"""The data plane: chunk KV in the tiered store, kept consistent with the registry.

``plane`` (``DataPlane``: Store, sync with the tiers' events, Evict / Delete, recovery),
``intake`` (the checks of a Store: header, parts as they arrive, commit; payloads staged),
``fetch`` (the Fetch path), ``held`` (held sessions: FetchSession), ``spans`` (span items of a
Fetch: expanded to chunks, joined back), ``records`` (result types and the payload's ``aux``).
"""

from sidecar.dataplane.plane import DataPlane
from sidecar.dataplane.records import DataPlaneCounters, FetchResult, SessionRun, StoreOutcome

__all__ = ["DataPlane", "DataPlaneCounters", "FetchResult", "SessionRun", "StoreOutcome"]
