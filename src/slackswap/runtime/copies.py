"""Host copies of offloaded storages: a pool of (pinned) host buffers, and on CUDA side
streams whose copies' lifetimes are held by events.

NOTE [buffers held by events]
    ``record_stream`` marks a block as used by another stream until the allocator next
    sees that stream's work done: blocks come back late and the caching allocator grows
    (PyTorch's own offloading avoids it). Here every asynchronous copy records an event,
    and what it reads or writes is held by the runtime until that event has completed:
    the device tensor an offload reads, the device buffer a reload writes (unless the
    compute stream has waited for it, which orders any reuse after the copy), and the
    host buffer either one uses. Finished copies are let go of at the next copy issued,
    or, while an offload with no deadline is in flight, at the next pack. An offload's
    device tensor is also let go of where the simulator frees it (NOTE [offloads free
    where simulated]): with a profile every offload of a saved tensor has that
    deadline, so the host asks about copies only when it issues one, never per tensor
    (NOTE [streams resolved once per block]). A storage written in place after it was
    offloaded (a second value of it is saved later) is written only once the offload of
    the first value has read it: the runtime watches every such write (NOTE [watch only
    what the plan rebuilds]).
    Host buffers are pinned once and reused: a buffer nobody holds goes back to a pool,
    keyed by size, that keeps up to the plan's offloaded bytes, so a training loop stops
    pinning memory after its first step.

NOTE [offloads free where simulated]
    The caching allocator counts memory in the order the host issues work, and the host
    runs ahead of the GPU on any step that is not host-bound. Freed only when the host
    sees its copy done, an offloaded tensor stays counted for as long as the host is
    ahead: measured on an H200 (llama-7b, 8 layers, 50% budget), steps peaked 13% over
    their budget, though the simulator and a step with the host slowed (the allocator
    recording its history) stayed under.
    So each offload also has a deadline from the simulated step: the op before which the
    simulator freed it (its copy done, under the plan's budget). Reaching that op, the
    runtime makes the compute stream wait for the copy and lets the tensor go, so memory
    in issue order is what was simulated, and a link slower than simulated costs time
    (``offload_waits``), not memory.
"""

from __future__ import annotations

import heapq
import weakref
from collections import deque
from itertools import count
from typing import Any

import torch

from slackswap.runtime import streams
from slackswap.runtime.recipes import detached, storage_key
from slackswap.runtime.stats import RuntimeStats
from slackswap.runtime.streams import laid_as, whole

__all__ = ["HostCopies", "copies_for"]


