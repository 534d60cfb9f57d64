"""What a step under the runtime did: bytes moved, reloads, stalls, recompute, memory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RuntimeStats", "Timer"]


class Timer:
    """Seconds spent in sections of backward: the CPU clock, or where copies are
    asynchronous (a ``link``, :mod:`~slackswap.runtime.streams`) a pair of events on the
    compute stream, read only when asked so that timing never makes a step wait."""

    def __init__(self) -> None:
        self._cpu_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def section(self, link: Any) -> Iterator[None]:
        if link is not None:
            start, end = link.event(timing=True), link.event(timing=True)
            start.record(link.compute)
            yield
            end.record(link.compute)
            self._events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._cpu_s += time.perf_counter() - begin

    @property
    def seconds(self) -> float:
        for _, end in self._events:
            end.synchronize()
        return self._cpu_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


@dataclass
class RuntimeStats:
    """What the last step did. Resident bytes count the saved activations the runtime
    holds on the device (kept, reloaded or rebuilt), each storage once, from when it is
    saved or brought back until backward unpacks it for the last time; storages under
    1 KiB, which are never moved, are left out."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    prefetched: int = 0  # reloads issued at their prefetch point
    late_reloads: int = 0  # reloads issued only when backward needed them
    stalls: int = 0  # times backward waited for a reload
    # offloads the compute stream waited for, to free their memory where simulated
    offload_waits: int = 0
    recomputed_ops: int = 0
    verified: int = 0  # reloads and rebuilds compared with the original (verify=True)
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    # the step left its plan's profiled path and ran again as plain PyTorch (NOTE [a step
    # off the profiled path])
    off_path: bool = False
    host_buffers_allocated: int = 0  # host buffers not found in the pool (pinned on CUDA)
    # ids of the activations reloaded, in the order the reloads were issued
    reload_order: list[str] = field(default_factory=list)
    _recompute: Timer = field(default_factory=Timer, repr=False)
    _stall: Timer = field(default_factory=Timer, repr=False)
    # device -> its link, or None where copies are synchronous (``HostCopies.link``)
    _link_of: Callable[[torch.device], Any] = field(default=lambda device: None, repr=False)

    @property
    def recompute_s(self) -> float:
        """Time spent rebuilding dropped activations."""
        return self._recompute.seconds

    @property
    def stall_s(self) -> float:
        """Time backward waited for reloads (on CUDA: the compute stream's wait)."""
        return self._stall.seconds

    def recompute_section(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Time a rebuild."""
        return self._recompute.section(self._link_of(device))

    def stall_section(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Time a wait for a reload."""
        return self._stall.section(self._link_of(device))

    def as_dict(self) -> dict[str, float]:
        """Every figure, times included (on CUDA this waits for the step's timing events)."""
        figures = {k: v for k, v in vars(self).items()
                   if not k.startswith("_") and k != "reload_order"}
        return figures | {"recompute_s": self.recompute_s, "stall_s": self.stall_s}

    def _hold(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
