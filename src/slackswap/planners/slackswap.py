"""The SlackSwap planner: offload within the transfer slack what is expensive to rebuild,
recompute the rest at least cost, refine against the simulator.

NOTE [slack]
    The D2H engine can move bytes while forward computes, the H2D engine while backward
    computes. An offload is *within slack* when, queued in production order behind the
    offloads already chosen, its copy lands before forward ends, and, queued in the order
    backward needs them from the start of backward, its reload lands before the op that
    needs it starts. Activations are considered most expensive to rebuild per byte first
    (attention and GEMM outputs), so the slack goes where recomputation would cost most.
    An offload lowers memory at a point of pressure only once its copy has landed there.
    What still exceeds the budget is covered by the least-cost recompute set
    (:mod:`slackswap.planners.recompute`), whose rebuild costs count the never-saved
    inputs a rebuild needs. The simulator then checks the plan: a shortfall raises the
    safety margin and the plan is rebuilt. A reload that lands just in time in the
    keep-all timeline can still stall once recomputation stretches backward, so the
    planner also tries spending part of the slack or none of it, and keeps the plan the
    simulator rates best. The reload start points of that plan become its prefetch points.
"""

from __future__ import annotations

from collections import defaultdict

from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import evicted_at, pressure_points
from slackswap.planners.prefetch import with_prefetch_points
from slackswap.planners.recompute import choose_recompute, rebuild_cost
from slackswap.planners.search import Attempt, fit_margin, or_uniform
from slackswap.planners.slack import d2h_landing, offload_within_slack

__all__ = ["slackswap", "SLACK_FRACTIONS"]

SLACK_FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.0)


def slackswap(ctx: PlanContext) -> Attempt | None:
    cands = ctx.candidates
    cost = {c.name: rebuild_cost(ctx, c) for c in cands}
    # per byte of everything the producer saves: rebuilding one output rebuilds them all
    made = defaultdict(int)
    for c in cands:
        made[c.producer] += c.bytes
    order = sorted(cands, key=lambda c: (-cost[c.name] / made[c.producer], c.producer))
    slack = offload_within_slack(ctx, order)
    total = sum(c.bytes for c in slack)
    best: Attempt | None = None
    for fraction in SLACK_FRACTIONS:
        offload, spent = [], 0
        for c in slack:  # the most expensive to rebuild first
            if spent + c.bytes <= fraction * total:
                offload.append(c)
                spent += c.bytes
        attempt = _hybrid(ctx, offload)
        if attempt is not None and attempt[1].feasible and (
                best is None or attempt[1].retention > best[1].retention):
            best = attempt
        if best is not None and best[1].stall_s["reload"] == best[1].stall_s["memory"] == 0:
            break  # the copies hide entirely: spending less slack only adds recompute
    best = or_uniform(ctx, best, "slackswap", ("offload", "recompute"))
    return with_prefetch_points(ctx, best) if best is not None else None


def _hybrid(ctx: PlanContext, offload: list[Candidate]) -> Attempt | None:
    landed = d2h_landing(ctx, offload) or {}
    offloaded = {c.name for c in offload}
    rest = [c for c in ctx.candidates if c.name not in offloaded]

    def make(margin: int):
        points = pressure_points(ctx, margin)
        credit = {pt.op: sum(c.bytes for c in offload
                             if evicted_at(c, pt.op, ctx, landed[c.name])) for pt in points}
        chosen = choose_recompute(ctx, rest, points, credit)
        if chosen is None:
            return None
        decisions = {c.name: "offload" for c in offload}
        decisions.update({n: "recompute" for n in chosen})
        return ctx.plan("slackswap", decisions)

    return fit_margin(ctx, make)
