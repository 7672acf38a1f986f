"""The ``kv-sidecar`` command: ``serve`` (``main``), ``token``, ``config``, ``manifest`` (``manifest``)."""

from sidecar.cli.main import main

__all__ = ["main"]
