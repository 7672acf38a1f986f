"""The shared-memory data plane: Fetch payloads handed to an engine on the sidecar's host
through a buffer in ``/dev/shm`` instead of the gRPC stream.

Why: an 8K-token Fetch of a small model is ~32 MB. Over loopback gRPC those bytes are copied
about six times between the tier and the engine (frame, socket out, socket in, gRPC's receive
buffer, the client's payload buffer); through a buffer the sidecar writes each payload once and
the engine reads it in place (docs/operations.md, "Shared-memory Fetch", has the measurements).

The protocol (proto ``SharedMemory``):

* the client creates ``/dev/shm/kvsc-<32 hex digits>`` (mode 0600), writes ``MAGIC`` and a
  random 16-byte token at its start, and names buffer and token in a Fetch or FetchSession;
* the sidecar opens the file by name (no symlinks, a regular file with one link on the same
  filesystem as ``/dev/shm``, the token must match), writes each payload after the header with
  ``pwrite``, and answers ``shm_offset`` / ``shm_length`` instead of the bytes. It never maps the
  buffer: a client that truncates it cannot crash the sidecar with SIGBUS;
* a payload that does not fit, a write that fails (a full tmpfs), a caller that is not on
  loopback or a unix socket, or ``fetch_shared_memory: false`` gets the bytes inline, as
  without a buffer: the client handles both in one call;
* one buffer per call in flight: the client's ``SegmentPool`` lends a buffer to a call and takes
  it back once no payload view into it is referenced, so results stay valid while held.

Files: ``segment.py`` (the client's buffers and their pool), ``writer.py`` (the sidecar's side).
"""

from sidecar.shm.segment import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    NAME_PATTERN,
    SHM_DIR,
    TOKEN_BYTES,
    Lease,
    Segment,
    SegmentPool,
    local_target,
)
from sidecar.shm.writer import ShmWriter, local_peer, open_writer

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "MAGIC",
    "NAME_PATTERN",
    "SHM_DIR",
    "TOKEN_BYTES",
    "Lease",
    "Segment",
    "SegmentPool",
    "ShmWriter",
    "local_peer",
    "local_target",
    "open_writer",
]
