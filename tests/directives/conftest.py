"""Keep hypothesis's cache (it scans source constants even without an example database) out
of the working tree: the directives suite must not write into the repository."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import configuration

configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "kv-sidecar-hypothesis")
