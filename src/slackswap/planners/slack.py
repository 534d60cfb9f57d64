"""Transfer slack: which offloads the copy engines can hide (see NOTE [slack] in
:mod:`slackswap.planners.slackswap`)."""

from __future__ import annotations

import math

from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import evicted_at

__all__ = ["d2h_landing", "reloads_in_time", "offload_within_slack", "eviction_credit",
           "latency_bound"]


def d2h_landing(ctx: PlanContext, chosen: list[Candidate]) -> dict[str, float] | None:
    """When each offload lands, queued in production order; None if one misses forward."""
    link, t, landed = ctx.hw.host_link, 0.0, {}
    for c in sorted(chosen, key=lambda c: (c.produced_at, c.tensor)):
        t = max(t, c.produced_at) + link.latency_s + c.bytes / link.d2h_bandwidth
        if t > ctx.forward_end:
            return None
        landed[c.name] = t
    return landed


def reloads_in_time(ctx: PlanContext, chosen: list[Candidate]) -> bool:
    link, t = ctx.hw.host_link, ctx.forward_end
    for c in sorted(chosen, key=lambda c: (c.first_use, c.tensor)):
        t += link.latency_s + c.bytes / link.h2d_bandwidth
        if t > c.needed_at:
            return False
    return True


def offload_within_slack(ctx: PlanContext, order: list[Candidate]) -> list[Candidate]:
    """Greedy in ``order``: take each activation whose offload and reload both stay
    hidden given those already taken."""
    chosen: list[Candidate] = []
    for c in order:
        trial = [*chosen, c]
        if d2h_landing(ctx, trial) is not None and reloads_in_time(ctx, trial):
            chosen = trial
    return chosen


def latency_bound(ctx: PlanContext, c: Candidate) -> bool:
    """Whether ``c``'s copy spends longer on the link's fixed latency than on its bytes:
    offloading it frees less memory than the link time it takes would free on a larger
    copy (a layer norm's statistics, tens of KiB against 250 KiB per 10 us at 25 GB/s)."""
    link = ctx.hw.host_link
    return c.bytes < link.latency_s * link.d2h_bandwidth


def eviction_credit(ctx: PlanContext, offload: list[Candidate], ops: list[int]
                    ) -> dict[int, int]:
    """Bytes the offloads free while each of ``ops`` runs: those past their last forward
    use whose copy has landed (queued in production order), or not needed yet in
    backward. What recomputation must still cover is the excess less this."""
    landed = d2h_landing(ctx, offload) or {}  # a copy that misses forward frees nothing there
    return {op: sum(c.bytes for c in offload
                    if evicted_at(c, op, ctx, landed.get(c.name, math.inf))) for op in ops}
