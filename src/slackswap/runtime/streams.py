"""Every call the runtime makes to an accelerator's streams, events, copies and pinned
memory, in one place: a :class:`Link` per device.

NOTE [streams resolved once per block]
    On an H200 the eager runtime spent more host time in PyTorch's Python wrappers around
    the CUDA calls than in the calls themselves: ``torch.cuda.current_stream(device)``
    resolves its device index through several Python frames (about 24 us a call, 600
    calls a step of gpt2-xl@12 at 50%), and each ``torch.cuda.stream(...)`` context asks
    for the current stream twice more. So a link resolves the compute stream once, as
    the block opens (the forward pass runs on one stream per device, and autograd runs
    its backward nodes on the stream their forward ran on), and switches streams with
    ``torch.cuda.set_stream`` around the one call it issues there.

NOTE [stand-ins for the device calls]
    What the runtime does on the host for each saved tensor is counted on a CPU by
    running its asynchronous branch with :class:`StandIn` links (``stand_ins()``): the
    same Python, with the stream, event, copy and pinned-memory calls replaced by
    counters (``benchmarks/host_work.py``; ``tests/test_host_work.py``). A stand-in copy
    is synchronous (exact on real tensors, a no-op on the meta device), and its events
    follow one of two policies: ``"behind"`` (the host never sees a copy finish until it
    waits for it: the most work the host can be asked to do, a stall at every reload)
    or ``"done"`` (every copy has finished when asked: the least).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

# the runtime's own copies are no op of the model's: dispatch modes (the recorder's, in
# a watched segment) do not see them, nor pay a Python call for each
_UNSEEN = torch._C._DisableTorchDispatch


def unseen() -> Any:
    """A context in which the runtime's own copies are seen by no dispatch mode."""
    return _UNSEEN()


__all__ = ["Link", "StandIn", "link_for", "stand_ins", "whole", "bytes_of", "laid_as",
           "unseen"]


class Link:
    """The CUDA calls of one device: its compute stream (resolved by :meth:`begin`), a
    D2H and an H2D stream of the runtime's own, events, copies and pinned buffers."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
        self.marker = torch.cuda.Event()

    def begin(self) -> None:
        """The block opens: the stream its forward runs on (NOTE [streams resolved once
        per block])."""
        self.compute = torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    @contextlib.contextmanager
    def issuing_on(self, stream: Any) -> Iterator[None]:
        """Work issued inside goes to ``stream``; the compute stream after."""
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(self.compute)

    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        """:func:`bytes_of`: what an offload copies of a tensor that is not its whole
        storage (NOTE [a tensor's copy, not its storage's])."""
        return bytes_of(t)

    def copy_storages(self, stream: Any, copies: list[tuple[Any, ...]]) -> None:
        """Each offload ``(source, host, ...)`` of ``copies``, ``source`` into the host
        buffer laid out as it (NOTE [host copies laid out as their tensors]), issued on
        ``stream``, then the compute stream again: one switch each way for a group (NOTE
        [offloads issued in groups] in ``slackswap.core.offloads``)."""
        torch.cuda.set_stream(stream)
        try:
            with _UNSEEN():
                for source, host, *_ in copies:
                    host.copy_(source, non_blocking=True)
        finally:
            torch.cuda.set_stream(self.compute)

    def wait_for_compute(self, stream: Any) -> None:
        """``stream`` runs what comes next after the work queued on the compute stream
        so far: ``stream.wait_stream(compute)`` without a new event each time (an event
        recorded again does not change what was already made to wait for it)."""
        self.marker.record(self.compute)
        stream.wait_event(self.marker)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with _UNSEEN():
            dst.copy_(src, non_blocking=True)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A device buffer, from the caching allocator on the current stream."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _StandInEvent:
    __slots__ = ("link", "recorded", "done")

    def __init__(self, link: StandIn) -> None:
        self.link, self.recorded, self.done = link, False, link.policy == "done"

    def record(self, stream: Any = None) -> None:
        self.link.calls["event_record"] += 1
        self.recorded = True

    def query(self) -> bool:
        self.link.calls["event_query"] += 1
        return self.done

    def synchronize(self) -> None:
        self.link.calls["event_synchronize"] += 1
        self.done = True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


class _StandInStream:
    __slots__ = ("link", "name")

    def __init__(self, link: StandIn, name: str) -> None:
        self.link, self.name = link, name

    def wait_event(self, event: _StandInEvent) -> None:
        self.link.calls["wait_event"] += 1
        event.done = True  # the stream runs after it: NOTE [stand-ins for the device calls]


class StandIn:
    """A :class:`Link` whose device calls are counters (NOTE [stand-ins for the device
    calls]), for any device: real CPU tensors are copied, meta ones only counted."""

    asynchronous = True

    def __init__(self, device: torch.device, calls: Counter, policy: str = "behind") -> None:
        self.device, self.calls, self.policy = device, calls, policy
        self.d2h, self.h2d = _StandInStream(self, "d2h"), _StandInStream(self, "h2d")
        self.compute = self.begin()

    def begin(self) -> Any:
        self.calls["current_stream"] += 1
        self.compute = _StandInStream(self, "compute")
        return self.compute

    def event(self, timing: bool = False) -> _StandInEvent:
        self.calls["new_event"] += 1
        return _StandInEvent(self)

    @contextlib.contextmanager
    def issuing_on(self, stream: Any) -> Iterator[None]:
        self.calls["stream_switch"] += 1
        yield

    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        self.calls["byte_view"] += 1
        return bytes_of(t)

    def copy_storages(self, stream: _StandInStream, copies: list[tuple[Any, ...]]) -> None:
        # the Link's Python, with its calls counted (a meta tensor has no bytes to copy)
        calls = self.calls
        calls["stream_switch"] += 1
        with _UNSEEN():
            for source, host, *_ in copies:
                calls["copy"] += 1
                if not source.is_meta:
                    host.copy_(source)

    def wait_for_compute(self, stream: _StandInStream) -> None:
        self.calls["event_record"] += 1
        self.calls["wait_event"] += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls["copy"] += 1
        if "meta" not in (src.device.type, dst.device.type):
            with _UNSEEN():
                dst.copy_(src)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        self.calls["device_empty"] += 1
        return torch.empty(shape, dtype=dtype, device=self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer in CPU memory, as the :class:`Link`'s pinned one, whatever the
        device: the views the runtime takes of it then cost what they cost on a GPU's
        host (on the meta device only the saved tensors are meta; the buffer's pages are
        never touched, so it takes no memory)."""
        self.calls["host_buffer"] += 1
        return torch.empty(nbytes, dtype=torch.uint8)


