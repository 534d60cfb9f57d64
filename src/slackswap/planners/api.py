"""``plan``: one entry point for every strategy, with budgets as users write them (the
strategies themselves, and planning in a context built once, are in
:mod:`slackswap.planners.strategies`, below the plan cache)."""

from __future__ import annotations

from pathlib import Path

from slackswap.core.hardware import Hardware, load_hardware, profile_hardware
from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.core.result import SimResult
from slackswap.core.units import format_bytes, resolve_budget
from slackswap.device_budget import resolve_fit
from slackswap.errors import InputError
from slackswap.planners.cache import cached_attempt
from slackswap.planners.context import PlanContext
from slackswap.planners.strategies import STRATEGIES, plan_in_context
from slackswap.sim.schedule import min_working_set
from slackswap.sim.simulate import simulate

__all__ = ["STRATEGIES", "plan", "plan_with_result", "plan_in_context",
           "smallest_feasible_budget"]

def smallest_feasible_budget(profile: StepProfile, hardware: Hardware | None = None) -> int:
    """A budget a plan is known to fit: the smallest memory limit under which the
    simulator runs the step with every planable activation recomputed, or every one
    offloaded (ops then wait for copies to land), found to within 0.1% of the keep-all
    peak and never below one op's working set. ``plan`` fits it (SlackSwap falls back to
    those plans); a hybrid plan may reach lower."""
    hw = hardware or profile_hardware(profile.hardware)
    ctx = PlanContext(profile, hw, profile.keep_all_peak)
    names = [c.name for c in ctx.candidates]
    floor = min_working_set(profile)[0]
    step = max(1, profile.keep_all_peak // 1000)
    best = profile.keep_all_peak
    for decision in (Decision.RECOMPUTE, Decision.OFFLOAD):
        uniform = ctx.plan("all", {n: decision for n in names})
        # with no limit nothing waits, so its peak is a limit it is known to fit
        lo, hi = floor, min(best, simulate(profile, uniform, hw).peak_bytes)
        while hi - lo > step:  # feasibility grows with the limit
            mid = (lo + hi) // 2
            if simulate(profile, uniform, hw, mid).feasible:
                hi = mid
            else:
                lo = mid + 1
        best = min(best, hi)
    return max(best, floor)


def plan_with_result(
    profile: StepProfile,
    budget: str | int | float,
    hardware: str | Path | Hardware | None = None,
    strategy: str = "slackswap",
    *,
    cached: bool = False,
) -> tuple[Plan, SimResult] | None:
    """Like :func:`plan`, with the simulated result; None when the strategy has no plan
    (a model with no transformer blocks for ``checkpoint-blocks``, say). The result may
    be infeasible: the strategy could not fit the budget."""
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy '{strategy}'; strategies: {', '.join(STRATEGIES)}")
    if not profile.saved_activations:
        raise InputError("the profile saves no activations for backward: there is nothing "
                         "to plan (the step runs as it is)")
    hw = load_hardware(hardware) if hardware else profile_hardware(profile.hardware)
    budget = resolve_fit(budget, profile, hw)
    ctx = PlanContext(profile, hw, resolve_budget(budget, profile.keep_all_peak))
    if cached:
        return cached_attempt(ctx, strategy)[0]
    return plan_in_context(ctx, strategy)


def plan(
    profile: StepProfile,
    budget: str | int | float,
    hardware: str | Path | Hardware | None = None,
    strategy: str = "slackswap",
    *,
    cached: bool = False,
) -> Plan:
    """Keep, offload or recompute for every saved activation so the step fits ``budget``:
    a fraction of the keep-all activation peak (``0.5``), bytes, a string (``"24GiB"``),
    or ``"fit"``: what the device's memory leaves once AdamW's mixed-precision model states
    and the CUDA context are taken out (:mod:`slackswap.device_budget`).

    ``cached``: the plan is read from the plan cache on disk when an earlier run made it,
    and stored there when not (NOTE [plan cache] in :mod:`slackswap.planners.cache`): for a
    profile made the same on every run (analytic, or traced), not one measured on a GPU.
    """
    hw = load_hardware(hardware) if hardware else profile_hardware(profile.hardware)
    budget = resolve_fit(budget, profile, hw)
    attempt = plan_with_result(profile, budget, hw, strategy, cached=cached)
    if attempt is None or not attempt[1].feasible:
        need = resolve_budget(budget, profile.keep_all_peak)
        if strategy != "slackswap":
            hybrid = plan_with_result(profile, budget, hw, cached=cached)
            if hybrid is not None and hybrid[1].feasible:
                raise InputError(f"budget {format_bytes(need)} is out of reach of "
                                 f"'{strategy}'; the 'slackswap' strategy fits it")
        floor = smallest_feasible_budget(profile, hw)
        reason = "fits no plan" if need < floor else f"is out of reach of '{strategy}'"
        raise InputError(
            f"budget {format_bytes(need)} {reason}; the smallest budget known to fit this "
            f"profile is {format_bytes(floor)} ({floor / profile.keep_all_peak:.1%} of the "
            f"keep-all peak; a 'slackswap' plan mixing offload and recompute may fit a "
            f"little below it)"
        )
    chosen = attempt[0].model_copy()  # (a cached plan is shared: its copy holds the result)
    chosen._result, chosen._hardware = attempt[1], hw.name
    return chosen
