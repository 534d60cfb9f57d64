"""The strategies by name, and planning with one in a context built once: what the plan
cache (:mod:`slackswap.planners.cache`) stores and :func:`slackswap.plan` calls."""

from __future__ import annotations

from collections.abc import Callable

from slackswap.core.plan import Decision, Plan
from slackswap.planners import baselines
from slackswap.planners.context import PlanContext
from slackswap.planners.prefetch import with_prefetch_points
from slackswap.planners.search import Attempt
from slackswap.planners.slackswap import slackswap

__all__ = ["STRATEGIES", "plan_in_context"]

STRATEGIES: dict[str, Callable[[PlanContext], Attempt | None]] = {
    "slackswap": slackswap,
    "recompute-only": baselines.recompute_only,
    "checkpoint-blocks": baselines.checkpoint_blocks,
    "checkpoint-offload": baselines.checkpoint_offload,
    "offload-only": baselines.offload_only,
    "capuchin": baselines.capuchin,
    "module-policy": baselines.module_policy,
}


def plan_in_context(ctx: PlanContext, strategy: str = "slackswap") -> Attempt | None:
    """``strategy``'s plan and simulated result for a context built once (``reproduce``
    plans every strategy in one): keep-all when it fits, None when the budget is below
    one op's working set or the strategy has no plan, with the reload starts written
    into an offloading plan."""
    if not ctx.reachable:
        return None
    if ctx.budget >= ctx.keep_all_peak:
        keep = Plan.keep_all(ctx.profile).model_copy(
            update={"strategy": strategy, "budget_bytes": ctx.budget})
        return keep, ctx.simulate(keep)
    attempt = ctx.attempt(STRATEGIES[strategy])
    if (attempt is not None and attempt[1].feasible and not attempt[0].prefetch
            and Decision.OFFLOAD in attempt[0].decisions.values()):
        # the simulator's default reload starts, written down so the runtime follows them
        attempt = with_prefetch_points(ctx, attempt)
    return attempt if attempt is None else ctx.with_run(attempt)
