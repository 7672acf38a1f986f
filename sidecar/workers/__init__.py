"""Workers: several sidecar processes on one port, for hosts where one event loop is the limit
(``workers`` setting; docs/operations.md, "Workers")."""

from sidecar.workers.supervisor import Supervisor, worker_flags, worker_path

__all__ = ["Supervisor", "worker_flags", "worker_path"]
