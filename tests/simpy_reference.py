"""An independent model of the engine's timing semantics, written with SimPy processes.

It takes the same static :class:`~slackswap.sim.schedule.Schedule` (which kernels run,
what each allocates and frees) and re-derives the timing: the compute stream, in-order
D2H and H2D copy engines sharing the host link, memory waits and the prefetch headroom
rule, as processes on SimPy's event queue instead of the engine's next-event loop.

The host is a process too: it spends each item's host cost in turn and then issues it;
an item waits for its issue, a reload for the issue of the first item at or past its
prefetch point, an offload for the time its pack issued it (given, as the engine is).
"""

from __future__ import annotations

import math

import simpy

from slackswap.core.hardware import HostLink
from slackswap.sim.schedule import Schedule


class _Link:
    """Which directions are moving bytes; an event that fires whenever that changes."""

    def __init__(self, env: simpy.Environment, link: HostLink) -> None:
        self.env, self.link = env, link
        self.moving = {"d2h": False, "h2d": False}
        self.changed = env.event()

    def rate(self, direction: str) -> float:
        both = all(self.moving.values())
        if direction == "d2h":
            return self.link.duplex_d2h_bandwidth if both else self.link.d2h_bandwidth
        return self.link.duplex_h2d_bandwidth if both else self.link.h2d_bandwidth

    def set(self, direction: str, moving: bool) -> None:
        self.moving[direction] = moving
        old, self.changed = self.changed, self.env.event()
        old.succeed()

    def transfer(self, direction: str, nbytes: float):
        yield self.env.timeout(self.link.latency_s)
        self.set(direction, True)
        remaining = nbytes
        while remaining > 0:
            rate = self.rate(direction)
            start = self.env.now
            finish = self.env.timeout(remaining / rate)
            result = yield finish | self.changed
            if finish in result:
                break
            remaining -= rate * (self.env.now - start)
        self.set(direction, False)


def reference_run(sched: Schedule, link: HostLink, limit: float = math.inf,
                  host=None, starts: dict | None = None) -> tuple[float, int]:
    """Step time and peak memory; ``math.inf`` step time when the run cannot finish.
    ``host``: a :class:`~slackswap.sim.host.HostTimes` (its per-item ``cost`` and its
    ``d2h_ready`` are used; issue times are re-derived here). ``starts``, when given, is
    filled with the start time of every item and copy, by (stream, index)."""
    env = simpy.Environment()
    starts = {} if starts is None else starts
    net = _Link(env, link)
    res = sched.residencies
    holds = [r.holds for r in res]
    state = {"used": 0, "peak": 0, "current": 0, "started": False}
    mem_changed = [env.event()]
    cursor_changed = [env.event()]
    item_done = [env.event() for _ in sched.items]
    d2h_done = [env.event() for _ in sched.d2h]
    h2d_done = [env.event() for _ in sched.h2d]
    finished = {"t": math.inf}
    issued = [env.event() for _ in sched.items]

    def notify(box: list) -> None:
        old, box[0] = box[0], env.event()
        old.succeed()

    def alloc(nbytes: int) -> None:
        state["used"] += nbytes
        state["peak"] = max(state["peak"], state["used"])
        notify(mem_changed)

    def release(rid: int) -> None:
        holds[rid] -= 1
        if holds[rid] == 0:
            state["used"] -= res[rid].bytes
            notify(mem_changed)

    # compute-only memory level per item, for the prefetch headroom rule (brute force)
    before, during, level = [], [], 0
    for item in sched.items:
        before.append(level)
        level += sum(res[r].bytes for r in item.allocs)
        during.append(level)
        level -= sum(res[r].bytes for r in item.frees if res[r].source == "compute")

    def issuing():
        for k in range(len(sched.items)):
            cost = host.cost[k] if host is not None else 0.0
            if cost > 0:
                yield env.timeout(cost)
            issued[k].succeed()

    def compute():
        for k, item in enumerate(sched.items):
            state["current"], state["started"] = k, False
            notify(cursor_changed)
            if not issued[k].triggered:
                yield issued[k]
            for h in item.needs:
                yield h2d_done[h]
            need = sum(res[r].bytes for r in item.allocs)
            while state["used"] + need > limit:
                yield mem_changed[0]
            for r in item.allocs:
                alloc(res[r].bytes)
            starts["compute", k] = env.now
            state["started"] = True
            notify(cursor_changed)
            yield env.timeout(item.duration)
            for r in item.frees:
                release(r)
            item_done[k].succeed()
        state["current"], state["started"] = len(sched.items), False
        notify(cursor_changed)
        finished["t"] = env.now

    def d2h():
        for i, copy in enumerate(sched.d2h):
            yield item_done[copy.after_item]
            if host is not None and host.d2h_ready[i] > env.now:
                yield env.timeout(host.d2h_ready[i] - env.now)
            starts["d2h", i] = env.now
            yield env.process(net.transfer("d2h", copy.bytes))
            release(copy.residency)
            d2h_done[i].succeed()

    def h2d():
        for i, copy in enumerate(sched.h2d):
            yield d2h_done[copy.d2h]
            # the host issues the reload once it has issued the first item at or past the
            # prefetch point (the last item when none is)
            at = [k for k, item in enumerate(sched.items)
                  if item.position >= copy.issue_position]
            gate = issued[at[0] if at else len(sched.items) - 1]
            if not gate.triggered:
                yield gate
            while True:
                k = state["current"]
                position = sched.items[k].position if k < len(sched.items) else math.inf
                reserve = 0
                if limit < math.inf and k < copy.need_item:
                    now = during[k] if state["started"] else before[k]
                    reserve = max(max(during[k:copy.need_item + 1]) - now, 0)
                if position >= copy.issue_position and (
                        state["used"] + copy.bytes + reserve <= limit):
                    break
                yield mem_changed[0] | cursor_changed[0]
            alloc(copy.bytes)
            starts["h2d", i] = env.now
            yield env.process(net.transfer("h2d", copy.bytes))
            h2d_done[i].succeed()

    env.process(issuing())
    env.process(compute())
    env.process(d2h())
    env.process(h2d())
    env.run()
    return max(finished["t"], env.now) if finished["t"] < math.inf else math.inf, state["peak"]
