"""Rows between host memory and a GPU cache, off vLLM's critical path.

On CUDA a step's loads go host-to-device asynchronously on a side stream: straight from the
sidecar's shared pool where it is registered as pinned memory (``MappedPool.pin``), else
packed into one pinned host buffer and sent in one copy; the scatters (and the worker's
rotation) run on that stream too, and vLLM's stream waits for it (``publish``) instead of the CPU waiting: the forward is enqueued at
once and runs when the rows are in place. Saves gather on the side stream after the forward's
writes (``gather_async``) into pinned memory, and the background Store waits for that copy alone.
On any other device every method is the plain synchronous path (the CPU backend's cache is host
memory already).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import ContextManager

import torch


class Staging:
    """Host <-> ``device`` copies of one worker (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._buf: torch.Tensor | None = None  # pinned uint8, grown to the largest step
        self._copied: torch.cuda.Event | None = None  # the last copy out of _buf

    def context(self) -> ContextManager:
        """Where the loads' device work runs (the side stream on CUDA)."""
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def to_device(self, parts: list[torch.Tensor], *, registered: bool = False) -> list[torch.Tensor]:
        """``parts`` (host tensors, any strides) on the device, same shapes and dtypes: on CUDA
        sent asynchronously on the side stream (use them under ``context()``); elsewhere returned
        as they are. ``registered``: the parts are views of memory registered with CUDA as
        pinned (the shared pool): each contiguous one goes in its own copy straight from there;
        the others are packed into the pinned buffer and sent in one copy. Call ``synchronize``
        before the host memory may change (a lease's release)."""
        if not self.cuda or not parts:
            return parts
        out: list[torch.Tensor | None] = [None] * len(parts)
        packed = []
        with torch.cuda.stream(self.stream):
            for i, p in enumerate(parts):
                if registered and p.is_contiguous():
                    out[i] = torch.empty(p.shape, dtype=p.dtype, device=self.device).copy_(p, non_blocking=True)
                else:
                    packed.append(i)
        if packed:
            for i, dev in zip(packed, self._packed([parts[i] for i in packed])):
                out[i] = dev
        with torch.cuda.stream(self.stream):
            self._copied = torch.cuda.Event()
            self._copied.record(self.stream)
        return out  # type: ignore[return-value]

    def _packed(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``parts`` through the pinned buffer: packed on the host, one copy to the device."""
        sizes = [p.numel() * p.element_size() for p in parts]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the buffer
        if self._buf is None or self._buf.numel() < total:
            self._buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        offsets, off = [], 0
        for p, n in zip(parts, sizes):
            self._buf[off:off + n].view(p.dtype).view(p.shape).copy_(p)
            offsets.append(off)
            off += n
        with torch.cuda.stream(self.stream):
            dev = self._buf[:total].to(self.device, non_blocking=True)
        return [dev[o:o + n].view(p.dtype).view(p.shape) for o, n, p in zip(offsets, sizes, parts)]

    def synchronize(self) -> None:
        """Wait until the last ``to_device`` copies have read their host memory."""
        if self._copied is not None:
            self._copied.synchronize()

    def publish(self) -> None:
        """vLLM's stream waits for everything the loads enqueued (no CPU wait)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def gather_async(self, gather: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        """Run ``gather`` (device rows) after the forward's writes, into pinned host memory:
        returns the host tensor and a ``wait()`` to call before reading it (on CUDA the copy is
        asynchronous on the side stream; elsewhere ``gather``'s result, already on the host)."""
        if not self.cuda:
            return gather(), _ready
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            rows = gather()
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done.synchronize


def _ready() -> None:
    return None
