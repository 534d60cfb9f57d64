"""Planners: keep, offload or recompute for every saved activation under a memory budget.

Plain Python (no torch): each strategy is a function of a :class:`PlanContext` that
returns a plan and its simulated result.
"""

from slackswap.planners.api import (
    STRATEGIES,
    plan,
    plan_in_context,
    plan_with_result,
    smallest_feasible_budget,
)

__all__ = ["STRATEGIES", "plan", "plan_in_context", "plan_with_result",
           "smallest_feasible_budget"]
