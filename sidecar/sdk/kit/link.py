"""A fail-soft link to the sidecar: one client per tenant, errors counted, never raised.

A request must never fail because the sidecar is slow, down or refuses a call: every call goes
through ``FailSoftLink.call``, which returns ``None`` on any error (the caller prefills
instead), logs the first failure of an outage once, and then skips the sidecar for
``retry_after_s`` (so a down sidecar costs one connection attempt per window, not one per
request). ``retry_after_s = 0`` retries on the next call.

Thread-safe: a connector's scheduler and a background Store thread may share one link.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Generic, TypeVar

C = TypeVar("C")  # the client type (``SyncSidecarClient``, or a test double)
T = TypeVar("T")

_log = logging.getLogger("sidecar.sdk.kit")


class FailSoftLink(Generic[C]):
    """Calls to the sidecar that answer ``None`` instead of raising.

    ``connect(tenant)`` makes the client of one tenant (``None``: no tenant header at all, as
    with mTLS where the tenant comes from the client certificate); it is called once per tenant
    and the client is kept until ``close``. ``default_tenant`` is used for calls naming none.
    ``target`` and ``role`` only label the log lines.
    """

    def __init__(
        self,
        connect: Callable[[str | None], C],
        *,
        default_tenant: str | None,
        retry_after_s: float,
        target: str,
        role: str,
        log: logging.Logger | None = None,
    ) -> None:
        self._connect = connect
        self.default_tenant = default_tenant
        self.retry_after_s = retry_after_s
        self.target = target
        self.role = role
        self._log = log or _log
        self._clients: dict[str | None, C] = {}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        #: failed calls by name, and ``"<name>:skipped"`` for calls skipped while down
        self.errors: Counter[str] = Counter()

    def client(self, tenant: str | None) -> C:
        """The client of ``tenant`` (or of the default tenant), made on first use."""
        # "" (mTLS with the tenant taken from the client certificate): no tenant header at all
        key = tenant or self.default_tenant or None
        with self._lock:
            c = self._clients.get(key)
            if c is None:
                c = self._clients[key] = self._connect(key)
            return c

    @property
    def available(self) -> bool:
        """False while skipping the sidecar after a failed call."""
        return time.monotonic() >= self._down_until

    def call(self, what: str, tenant: str | None, fn: Callable[[C], T]) -> T | None:
        """``fn(client)``, or ``None`` if it raised or the sidecar is being skipped."""
        if not self.available:
            self.errors[f"{what}:skipped"] += 1
            return None
        try:
            out = fn(self.client(tenant))
        except Exception as exc:  # noqa: BLE001 - any failure means "prefill instead"
            self.errors[what] += 1
            self._down_until = time.monotonic() + self.retry_after_s
            if not self._down:
                self._down = True
                self._log.warning("sidecar %s (%s side): %s failed (%s: %s); prefilling, retrying in %.0f s",
                                  self.target, self.role, what, type(exc).__name__, exc, self.retry_after_s)
            return None
        if self._down:
            self._down = False
            self._log.warning("sidecar %s (%s side) is answering again", self.target, self.role)
        return out

    def close(self) -> None:
        """Close every client (errors ignored); a later call connects again."""
        with self._lock:
            for c in self._clients.values():
                try:
                    c.close()  # type: ignore[attr-defined]
                except Exception:  # noqa: BLE001
                    pass
            self._clients.clear()
