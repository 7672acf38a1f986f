"""An engine that dies holding the shared pool: run by ``tests/pool/test_pool_safety.py``.

``python -m tests.pool.engine_proc TARGET LEASED.npy RESERVED.npy``: leases every hit of the
tokens in LEASED.npy (never releasing them), reserves slots for the tokens in RESERVED.npy and
writes half of the first one (never committing), prints ``ready <chunks leased> <slots>`` and
sleeps until it is killed.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from sidecar.client import SyncSidecarClient
from sidecar.sdk.pool import PoolClient
from tests.dataplane.test_dataplane import IDENT, LAYOUT


def main(target: str, leased_path: str, reserved_path: str) -> None:
    leased = np.load(leased_path)
    reserved = np.load(reserved_path)
    c = SyncSidecarClient(target, tenant="a")
    pool = PoolClient(c)
    plan = c.lookup(leased, identity=IDENT, recompute_tokens=0)
    fetched = pool.lease([(h.chunk_hash, h.start - h.chunk_offset) for h in plan.hits()], identity=IDENT,
                         layout=LAYOUT)
    w = pool.reserve(reserved, identity=IDENT, layout=LAYOUT)
    first = w.slots[min(w.slots)]
    first[: first.numel() // 2].fill_(0xAB)
    chunks = sum(len(it.chunks) for it in fetched.items)
    print(f"ready {chunks} {len(w.slots)}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:4])