class HostCopies:
    """Host copies. On CUDA: pinned buffers, offloads on a D2H stream and reloads on an
    H2D stream (a pair per device), the compute stream waiting on a reload's event only
    when it needs the tensor. Elsewhere: plain synchronous copies into separate buffers.

    A reload's buffer is allocated on the compute stream, so memory backward frees serves
    later compute-stream allocations too (one pool, as the simulator assumes); the H2D
    stream first waits for the compute work queued so far, which is the plan's prefetch
    point: backward has reached it.

    ``capacity``: bytes of free host buffers the pool keeps for reuse (None: all); never
    less than the most bytes of host copies held at once so far (micro-batches whose
    backwards come after all their forwards hold several steps' copies)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._free: dict[int, list[torch.Tensor]] = {}  # bytes -> free host buffers
        self._free_bytes = 0
        self._out_bytes = 0  # bytes of host copies handed out and not given back
        self._most_out = 0
        # device -> (the link factory it was made by, its link or None: synchronous)
        self._links: dict[torch.device, tuple[Any, Any]] = {}
        self._busy: dict[int, Any] = {}  # id of a host buffer -> its last copy's event
        # copies in flight per stream, in issue order: [event, device tensor held, host
        # buffer] (offloads add the tensor's storage key and the profile op before which
        # it must be let go, or None); a reload's entry is found by the id of the tensor
        # it makes until the compute stream waits for it
        self._offloads: deque[list[Any]] = deque()
        # offloads with a deadline, soonest first: (deadline, issue number, entry); read
        # by every pack and unpack before it calls ``free_due`` (a call per tensor costs
        # more than the look)
        self.due: list[tuple[int, int, list[Any]]] = []
        self._issued = count()
        # groups of offloads issued, numbered in issue order; per device the last whose
        # event the compute stream waited for or found done: it runs after every group
        # before it too, since one copy stream runs them in order
        self._groups = count()
        self._waited: dict[torch.device, int] = {}
        self.undated = 0  # offloads in flight with no deadline: only ``poll`` frees them
        # storage an offload still reads -> (its event, device)
        self._reading: dict[int, tuple[Any, torch.device]] = {}
        self._reloading: deque[list[Any]] = deque()
        self._reloads: dict[int, list[Any]] = {}
        self._snapshots: dict[int, torch.Tensor] = {}  # slot -> its pinned host buffer
        # offloads whose copies wait for their group's (NOTE [offloads issued in groups]):
        # (tensor, host buffer, deadline, bytes, storage key), and their storages
        self._waiting: list[tuple[torch.Tensor, torch.Tensor, int | None, int, int]] = []
        self._waiting_keys: set[int] = set()
        # the soonest deadline among them (None: none has one), read by ``free_due``
        self._waiting_due: int | None = None

    # -- the pool ----------------------------------------------------------------------
    @property
    def pooled_bytes(self) -> int:
        """Bytes of free host buffers kept for the next offloads."""
        return self._free_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of host copies handed out and not given back."""
        return self._out_bytes

    def _take(self, nbytes: int, link: Any, stats: RuntimeStats,
              like: torch.Tensor) -> torch.Tensor:
        """A host buffer of ``nbytes``, laid out as ``like`` (NOTE [host copies laid out as
        their tensors]): pooled where one of that size is free, else new."""
        out = self._out_bytes = self._out_bytes + nbytes
        if out > self._most_out:
            self._most_out = out
        free = self._free.get(nbytes)
        if free:
            host = free.pop()
            self._free_bytes -= nbytes
            event = self._busy.pop(id(host), None)
            if event is not None:
                event.synchronize()  # a copy from it may still be in flight: rare
            if host.dtype is not like.dtype or host.shape != like.shape:
                host = laid_as(host, like)
            return host
        stats.host_buffers_allocated += 1
        if link is not None:
            return laid_as(link.host_buffer(nbytes), like)
        return laid_as(torch.empty(nbytes, dtype=torch.uint8), like)

    def give_back(self, host: torch.Tensor) -> None:
        """A host copy nobody needs any more: its buffer may serve the next offload."""
        nbytes = host.nbytes
        self._out_bytes -= nbytes
        if self._waiting:  # its copy had not been issued: nobody needs it now
            self._waiting = [w for w in self._waiting if w[1] is not host]
            self._waiting_due = min((w[2] for w in self._waiting if w[2] is not None),
                                    default=None)
        limit = None if self.capacity is None else max(self.capacity, self._most_out)
        if limit is not None and self._free_bytes + nbytes > limit:
            self._busy.pop(id(host), None)
            return  # past what the plan offloads: let it go
        self._free.setdefault(nbytes, []).append(host)
        self._free_bytes += nbytes

    def poll(self) -> None:
        """Let go of what finished copies held (each stream finishes in issue order)."""
        for queue in (self._offloads, self._reloading):
            done = None  # a group's copies share an event: asked about once
            while queue and (queue[0][0] is done or queue[0][0].query()):
                entry = queue.popleft()
                done = entry[0]
                event, held, host, *offload = entry
                entry[1] = None  # a deadline still queued for it finds nothing to free
                if queue is self._reloading and held is not None:  # done, never waited for
                    self._reloads.pop(id(held), None)
                if offload and self._reading.get(offload[0], (None,))[0] is event:
                    del self._reading[offload[0]]
                if offload and offload[1] is None:
                    self.undated -= 1
                if self._busy.get(id(host)) is event:
                    del self._busy[id(host)]

    # -- copies ------------------------------------------------------------------------
    def link(self, device: torch.device) -> Any:
        """The device's :class:`~slackswap.runtime.streams.Link` (None: copies there are
        synchronous), made once (NOTE [streams resolved once per block])."""
        made = self._links.get(device)
        factory = streams._make[-1]
        if made is None or made[0] is not factory:
            made = self._links[device] = (factory, factory(device))
        return made[1]

    def asynchronous(self, device: torch.device) -> bool:
        return self.link(device) is not None

    def begin(self) -> None:
        """A block opens: each link resolves the stream its forward runs on."""
        for _, link in self._links.values():
            if link is not None:
                link.begin()

    def offload(self, t: torch.Tensor, stats: RuntimeStats,
                free_before: int | None = None, issue: bool = True,
                key: int | None = None, nbytes: int = 0) -> torch.Tensor:
        """A host copy of ``t``'s storage, its buffer handed out now. The copy is issued
        now, or with ``issue=False`` with the next offload issued (NOTE [offloads issued
        in groups] in ``slackswap.core.offloads``), ``t`` held until then. On CUDA the
        device tensor is held until the copy is done, and at the latest until the step
        reaches profile op ``free_before``. ``key`` and ``nbytes``: the storage's, where
        the caller has read them already."""
        if key is None:
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
        link = self.link(t.device)
        # what is copied: the tensor, or the bytes of its whole storage (NOTE [a tensor's
        # copy, not its storage's] in ``slackswap.runtime.streams``); held until the copy
        # (detached: out of the recorder's sight, no node of its own)
        if whole(t, nbytes):
            source = detached(t)
        else:
            source = link.bytes_of(t) if link is not None else streams.bytes_of(t)
        host = self._take(nbytes, link, stats, source)
        self._waiting.append((source, host, free_before, nbytes, key))
        self._waiting_keys.add(key)
        if free_before is not None and (self._waiting_due is None
                                        or free_before < self._waiting_due):
            self._waiting_due = free_before
        if issue:
            self.issue()
        return host

    def issue(self) -> None:
        """Issue the copies of every offload waiting for its group: on CUDA one wait for
        the compute stream and one stream switch per device, a copy each, one event for
        them all (NOTE [offloads issued in groups]); a poll only while an offload with no
        deadline is in flight (with a profile, each goes at its deadline: ``free_due``)."""
        waiting = self._waiting
        if not waiting:
            return
        self._waiting, self._waiting_keys, self._waiting_due = [], set(), None
        device = waiting[0][0].device
        if len(waiting) > 1 and any(w[0].device != device for w in waiting):  # a model
            # over several devices
            for w in waiting:
                self._waiting = [w]
                self.issue()
            return
        link = self.link(device)
        if link is None:  # synchronous: each copy done as it is issued
            with streams.unseen():
                for source, host, _, _, _ in waiting:
                    host.untyped_storage().copy_(source.untyped_storage())
            return
        if self.undated:  # with a deadline each, the copies in flight go at their
            self.poll()   # deadlines (``free_due``): no poll per group
        d2h = link.d2h
        link.wait_for_compute(d2h)  # the tensors have been computed
        link.copy_storages(d2h, waiting)
        event = link.event()
        event.record(d2h)
        self._in_flight(event, waiting, next(self._groups))

    def snapshot(self, t: torch.Tensor, slot: int) -> torch.Tensor:
        """A copy of ``t`` in host memory (a model buffer the step may change, NOTE
        [refusals leave no trace]): device memory is the plan's. On CUDA into a pinned
        buffer kept per ``slot`` for the next step, copied on the compute stream, so the
        kernels after it write ``t`` only once it is read; elsewhere a plain copy."""
        link = self.link(t.device)
        if link is None:
            return t.detach().clone()
        host = self._snapshots.get(slot)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            nbytes = t.numel() * t.element_size()
            host = link.host_buffer(nbytes).view(t.dtype).view(t.shape)
            self._snapshots[slot] = host
        link.copy(host, t.detach())
        return host

    def _in_flight(self, event: Any, waiting: list[tuple[Any, ...]], group: int) -> None:
        """Hold what the copies of a group of offloads (``(tensor, host buffer, deadline,
        bytes, storage key or None)`` each) read and write until ``event`` (or each one's
        deadline): one call per group, a call per offload being itself a cost
        (``benchmarks/host_work.py``)."""
        # t's memory is not reused, nor the buffer handed out again, before the copy
        # (t: detached, out of the recorder's sight)
        offloads, due, issued = self._offloads, self.due, self._issued
        busy, reading, push = self._busy, self._reading, heapq.heappush
        for t, host, free_before, _, key in waiting:
            if key is None:
                key = storage_key(t)
            entry = [event, t, host, key, free_before, group]
            offloads.append(entry)
            if free_before is not None:
                push(due, (free_before, next(issued), entry))
            else:
                self.undated += 1
            busy[id(host)] = event
            reading[key] = (event, t.device)

    def free_due(self, position: int, stats: RuntimeStats) -> None:
        """Let go of the device tensors of offloads due to be freed before the op after
        ``position``: NOTE [offloads free where simulated]."""
        if self._waiting_due is not None and self._waiting_due <= position + 1:
            self.issue()  # (not met where simulated: a group is issued before its deadlines)
        waited = self._waited
        while self.due and self.due[0][0] <= position + 1:
            entry = heapq.heappop(self.due)[2]
            held = entry[1]
            if held is None:
                continue
            # a group's copies share an event: asked about, or waited for, once
            if entry[5] > waited.get(held.device, -1):
                if not entry[0].query():  # later than simulated: the compute stream waits
                    stats.offload_waits += 1
                    self.link(held.device).compute.wait_event(entry[0])
                waited[held.device] = entry[5]
            entry[1] = None

    def hold_in_flight(self, limit: int, stats: RuntimeStats) -> None:
        """Let go of the device tensors of the oldest offloads in flight until those left
        hold at most ``limit`` bytes, the compute stream waiting for each copy not done
        yet: a step off the profiled path copies every activation to host memory, and
        where the link is slower than compute its copies must not hold device memory past
        the plan's budget (NOTE [a step off the profiled path] in ``runtime/block.py``)."""
        held = [entry for entry in self._offloads if entry[1] is not None]
        over = sum(entry[2].nbytes for entry in held) - limit
        waited = None  # a group's copies share an event: waited for once
        for entry in held:
            if over <= 0:
                break
            over -= entry[2].nbytes
            event, device = entry[0], entry[1].device
            if event is not waited and not event.query():  # later than compute
                stats.offload_waits += 1
                self.link(device).compute.wait_event(event)
            waited = event
            entry[1] = None  # the compute stream runs after its copy: its memory is free

    def before_write(self, key: int) -> None:
        """The compute stream is about to change a storage in place: if an offload still
        reads it (its earlier value, saved before), the write waits for that copy."""
        if key in self._waiting_keys:  # its offload's copy first
            self.issue()
        reading = self._reading.pop(key, None)
        if reading is not None and not reading[0].query():
            self.link(reading[1]).compute.wait_event(reading[0])

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.issue()  # (backward reloads after forward issued every offload)
        link = self.link(device)
        if link is None:  # a buffer of its own, as a device copy would be
            return host.to(device, copy=True)
        self.poll()
        h2d = link.h2d
        base = link.empty(host.shape, host.dtype)
        link.wait_for_compute(h2d)  # base's memory is free
        landed = self._busy.get(id(host))
        if landed is not None:  # the offload into ``host`` may still be in flight
            h2d.wait_event(landed)
        with link.issuing_on(h2d):
            link.copy(base, host)
        event = link.event()
        event.record(h2d)
        entry = [event, base, host]
        self._reloading.append(entry)
        self._reloads[id(base)] = entry
        self._busy[id(host)] = event
        return base

    def ready(self, base: torch.Tensor, stats: RuntimeStats) -> torch.Tensor:
        """Make the compute stream wait for ``base``'s reload, if one is in flight; a
        copy not finished when asked is a stall, timed on the compute stream."""
        entry = self._reloads.pop(id(base), None)
        if entry is not None:
            event = entry[0]
            current = self.link(base.device).compute
            if event.query():
                current.wait_event(event)
            else:
                stats.stalls += 1
                with stats.stall_section(base.device):
                    current.wait_event(event)
            # the compute stream now runs after the copy: reusing the buffer's memory
            # there is safe, so the runtime need not hold it any longer
            entry[1] = None
        return base


# id(owner) -> (weak reference to it, its copies): the pool outlives one ``apply`` block,
# since a training loop opens one per step with the same plan
_COPIES: dict[int, tuple[Any, HostCopies]] = {}


def copies_for(owner: Any, capacity: int | None) -> HostCopies:
    """The host copies (and pool) of ``owner`` (a plan), for as long as it lives."""
    key = id(owner)
    entry = _COPIES.get(key)
    if entry is not None and entry[0]() is owner:
        entry[1].capacity = capacity
        return entry[1]

    def forget(ref: Any) -> None:
        if _COPIES.get(key, (None,))[0] is ref:
            del _COPIES[key]

    copies = HostCopies(capacity)
    _COPIES[key] = (weakref.ref(owner, forget), copies)
    return copies
