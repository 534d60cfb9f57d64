"""Prefetch points: where a plan's reloads start, written into the plan for the runtime."""

from __future__ import annotations

from bisect import bisect_right

from slackswap.planners.context import PlanContext
from slackswap.planners.search import Attempt

__all__ = ["with_prefetch_points"]


def with_prefetch_points(ctx: PlanContext, attempt: Attempt) -> Attempt:
    """Write down where each reload started in the simulated step as the plan's prefetch
    points, so a runtime issues them at the same places; keep them if the step agrees."""
    plan, result = ctx.with_run(attempt)
    run = result.run
    items, h2d = run.schedule.items, run.schedule.h2d
    if not h2d:  # no reload on a copy engine (copies on the compute stream reload in place)
        return plan, result
    compute = [s for s in run.timeline.spans if s.stream == "compute"]
    starts = [s.start for s in compute]
    prefetch = {}
    for span in (s for s in run.timeline.spans if s.stream == "h2d"):
        # the kernel running when the reload started, or the next one to start
        k = bisect_right(starts, span.start) - 1
        if k < 0 or compute[k].end <= span.start:
            k += 1
        if k < len(compute):
            name = ctx.profile.tensors[h2d[span.index].tensor].name
            prefetch[name] = items[compute[k].index].position
    explicit = plan.model_copy(update={"prefetch": prefetch})
    checked = ctx.simulate(explicit)
    if checked.feasible and checked.retention >= result.retention:
        return ctx.with_run((explicit, checked))
    return plan, result
