"""Who may call the sidecar: bearer tokens stored hashed (``sidecar.auth.tokens``),
and TLS and mTLS with tenants taken from client certificates (``sidecar.auth.tls``); per-tenant
limits live in ``sidecar.limits``. ``sidecar.server.tenancy.Tenancy`` is the entry point the server
uses; this package holds the pieces it is built from and never imports the server or the client.

Import the modules themselves: this package imports nothing, so a client (an engine's
environment, without the server's LMCache tiers) can use ``sidecar.auth.tls`` alone.
"""