# NOTE [a tensor's copy, not its storage's]
#     An offload copies the whole storage of the saved tensor (a view saved for backward
#     comes back as a view of it). ``UntypedStorage.copy_`` cost 57 us of host time a
#     call on the H200 (cProfile), a tensor's ``copy_`` 15 us: it wraps both storages in
#     new tensors first. Most saved tensors are their storage, contiguous from its start:
#     those are copied as tensors, into a host buffer laid out in their dtype and shape
#     (the same bytes: NOTE [host copies laid out as their tensors]). The others (a
#     slice, a transposed or conjugate view) are copied as a tensor of bytes laid over
#     their whole storage (``bytes_of``: no conjugate or negative bit to resolve), the
#     same bytes again.
def whole(t: torch.Tensor, nbytes: int) -> bool:
    """``t`` covers its whole storage of ``nbytes``, contiguously from its start, and
    reads as its bytes (a conjugate or negative view's copy would resolve the bit its
    geometry puts back on reload)."""
    return (t.storage_offset() == 0 and t.numel() * t.element_size() == nbytes
            and t.is_contiguous() and not t.is_conj() and not t.is_neg())


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage as a flat ``uint8`` tensor over it (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


# NOTE [host copies laid out as their tensors]
#     An offload's host buffer is handed out laid out as what it copies (the saved tensor,
#     or the flat bytes of its storage): the copy is ``host.copy_(source)`` with no view
#     taken per copy (two views, a dtype's and a shape's, cost more host time than the
#     copy call did on this project's CPU runs), and the reload, made in the host copy's
#     dtype and shape, is the saved tensor's view as it is (``view_of``'s fast path).
#     The pool keeps buffers by size; one handed out again for a tensor of another dtype
#     or shape is laid out again, once (a training loop repeats the same shapes).
def laid_as(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``buffer``'s memory (contiguous, as many bytes as ``like`` covers) as a contiguous
    tensor of ``like``'s dtype and shape, on ``buffer``'s device (no copy)."""
    return torch.empty(0, dtype=like.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), 0, like.shape)


def _cuda_links(device: torch.device) -> Link | None:
    return Link(device) if device.type == "cuda" else None


_make: list[Callable[[torch.device], Any]] = [_cuda_links]


def link_for(device: torch.device) -> Link | StandIn | None:
    """The link of ``device``: copies there are asynchronous; None: plain synchronous
    copies (a CPU)."""
    return _make[-1](device)


@contextlib.contextmanager
def stand_ins(calls: Counter, policy: str = "behind") -> Iterator[Counter]:
    """Links made inside are :class:`StandIn` ones counting into ``calls``, on every
    device (NOTE [stand-ins for the device calls])."""
    if policy not in ("behind", "done"):
        raise ValueError(f"policy must be 'behind' or 'done', not {policy!r}")
    _make.append(lambda device: StandIn(device, calls, policy))
    try:
        yield calls
    finally:
        _make.pop()
