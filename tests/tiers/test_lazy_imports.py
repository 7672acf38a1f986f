"""``sidecar.tiers`` resolves its names on first use: the configuration's names do not import
torch or LMCache, the store's do, and every exported name resolves. Reading the sidecar's
configuration (what the workers supervisor does) imports neither."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
import sidecar.config
assert not ({"torch", "lmcache"} & set(sys.modules)), "sidecar.config imported torch or LMCache"
import sidecar.tiers as tiers
from sidecar.tiers import Guard, RemoteEndpoint, StoreConfig, TenantQuota, Tier, chunk_key
from sidecar.tiers.disk_index import DiskIndex
light = not ({"torch", "lmcache"} & set(sys.modules))
from sidecar.tiers import TieredStore
from sidecar.tiers.store import TieredStore as Direct, Guard as StoreGuard
assert TieredStore is Direct and Guard is StoreGuard
assert all(getattr(tiers, name) is not None for name in tiers.__all__)
assert set(tiers.__all__) <= set(dir(tiers))
try:
    tiers.NoSuchName
except AttributeError:
    pass
else:
    raise AssertionError("unknown names must raise AttributeError")
print(light, "torch" in sys.modules)
"""


def test_config_names_import_without_torch_and_every_name_resolves() -> None:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
