"""The host thread that issues the step: what each compute item costs it, and when it is
issued. Plain Python.

NOTE [host model]
    In eager PyTorch one host thread issues every kernel of the step, in compute-stream
    order; item k costs it h_k seconds (dispatch, plus the runtime's own Python when a
    plan is applied) and the GPU cannot start the item before it is issued. Nothing in
    a training step makes the host wait for the GPU (the loss is not read, nothing is
    synchronised before the step ends), so the host runs ahead without bound: item k is
    issued at H_k = h_0 + ... + h_k, known before the engine runs, and the engine adds
    start_k >= H_k. (A real launch queue holds about a thousand kernels and a blocking
    call would make the host wait; neither is modelled.) An offload is issued when
    autograd packs its tensor in forward; a reload when the host reaches the item at its
    prefetch point. Within an item the host does, in order: the packs autograd makes
    before it, the unpacks it reads, watching it, replaying it, then the dispatch that
    issues it. With every cost zero nothing changes: the engine runs as with no host.

NOTE [what the host pays]
    Every item pays ``dispatch_s``. The runtime's costs are paid only when a plan that
    moves something is applied (a keep-all step runs without ``slackswap.apply``):
    ``pack_s`` per tensor autograd saves in forward (its pack hook sees every one),
    ``watch_s`` per forward op the runtime watches (as ``core/watched.py`` decides,
    assuming the runtime has a profile of the step on the target; a profile without
    module events is watched whole), ``replay_s`` per recompute item, ``unpack_s``
    per moved saved tensor a backward op reads (approximating its unpacks), and, where
    the hardware gives them (NOTE [copy costs] in ``slackswap.core.hardware``),
    ``offload_s`` per offload, paid with the pack that issues it, and ``reload_s`` per
    reload, at the item where the host reaches its prefetch point.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

from slackswap.core.hardware import Host
from slackswap.core.offloads import forward_packs, offload_issues
from slackswap.core.plan import MIN_PLANNED_BYTES, Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.core.watched import watched_ops
from slackswap.sim.schedule import Schedule

__all__ = ["HostTimes", "host_times", "issue_times", "chain_end", "eager_step_time"]


@dataclass(frozen=True, slots=True)
class HostTimes:
    """When the host issues each item and copy of one schedule (seconds from step start)."""

    cost: list[float]  # per compute item: host seconds spent on it
    issued: list[float]  # per compute item: when the host has issued it
    d2h_ready: list[float]  # per D2H copy: when its pack hook issued it
    h2d_ready: list[float]  # per H2D copy: when the host reached its prefetch point

    @property
    def busy(self) -> float:
        """Seconds the host spent issuing the step."""
        return self.issued[-1] if self.issued else 0.0


def issue_times(costs: list[float]) -> list[float]:
    """Prefix sums: the host issues items one after another, never waiting."""
    # (``accumulate`` from 0.0 adds in the same order as a loop: the same sums)
    return list(accumulate(costs, initial=0.0))[1:]


def chain_end(durations: list[float], issued: list[float]) -> float:
    """End of a compute stream that runs items in order, each once it is issued:
    ``e_k = max(e_{k-1}, issued_k) + d_k`` (the engine with no memory limit or copies)."""
    end = 0.0
    for d, h in zip(durations, issued, strict=True):
        end = (end if end >= h else h) + d
    return end


def eager_step_time(profile: StepProfile, dispatch_s: float) -> float:
    """The ideal step: keep-all, no limit, no runtime, each op dispatched eagerly (the
    keep-all schedule has one item per op, in order)."""
    def ideal() -> float:
        durations = [op.time_s for op in profile.ops]
        if dispatch_s == 0:
            return sum(durations)
        return chain_end(durations, issue_times([dispatch_s] * len(durations)))

    return profile.derived(f"eager-step:{dispatch_s!r}", ideal)


def _moved(profile: StepProfile, plan: Plan) -> set[int]:
    """Saved activations the schedule offloads or recomputes (small ones are kept)."""
    planned = profile.derived("host:planned", lambda: {
        t.name: t.id for t in profile.saved_activations
        if t.producer is not None and t.name is not None and t.bytes >= MIN_PLANNED_BYTES})
    return {planned[n] for n, d in plan.decisions.items()
            if d != Decision.KEEP and n in planned}


def _watched(profile: StepProfile, plan: Plan) -> set[int]:
    """Forward ops the runtime watches for ``plan`` (``core/watched.py`` decides)."""
    if not profile.module_events:
        return set(range(sum(op.phase == "forward" for op in profile.ops)))
    return watched_ops(profile, plan)


def host_times(profile: StepProfile, plan: Plan, sched: Schedule, host: Host
               ) -> HostTimes | None:
    """What the host pays per item of ``sched`` (NOTE [what the host pays]) and when it
    issues items and copies; None when it pays nothing (the engine then has no host)."""
    items = sched.items
    if not items:
        return None
    cost = [host.dispatch_s] * len(items)
    # items run in order of position (a rebuild runs at the op that needs it): the
    # first item at or past an op is where the host reaches that op
    positions = [item.position for item in items]
    last = len(items) - 1

    def reached(op: int) -> int:
        return min(bisect_left(positions, op), last)

    runtime = any(d != Decision.KEEP for d in plan.decisions.values())
    if runtime and not sched.d2h and not any((
            host.pack_s, host.watch_s, host.replay_s, host.unpack_s, host.offload_s,
            host.reload_s)):
        # a runtime that costs the host nothing (the compiled path's: its copies are
        # kernels, ``on_compute_stream``) adds 0 to every item, and with no copy on the
        # link no pack times one: the same costs without the pass over the step
        runtime = False
    pack_end: dict[int, tuple[int, float]] = {}  # offloaded tensor -> (item, host s into it)
    if runtime:
        packed = [0.0] * len(items)
        offloaded = {copy.tensor for copy in sched.d2h}
        # NOTE [offloads issued in groups]: the pack of a group's last offload issues
        # every copy of the group, and the host pays for them there
        groups: dict[int, list[int]] = {}
        for tid, j in offload_issues(profile, offloaded).items():
            groups.setdefault(j, []).append(tid)
        for j, (_, before) in enumerate(forward_packs(profile)):
            k = reached(before)
            packed[k] += host.pack_s
            members = groups.get(j)
            if members:
                packed[k] += host.offload_s * len(members)
                offloaded.difference_update(members)
                pack_end.update(dict.fromkeys(members, (k, packed[k])))
        for copy in sched.d2h:  # a checkpoint, offloaded as the op after its producer runs
            if copy.tensor in offloaded:
                packed[min(copy.after_item + 1, last)] += host.offload_s
        if host.reload_s:
            for copy in sched.h2d:
                packed[reached(copy.issue_position)] += host.reload_s
        moved = _moved(profile, plan)
        watched = _watched(profile, plan)
        res = sched.residencies
        for k, item in enumerate(items):
            extra = packed[k]
            if item.recompute:
                extra += host.replay_s
            elif item.position >= sched.first_backward:
                if moved and item.reads:
                    unpacked = set()  # the moved tensors it reads (a loop: no call)
                    for r in item.reads:
                        if (tid := res[r].tensor) in moved:
                            unpacked.add(tid)
                    extra += host.unpack_s * len(unpacked)
            elif item.op in watched:
                extra += host.watch_s
            cost[k] += extra
    if not any(cost):
        return None
    issued = issue_times(cost)
    d2h_ready = []
    for copy in sched.d2h:
        k, into = pack_end.get(copy.tensor, (copy.after_item + 1, 0.0))
        before = issued[k - 1] if k > 0 else 0.0
        d2h_ready.append(max(before + into, issued[copy.after_item]))
    h2d_ready = [issued[reached(copy.issue_position)] for copy in sched.h2d]
    return HostTimes(cost, issued, d2h_ready, h2d_ready)
