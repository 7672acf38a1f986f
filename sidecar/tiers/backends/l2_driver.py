"""Blocking batch calls over one LMCache L2 adapter (used by the disk and remote backends).

LMCache's L2 adapters are non-blocking (submit a task, poll an eventfd, pop the result).
``L2Driver`` turns one adapter into blocking batch calls with timeouts: a dispatcher thread
polls the adapter's eventfds and wakes waiters; buffers of a task that timed out stay referenced
until the adapter reports it, so a late completion never writes into freed memory.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Sequence

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd

logger = logging.getLogger(__name__)


def wrap_host_buffer(buf: torch.Tensor) -> TensorMemoryObj:
    """An LMCache ``MemoryObj`` over a contiguous 1-D uint8 CPU tensor (no copy, no allocator)."""
    assert buf.device.type == "cpu" and buf.dtype == torch.uint8 and buf.is_contiguous(), (
        "L2 adapters read and write host memory only; stage device data through the CPU first"
    )
    meta = MemoryObjMetadata(
        shape=buf.shape,
        dtype=torch.uint8,
        address=0,
        phy_size=buf.numel(),
        ref_count=1,
        fmt=MemoryFormat.BINARY_BUFFER,
    )
    return TensorMemoryObj(buf, meta, None)


class L2Driver:
    """Blocking, thread-safe batch calls over one LMCache L2 adapter."""

    def __init__(self, adapter: L2AdapterInterface, name: str) -> None:
        self._adapter = adapter
        self._cv = threading.Condition()
        self._stores: dict[int, bool] = {}
        self._loads: dict[int, list[bool]] = {}
        self._lookups: dict[int, list[bool]] = {}
        self._pending_stores: set[int] = set()
        self._pending_loads: dict[int, int] = {}
        self._pending_lookups: dict[int, list[ObjectKey]] = {}
        self._keepalive: dict[tuple[str, int], object] = {}
        self._abandoned: set[tuple[str, int]] = set()
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sidecar-{name}-io", daemon=True)
        self._thread.start()

    # -- dispatcher ---------------------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        fds = (
            self._adapter.get_store_event_fd(),
            self._adapter.get_load_event_fd(),
            self._adapter.get_lookup_and_lock_event_fd(),
        )
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            # The timeout bounds the damage of a missed wake-up; results are re-polled anyway.
            try:
                for fd, _ in poller.poll(50):
                    consume_fd(fd)
            except OSError as exc:
                # The adapter's eventfds were closed under a late poll (by close(), or by the
                # adapter itself when its connection died): this dispatcher is done; waiters of
                # its tasks time out and the tier replaces the connection.
                if not self._stop.is_set():
                    logger.warning("L2 dispatcher stopped: adapter event fd closed (%s)", exc)
                return
            try:
                self._collect()
            except Exception:  # the adapter is closing or broken: waiters time out
                logger.exception("L2 dispatcher failed to collect completions")

    def _collect(self) -> None:
        stores = self._adapter.pop_completed_store_tasks()
        with self._cv:
            loads = dict(self._pending_loads)
            lookups = dict(self._pending_lookups)
        done_loads = {}
        for tid, n in loads.items():
            bm = self._adapter.query_load_result(tid)
            if bm is not None:
                done_loads[tid] = [bm.test(i) for i in range(n)]
        done_lookups = {}
        for tid, keys in lookups.items():
            bm = self._adapter.query_lookup_and_lock_result(tid)
            if bm is not None:
                found = [bm.test(i) for i in range(len(keys))]
                # The native adapter "locks" found keys with a client-side refcount; release them
                # at once, the store has its own readers.
                self._adapter.submit_unlock([k for k, f in zip(keys, found) if f])
                done_lookups[tid] = found
        if not (stores or done_loads or done_lookups):
            return
        with self._cv:
            self._pending_stores.difference_update(stores)
            for tid in done_loads:
                del self._pending_loads[tid]
            for tid in done_lookups:
                del self._pending_lookups[tid]
            store_ok = {tid: bool(r.is_successful()) for tid, r in stores.items()}
            for kind, results, target in (
                ("store", store_ok, self._stores),
                ("load", done_loads, self._loads),
                ("lookup", done_lookups, self._lookups),
            ):
                for tid, result in results.items():
                    self._keepalive.pop((kind, tid), None)
                    if (kind, tid) in self._abandoned:
                        self._abandoned.discard((kind, tid))
                    else:
                        target[tid] = result
            self._cv.notify_all()

    def _fail_pending(self) -> None:
        """Resolve every in-flight task as failed (the adapter is being abandoned)."""
        with self._cv:
            for tid in self._pending_stores:
                self._stores[tid] = False
            for tid in self._pending_loads:
                self._loads[tid] = None
            for tid in self._pending_lookups:
                self._lookups[tid] = None
            self._pending_stores.clear()
            self._pending_loads.clear()
            self._pending_lookups.clear()
            self._closed = True
            self._cv.notify_all()

    def _wait(self, kind: str, tid: int, results: dict, timeout: float):
        with self._cv:
            if self._closed and tid not in results:
                return None
            if not self._cv.wait_for(lambda: tid in results, timeout=timeout):
                self._abandoned.add((kind, tid))
                return None
            return results.pop(tid)

    # -- blocking calls -------------------------------------------------------------------------

    def store(self, keys: Sequence[ObjectKey], bufs: Sequence[torch.Tensor], timeout: float) -> bool:
        """Write every buffer (one task; success is all-or-nothing as LMCache reports it)."""
        objs = [wrap_host_buffer(b) for b in bufs]
        with self._cv:
            if self._closed:
                return False
            tid = self._adapter.submit_store_task(list(keys), objs)
            self._pending_stores.add(tid)
            self._keepalive[("store", tid)] = objs
        ok = self._wait("store", tid, self._stores, timeout)
        return bool(ok)

    def load(self, keys: Sequence[ObjectKey], bufs: Sequence[torch.Tensor], timeout: float) -> list[bool] | None:
        """Read each key into its buffer (sizes must match exactly); per-key success, or
        ``None`` when the backend did not answer within ``timeout``."""
        if not keys:
            return []
        objs = [wrap_host_buffer(b) for b in bufs]
        with self._cv:
            if self._closed:
                return None
            tid = self._adapter.submit_load_task(list(keys), objs)
            self._pending_loads[tid] = len(keys)
            self._keepalive[("load", tid)] = objs
        return self._wait("load", tid, self._loads, timeout)

    def exists(self, keys: Sequence[ObjectKey], timeout: float) -> list[bool] | None:
        """Per-key existence; ``None`` when the backend did not answer in time."""
        if not keys:
            return []
        with self._cv:
            if self._closed:
                return None
            tid = self._adapter.submit_lookup_and_lock_task(list(keys), {})
            self._pending_lookups[tid] = list(keys)
        return self._wait("lookup", tid, self._lookups, timeout)

    def delete(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> bool:
        """Delete ``keys`` (best effort). LMCache's adapter blocks up to 30 s on a dead
        connection, so with ``timeout`` the call runs on a helper thread and is abandoned past
        it; returns False then (the caller treats the connection as failed)."""
        if not keys:
            return True
        if timeout is None:
            self._adapter.delete(list(keys))
            return True
        t = threading.Thread(target=self._adapter.delete, args=(list(keys),), name="kv-sidecar-l2-delete", daemon=True)
        t.start()
        t.join(timeout)
        return not t.is_alive()

    def close(self, timeout: float) -> bool:
        """Stop the dispatcher and close the adapter; never blocks past ``timeout``. Waiters of
        tasks still in flight return as failed at once."""
        self._stop.set()
        self._thread.join(timeout)
        self._fail_pending()
        closer = threading.Thread(target=self._adapter.close, name="kv-sidecar-l2-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            logger.warning(
                "L2 adapter %s did not close within %.1f s; abandoned", type(self._adapter).__name__, timeout
            )
            return False
        return True
