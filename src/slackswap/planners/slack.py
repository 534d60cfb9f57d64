"""Transfer slack: which offloads the copy engines can hide (see NOTE [slack] in
:mod:`slackswap.planners.slackswap`).

NOTE [late slack]
    NOTE [slack] ends the window for copies out with forward. Where the last forward ops
    and the first backward ones take long and memory is short only in backward (a
    vocabulary projection and loss over a long sequence, at the loss), the last layers'
    activations can still cross during them and come back before backward reaches
    them. The late window lets a copy out land at any time, a reload be issued once its
    copy has landed, and an offload free backward's memory only once it has. On a step
    of at most ``SHORT_STEP_CANDIDATES`` candidates (one or two layers) the covers of the
    late window's offload sets are searched apart, last (``_searched_apart`` in
    :mod:`slackswap.planners.slackswap`), so they only add:
    added to the other starts, they led two bert-large-mlm layers at 60% into another
    basin (93.19 to 92.52); searched apart before the other stages, two Mistral-7B
    layers at 50% (91.82 to 90.56). Two GPT-NeoX-6.9B layers at 70% on a100-80gb
    (``benchmarks/family_survey.py``) reach 98.61% from 96.23 (the exact model's proven
    optimum: 98.70): layer 1's MLP input projection offloaded instead of recomputed.
    Whole reference workloads, where the head is a small part of the step, moved by
    -0.15 to +0.19 points with the late sets among the starts (the search's basin, not
    the window), and 24 OPT-1.3B layers (391 candidates) took 1.3-1.9 s longer to plan
    (6.0 s at 50%) for the same plans: it does not run on them.
"""

from __future__ import annotations

import math

from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import evicted_at

__all__ = ["d2h_landing", "reloads_in_time", "offload_within_slack", "eviction_credit",
           "latency_bound"]


def d2h_landing(ctx: PlanContext, chosen: list[Candidate], late: bool = False
                ) -> dict[str, float] | None:
    """When each offload lands, queued in production order; None if one misses forward
    (with ``late``, copies may land in backward: NOTE [late slack])."""
    link, t, landed = ctx.hw.host_link, 0.0, {}
    for c in sorted(chosen, key=lambda c: (c.produced_at, c.tensor)):
        t = max(t, c.produced_at) + link.latency_s + c.bytes / link.d2h_bandwidth
        if t > ctx.forward_end and not late:
            return None
        landed[c.name] = t
    return landed


def reloads_in_time(ctx: PlanContext, chosen: list[Candidate],
                    landed: dict[str, float] | None = None) -> bool:
    """Whether the reloads, queued from the start of backward in the order backward needs
    them, each issued once its copy out has ``landed`` (when given), land in time."""
    link, t = ctx.hw.host_link, ctx.forward_end
    for c in sorted(chosen, key=lambda c: (c.first_use, c.tensor)):
        t = max(t, landed[c.name] if landed else 0.0) + (
            link.latency_s + c.bytes / link.h2d_bandwidth)
        if t > c.needed_at:
            return False
    return True


def offload_within_slack(ctx: PlanContext, order: list[Candidate], late: bool = False
                         ) -> list[Candidate]:
    """Greedy in ``order``: take each activation whose offload and reload both stay
    hidden given those already taken (with ``late``, copies out may land in backward:
    NOTE [late slack])."""
    chosen: list[Candidate] = []
    for c in order:
        trial = [*chosen, c]
        landed = d2h_landing(ctx, trial, late)
        if landed is not None and reloads_in_time(ctx, trial, landed if late else None):
            chosen = trial
    return chosen


def latency_bound(ctx: PlanContext, c: Candidate) -> bool:
    """Whether ``c``'s copy spends longer on the link's fixed latency than on its bytes:
    offloading it frees less memory than the link time it takes would free on a larger
    copy (a layer norm's statistics, tens of KiB against 250 KiB per 10 us at 25 GB/s)."""
    link = ctx.hw.host_link
    return c.bytes < link.latency_s * link.d2h_bandwidth


def eviction_credit(ctx: PlanContext, offload: list[Candidate], ops: list[int],
                    late: bool = False) -> dict[int, int]:
    """Bytes the offloads free while each of ``ops`` runs: those past their last forward
    use whose copy has landed (queued in production order), or not needed yet in
    backward (and, with ``late``, landed there too). What recomputation must still cover
    is the excess less this."""
    # a copy that misses forward frees nothing there; with ``late``, none frees backward's
    # memory before it has landed either
    landed = d2h_landing(ctx, offload, late) or {}
    return {op: sum(c.bytes for c in offload
                    if evicted_at(c, op, ctx, landed.get(c.name, math.inf))
                    and not (late and op >= ctx.first_backward
                             and landed[c.name] > ctx.op_start[op]))
            for op in ops}
