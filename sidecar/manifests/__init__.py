"""Warm-start manifests (docs/architecture.md, "Manifests and warm start"; docs/manifests.md).

* ``format``: the JSONL line (``ManifestEntry``, ``encode_line``/``parse_line``/``read_lines``,
  ``merge``; keys recomputed from the tokens, so a line cannot point a key at other content);
* ``producer``: ``ManifestProducer`` appends one line per newly registered chunk from a
  background thread (one ``os.write`` per line on an ``O_APPEND`` fd; rotation by size);
* ``importer``: ``ManifestImporter`` prefetches chunks whose KV a shared tier holds and puts the
  rest in the ``WarmUpPlan`` (token sequences an engine prefills once and Stores);
* ``stream``: publish to / read from a Redis stream;
* ``service``: ``ManifestService``, imports with their scope rules, warm-up plans and export
  behind the RPCs;
* ``config``: ``ManifestsConfig`` (the ``manifests`` section; off by default).

Domain code: nothing here imports the server, the client or the engines.
"""

from sidecar.manifests.config import ManifestsConfig
from sidecar.manifests.format import ManifestEntry, chunk_key, encode_line, merge, parse_line, read_lines
from sidecar.manifests.importer import ImportResult, ManifestImporter, Outcome, WarmUpPlan
from sidecar.manifests.producer import ManifestProducer, ManifestWriter, rotated_paths

__all__ = [
    "ImportResult",
    "ManifestEntry",
    "ManifestImporter",
    "ManifestProducer",
    "ManifestWriter",
    "ManifestsConfig",
    "Outcome",
    "WarmUpPlan",
    "chunk_key",
    "encode_line",
    "merge",
    "parse_line",
    "read_lines",
    "rotated_paths",
]
