"""KV-aware routing: which replica holds which chunk (``residency``), and per candidate replica
how much of a prompt it could serve from cache (``score``), planned by the Lookup planner.

A replica is the engine (or pod) a sidecar sits next to, named by ``routing.replica_id``. Its
sidecar publishes, through the shared registry's Redis, a heartbeat with a TTL and, per chunk it
holds, the tier and the canonical position of its copy. Any sidecar answers ``Score`` (and llm-d's
``GetPodScores``, ``llmd``) for a fleet of candidates with one pipelined Redis round trip.
"""

from sidecar.routing.config import ModelConfig, RoutingConfig

__all__ = ["ModelConfig", "RoutingConfig"]
