"""Host copies of offloaded storages: pinned buffers and side streams on CUDA."""

from __future__ import annotations

from typing import Any

import torch

from slackswap.runtime.stats import RuntimeStats

__all__ = ["HostCopies"]


class HostCopies:
    """Host copies. On CUDA: pinned buffers, offloads on a D2H stream and reloads on an
    H2D stream (a pair per device), the compute stream waiting on a reload's event only
    when it needs the tensor; ``record_stream`` tells the caching allocator not to reuse
    memory a copy still reads or writes. Elsewhere: plain synchronous copies into separate
    buffers.

    A reload's buffer is allocated on the compute stream, so memory backward frees serves
    later compute-stream allocations too (one pool, as the simulator assumes); the H2D
    stream first waits for the compute work queued so far, which is the plan's prefetch
    point: backward has reached it."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._events: dict[int, Any] = {}  # id of a reloaded tensor -> its copy's event

    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def offload(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.device.type != "cuda":
            host = torch.empty(storage.nbytes(), dtype=torch.uint8)
            host.untyped_storage().copy_(storage)
            return host
        d2h, _ = self._cuda_streams(t.device)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream(t.device))  # t has been computed
        with torch.cuda.stream(d2h):
            host.untyped_storage().copy_(storage, non_blocking=True)
        t.record_stream(d2h)  # its memory is not reused before the copy has read it
        return host

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":  # a buffer of its own, as a device copy would be
            return host.to(device, copy=True)
        d2h, h2d = self._cuda_streams(device)
        base = torch.empty(host.shape, dtype=host.dtype, device=device)
        h2d.wait_stream(torch.cuda.current_stream(device))  # base's memory is free
        h2d.wait_stream(d2h)  # the offload into ``host`` has landed
        with torch.cuda.stream(h2d):
            base.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(h2d)
        base.record_stream(h2d)
        self._events[id(base)] = event
        return base

    def ready(self, base: torch.Tensor, stats: RuntimeStats) -> torch.Tensor:
        """Make the compute stream wait for ``base``'s reload, if one is in flight; a
        copy not finished when asked is a stall, timed on the compute stream."""
        event = self._events.pop(id(base), None)
        if event is not None:
            current = torch.cuda.current_stream(base.device)
            if event.query():
                current.wait_event(event)
            else:
                stats.stalls += 1
                with stats.stall_section(base.device):
                    current.wait_event(event)
        return base
