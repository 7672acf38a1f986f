"""Rows between host memory and a GPU cache, off vLLM's critical path.

On CUDA a step's loads go through one pinned host buffer and one asynchronous host-to-device
copy on a side stream; the scatters (and the worker's rotation) run on that stream too, and
vLLM's stream waits for it (``publish``) instead of the CPU waiting: the forward is enqueued at
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

    def to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``parts`` (host tensors, any strides) on the device, same shapes and dtypes: on CUDA
        packed into the pinned buffer and sent in one asynchronous copy on the side stream (use
        them under ``context()``); elsewhere returned as they are."""
        if not self.cuda or not parts:
            return parts
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
            self._copied = torch.cuda.Event()
            self._copied.record(self.stream)
        return [dev[o:o + n].view(p.dtype).view(p.shape) for o, n, p in zip(offsets, sizes, parts)]

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
