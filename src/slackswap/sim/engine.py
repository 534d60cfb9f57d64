"""The discrete-event engine: one compute stream, a D2H and an H2D copy engine, a memory
counter, and the host's issue times (NOTE [host model] in :mod:`slackswap.sim.host`).
Plain Python.

A hand-written next-event loop rather than SimPy: a planner calls it thousands of times,
and with only three in-order streams the state fits in a few variables. The host adds no
stream: it never waits, so its issue times are prefix sums fixed before the loop, and
each one is a time before which an item or copy may not start. The tests check the
engine against an independent SimPy model of the same semantics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from slackswap.core.hardware import HostLink
from slackswap.sim.schedule import Copy, Schedule

if TYPE_CHECKING:
    from slackswap.sim.host import HostTimes

__all__ = ["Blocked", "Span", "Timeline", "run_schedule"]


@dataclass(frozen=True, slots=True)
class Blocked:
    """The run stopped: an item (or the reload it waits for) can never get its memory."""

    item: int  # compute item that could not start
    reload: int | None  # h2d copy that could not start, when that is what it waits for
    need: int  # bytes the blocked allocation asks for
    used: int  # bytes in use when the run stopped
    limit: float


@dataclass(slots=True)
class Span:
    stream: str  # "compute", "d2h" or "h2d"
    index: int  # item index (compute) or copy index (d2h, h2d)
    start: float
    end: float


@dataclass
class Timeline:
    """What happened, in order: spans per stream, memory after every change, the outcome."""

    spans: list[Span] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)
    alloc_time: dict[int, float] = field(default_factory=dict)  # residency -> allocated at
    free_time: dict[int, float] = field(default_factory=dict)  # residency -> freed at
    # idle compute stream by cause: a reload, memory, the host not having issued the item
    stall: dict[str, float] = field(
        default_factory=lambda: {"reload": 0.0, "memory": 0.0, "host": 0.0})
    end: float = 0.0
    peak: int = 0
    peak_time: float = 0.0
    blocked: Blocked | None = None  # why the run could not finish


class _Transfer:
    """An in-order copy engine: latency first, then bytes at the rate the link allows."""

    __slots__ = ("queue", "head", "active", "latency_end", "remaining", "rate", "start")

    def __init__(self, queue: list[Copy]) -> None:
        self.queue = queue
        self.head = 0
        self.active: Copy | None = None
        self.latency_end = 0.0
        self.remaining = 0.0
        self.rate = 0.0
        self.start = 0.0


class _Headroom:
    """How much more memory the compute stream will take between two items.

    NOTE [prefetch headroom]: a reload may start early only if it leaves room for every
    allocation the compute stream makes before the reload's consumer runs. Otherwise
    greedy prefetching fills memory with tensors needed later and starves the kernel that
    would free it: a deadlock the real runtime must avoid too. Reloads are issued in
    consumer order, so an earlier reload never waits behind a later one.
    """

    def __init__(self, sched: Schedule, need_of: list[int]) -> None:
        """``need_of``: the bytes each item allocates."""
        freed = [r.bytes if r.source == "compute" else 0 for r in sched.residencies]
        need = np.asarray(need_of, dtype=np.int64)
        freed_by = []  # (loops, not nested comprehensions: each of those is a call)
        for item in sched.items:
            total = 0
            for r in item.frees:
                total += freed[r]
            freed_by.append(total)
        frees = np.asarray(freed_by, dtype=np.int64)
        # compute-allocated bytes resident before item k starts, and while it runs
        # (integer sums: exact in any order)
        delta = need - frees
        self.before = np.cumsum(delta) - delta
        self.during = self.before + need
        # sparse table for range maxima of ``during``
        self.table = [self.during]
        row, width = self.during, 1
        while 2 * width <= len(row):
            row = np.maximum(row[:-width], row[width:])
            self.table.append(row)
            width *= 2

    def growth(self, first: int, last: int, started: bool) -> int:
        """Peak compute level over items ``first..last`` above the level now."""
        k = (last - first + 1).bit_length() - 1
        row = self.table[k]
        peak = max(int(row[first]), int(row[last - (1 << k) + 1]))
        now = int(self.during[first] if started else self.before[first])
        return max(peak - now, 0)


def run_schedule(sched: Schedule, link: HostLink, limit: float = math.inf,
                 host: HostTimes | None = None) -> Timeline:
    """Time ``sched`` on ``link`` under a memory ``limit`` (bytes of activation memory);
    with ``host``, no item or copy starts before the host has issued it."""
    # Long because the loop below is the planner's hot path (tens of simulations of
    # thousands of items per plan): per-item sums are taken once and the helpers are
    # written out inline, one event loop with its state in locals.
    items, res = sched.items, sched.residencies
    issued = host.issued if host is not None else None
    d2h_ready = host.d2h_ready if host is not None else None
    h2d_ready = host.h2d_ready if host is not None else None
    tl = Timeline()
    spans, memory, alloc_time, free_time = tl.spans, tl.memory, tl.alloc_time, tl.free_time
    used = 0
    size = [r.bytes for r in res]
    holds = [r.holds for r in res]
    need_of = []
    for item in items:
        total = 0
        for r in item.allocs:
            total += size[r]
        need_of.append(total)
    if not sched.d2h and not sched.h2d:  # NOTE [a step with no copies]
        return _run_compute_only(sched, need_of, size, holds, limit, issued, tl)
    # (only a reload under a limit asks how much room compute will take)
    headroom = _Headroom(sched, need_of) if limit < math.inf and sched.h2d else None
    n_items = len(items)
    d2h, h2d = _Transfer(sched.d2h), _Transfer(sched.h2d)
    n_d2h, n_h2d = len(sched.d2h), len(sched.h2d)
    d2h_done = [False] * n_d2h
    h2d_done = [False] * n_h2d
    item_end = [math.inf] * n_items
    latency = link.latency_s
    nxt = 0  # next compute item
    running = -1  # item on the compute stream, or -1
    run_end = 0.0
    now = 0.0
    idle_since: float | None = None
    cause = "reload"

    peak, peak_time = 0, 0.0
    # (allocating and releasing are written out where they happen: an allocation adds
    # its bytes, stamps ``alloc_time`` and ``memory`` and raises the peak; a release
    # frees the bytes once its last hold goes, stamping ``free_time`` and ``memory``)
    while True:
        # -- start what can start at ``now`` (compute has first claim on memory) ------------
        t_host = math.inf  # the next issue time something waits for
        # One pass starts all it can: starting compute or a copy out lets nothing else
        # start, and a reload only takes memory. After a reload starts while compute waits,
        # one more pass sees the wait's cause again (memory now, where it was the host).
        progress = True
        while progress:
            progress = False
            if running < 0 and nxt < n_items:
                item = items[nxt]
                need = need_of[nxt]
                ready = not item.needs or all(h2d_done[h] for h in item.needs)
                waits_host = issued is not None and issued[nxt] > now
                if ready and used + need <= limit and not waits_host:
                    if idle_since is not None:
                        if issued is None:
                            tl.stall[cause] += now - idle_since
                        else:  # idle before the item was issued waited for the host
                            to_host = min(issued[nxt], now) - idle_since
                            if to_host > 0:
                                tl.stall["host"] += to_host
                            if now > max(issued[nxt], idle_since):
                                tl.stall[cause] += now - max(issued[nxt], idle_since)
                        idle_since = None
                    for rid in item.allocs:
                        used += size[rid]
                        alloc_time[rid] = now
                        memory.append((now, used))
                        if used > peak:
                            peak, peak_time = used, now
                    running, run_end = nxt, now + item.duration
                    spans.append(Span("compute", nxt, now, run_end))
                    nxt += 1
                else:
                    if idle_since is None:
                        idle_since = now
                    if not ready:
                        cause = "reload"
                    elif used + need > limit:
                        cause = "memory"
                    if waits_host:
                        t_host = min(t_host, issued[nxt])  # type: ignore[index]
            if d2h.active is None and d2h.head < n_d2h:
                copy = d2h.queue[d2h.head]
                if item_end[copy.after_item] <= now:
                    if d2h_ready is None or d2h_ready[d2h.head] <= now:
                        d2h.active, d2h.start = copy, now
                        d2h.latency_end, d2h.remaining = now + latency, float(copy.bytes)
                    else:
                        t_host = min(t_host, d2h_ready[d2h.head])
            if h2d.active is None and h2d.head < n_h2d:
                copy = h2d.queue[h2d.head]
                current = running if running >= 0 else nxt
                cursor = items[current].position if current < n_items else math.inf
                if cursor >= copy.issue_position and d2h_done[copy.d2h]:
                    reserve = 0  # (a range maximum: asked only of a reload otherwise ready)
                    if headroom is not None and current < copy.need_item:
                        reserve = headroom.growth(current, copy.need_item, running >= 0)
                    fits = used + copy.bytes + reserve <= limit
                    if fits and (h2d_ready is None or h2d_ready[h2d.head] <= now):
                        rid = copy.residency
                        used += size[rid]
                        alloc_time[rid] = now
                        memory.append((now, used))
                        if used > peak:
                            peak, peak_time = used, now
                        h2d.active, h2d.start = copy, now
                        h2d.latency_end, h2d.remaining = now + latency, float(copy.bytes)
                        progress = running < 0  # its bytes may change why compute waits
                    elif fits:
                        t_host = min(t_host, h2d_ready[h2d.head])
        # the rates the link allows now: both directions moving share it (duplex)
        d2h_moving = d2h.active is not None and now >= d2h.latency_end
        h2d_moving = h2d.active is not None and now >= h2d.latency_end
        both = d2h_moving and h2d_moving
        d2h.rate = link.duplex_d2h_bandwidth if both else link.d2h_bandwidth
        h2d.rate = link.duplex_h2d_bandwidth if both else link.h2d_bandwidth
        # -- advance to the next event -------------------------------------------------------
        t_compute = run_end if running >= 0 else math.inf
        # each copy engine's next event: its latency's end, or its active copy's end
        if d2h.active is None:
            t_d2h = math.inf
        elif now < d2h.latency_end:
            t_d2h = d2h.latency_end
        else:
            t_d2h = now + (d2h.remaining / d2h.rate if d2h.remaining > 0 else 0.0)
        if h2d.active is None:
            t_h2d = math.inf
        elif now < h2d.latency_end:
            t_h2d = h2d.latency_end
        else:
            t_h2d = now + (h2d.remaining / h2d.rate if h2d.remaining > 0 else 0.0)
        t_next = min(t_compute, t_d2h, t_h2d, t_host)
        if t_next == math.inf:
            break
        done_d2h = d2h_moving and t_d2h == t_next
        done_h2d = h2d_moving and t_h2d == t_next
        if d2h_moving:
            d2h.remaining -= d2h.rate * (t_next - now)
        if h2d_moving:
            h2d.remaining -= h2d.rate * (t_next - now)
        now = t_next
        if running >= 0 and run_end == now:
            item_end[running] = now
            for rid in items[running].frees:
                holds[rid] -= 1
                if holds[rid] == 0:
                    used -= size[rid]
                    free_time[rid] = now
                    memory.append((now, used))
            running = -1
        if done_d2h:
            copy = d2h.active  # type: ignore[assignment]
            d2h.remaining = 0.0
            spans.append(Span("d2h", d2h.head, d2h.start, now))
            d2h_done[d2h.head] = True
            rid = copy.residency
            holds[rid] -= 1
            if holds[rid] == 0:
                used -= size[rid]
                free_time[rid] = now
                memory.append((now, used))
            d2h.active = None
            d2h.head += 1
        if done_h2d:
            h2d.remaining = 0.0
            spans.append(Span("h2d", h2d.head, h2d.start, now))
            h2d_done[h2d.head] = True
            h2d.active = None
            h2d.head += 1
    tl.end, tl.peak, tl.peak_time = now, peak, peak_time
    if nxt < n_items or running >= 0:
        tl.blocked = _why_blocked(sched, nxt, used, limit, h2d.head)
    return tl


# NOTE [a step with no copies]
#     A schedule with no copies (a keep-all or recompute-only plan, or any plan whose
#     copies run on the compute stream, ``on_compute_stream``) has only the compute
#     stream and the host: the next-event loop of ``run_schedule`` then takes exactly one
#     step per item (start it, advance to its end, free) and one more where an item waits
#     for the host. ``_run_compute_only`` is that loop with the copy engines taken out:
#     the same arithmetic in the same order, so the same timeline to the bit (op times
#     are finite: a profile holds no inf), in a fraction of the time (the compiled path's
#     plans have no copies on the link).
def _run_compute_only(sched: Schedule, need_of: list[int], size: list[int],
                      holds: list[int], limit: float, issued: list[float] | None,
                      tl: Timeline) -> Timeline:
    """``run_schedule`` for a schedule with no copies (NOTE [a step with no copies])."""
    items = sched.items
    spans, memory, alloc_time, free_time = tl.spans, tl.memory, tl.alloc_time, tl.free_time
    used, now, peak, peak_time = 0, 0.0, 0, 0.0
    # The stream is idle only while an item waits for the host (nothing else can hold it
    # up but memory, which nothing would free: the run stops): the event loop's stall
    # counts then come to the wait, ``issued - now``, each added to "host" in turn.
    host_stall = tl.stall["host"]
    blocked = False
    nxt = 0
    for nxt, item in enumerate(items):  # noqa: B007 - nxt is read after the loop
        need = need_of[nxt]
        fits = used + need <= limit
        if issued is not None and issued[nxt] > now:  # waits for the host: one event
            if fits:
                host_stall += issued[nxt] - now
            now = issued[nxt]
        if not fits:
            blocked = True
            break
        for rid in item.allocs:
            used += size[rid]
            alloc_time[rid] = now
            memory.append((now, used))
        if used > peak:  # (sizes are not negative: the item's last allocation is its top)
            peak, peak_time = used, now
        run_end = now + item.duration
        spans.append(Span("compute", nxt, now, run_end))
        now = run_end
        for rid in item.frees:
            holds[rid] -= 1
            if holds[rid] == 0:
                used -= size[rid]
                free_time[rid] = now
                memory.append((now, used))
    tl.stall["host"] = host_stall
    tl.end, tl.peak, tl.peak_time = now, peak, peak_time
    if blocked:
        tl.blocked = _why_blocked(sched, nxt, used, limit, 0)
    return tl


def _why_blocked(sched: Schedule, nxt: int, used: int, limit: float, h2d_head: int) -> Blocked:
    item = sched.items[nxt]
    if any(h >= h2d_head for h in item.needs):
        return Blocked(nxt, h2d_head, sched.h2d[h2d_head].bytes, used, limit)
    need = sum(sched.residencies[r].bytes for r in item.allocs)
    return Blocked(nxt, None, need, used, limit)
