"""One process's connection to the sidecar: a client per tenant, errors counted, never raised.

A request must never fail because the sidecar is slow, down or refuses a call: every call goes
through ``SidecarLink.call``, which returns ``None`` on any error (the caller prefills instead),
logs the first failure of an outage once, and then skips the sidecar for ``retry_after_s``
(so a down sidecar costs one connection attempt per window, not one per request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, TypeVar

from sidecar.client import RetryPolicy, SyncSidecarClient

from clients.vllm.settings import Settings

log = logging.getLogger("clients.vllm")
T = TypeVar("T")


class SidecarLink:
    def __init__(self, settings: Settings, role: str) -> None:
        self.settings = settings
        self.role = role
        self._clients: dict[str, SyncSidecarClient] = {}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.errors: Counter[str] = Counter()

    def client(self, tenant: str | None) -> SyncSidecarClient:
        # "" (mTLS with the tenant taken from the client certificate): no tenant header at all
        tenant = tenant or self.settings.tenant or None
        with self._lock:
            c = self._clients.get(tenant)
            if c is None:
                s = self.settings
                c = SyncSidecarClient(s.target, tenant=tenant, token=s.token, timeout_s=s.timeout_s,
                                      retry=RetryPolicy(attempts=1), tls=s.tls, root_ca=s.root_ca,
                                      client_cert=s.client_cert, client_key=s.client_key)
                self._clients[tenant] = c
            return c

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def call(self, what: str, tenant: str | None, fn: Callable[[SyncSidecarClient], T]) -> T | None:
        if not self.available:
            self.errors[f"{what}:skipped"] += 1
            return None
        try:
            out = fn(self.client(tenant))
        except Exception as exc:  # noqa: BLE001 - any failure means "prefill instead"
            self.errors[what] += 1
            self._down_until = time.monotonic() + self.settings.retry_after_s
            if not self._down:
                self._down = True
                log.warning("sidecar %s (%s side): %s failed (%s: %s); prefilling, retrying in %.0f s",
                            self.settings.target, self.role, what, type(exc).__name__, exc,
                            self.settings.retry_after_s)
            return None
        if self._down:
            self._down = False
            log.warning("sidecar %s (%s side) is answering again", self.settings.target, self.role)
        return out

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
            self._clients.clear()
