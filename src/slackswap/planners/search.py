"""Fit a plan family to the budget by simulation: the loop every strategy shares."""

from __future__ import annotations

from collections.abc import Callable

from slackswap.core.plan import Plan
from slackswap.core.result import SimResult
from slackswap.planners.context import PlanContext

__all__ = ["Attempt", "Score", "better", "fit_margin", "smallest_fitting", "or_uniform",
           "score", "scores_better"]

Attempt = tuple[Plan, SimResult]
Score = tuple[bool, float]


def score(result: SimResult) -> Score:
    """Feasible first, then higher retention; among infeasible plans, less short."""
    return (True, result.retention) if result.feasible else (False, -float(result.shortfall_bytes))


def scores_better(a: Score, b: Score) -> bool:
    """``a`` is higher, and where ``b`` fits, by more than rounding."""
    return a > b and (not b[0] or a[1] > b[1] + 1e-9)


def better(a: Attempt | None, b: Attempt | None) -> Attempt | None:
    """The feasible one of higher simulated retention (``a`` on a tie)."""
    if a is None or not a[1].feasible:
        return b if b is not None and b[1].feasible else a
    if b is None or not b[1].feasible:
        return a
    return b if b[1].retention > a[1].retention else a


def fit_margin(ctx: PlanContext, make: Callable[[int], Plan | None],
               tries: int = 8) -> Attempt | None:
    """Call ``make(margin)`` with a growing safety margin (bytes below the budget) until
    the simulated plan fits; one more, larger margin is tried in case memory stalls cost
    more than the extra evictions. Returns the best feasible attempt."""
    margin, best = 0, None
    step = max(ctx.budget // 100, 1)
    fitted = False
    for _ in range(tries):
        plan = make(margin)
        if plan is None:
            break
        result = ctx.simulate(plan)
        best = better(best, (plan, result))
        if result.feasible:
            if fitted or result.stall_s.get("memory", 0.0) == 0.0:
                break
            fitted = True
            margin += 2 * step
        else:
            margin += max(result.shortfall_bytes, step)
    return best


def smallest_fitting(ctx: PlanContext, make: Callable[[int], Plan], lo: int,
                     hi: int, hi_first: bool = False) -> Attempt | None:
    """Binary search the smallest ``k`` in ``[lo, hi]`` whose plan is feasible (assuming
    more ``k`` evicts more); its attempt, or the attempt at ``hi`` when none fits. With
    ``hi_first`` (a family that often cannot reach the budget), ``hi`` is simulated
    first, and when it does not fit the search ends there."""
    found = None  # always the attempt at ``hi`` once set
    if hi_first:
        plan = make(hi)
        found = (plan, ctx.simulate(plan))
        if not found[1].feasible:
            return found
    while lo < hi:
        mid = (lo + hi) // 2
        plan = make(mid)
        result = ctx.simulate(plan)
        if result.feasible:
            hi, found = mid, (plan, result)
        else:
            lo = mid + 1
    if found is None:
        plan = make(hi)
        found = (plan, ctx.simulate(plan))
    return found


def or_uniform(ctx: PlanContext, attempt: Attempt | None, strategy: str,
               decisions: tuple[str, ...]) -> Attempt | None:
    """``attempt``, or when it does not fit, the best feasible plan that moves every
    candidate the same way (``decisions`` says which ways the strategy allows): near the
    smallest feasible budget a margin search can miss a plan these still find, and a
    budget above their peak is never out of the strategy's reach."""
    if attempt is not None and attempt[1].feasible:
        return attempt
    names = [c.name for c in ctx.candidates]
    for decision in decisions:
        plan = ctx.plan(strategy, {n: decision for n in names})
        attempt = better(attempt, (plan, ctx.simulate(plan)))
    return attempt
