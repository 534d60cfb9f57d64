"""The bound's row families (``planners/bound_rows.py``), one at a time: each, added to the
program, is still a bound on every plan (no simulated assignment beats it), never loosens
it, and on some small steps tightens it: the unit does work of its own."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest
from stepgraphs import NO_HOST, best_assignment, block_step, link_hardware

from slackswap.planners.bound import _BoundLP, _strongest
from slackswap.planners.context import PlanContext
from slackswap.planners.exact import _every_point
from slackswap.planners.memory import pressure_points

THRESHOLDS, POINTS = 4, 12


def _steps(count: int) -> list[tuple[PlanContext, tuple[str, ...]]]:
    """Small block-shaped steps (checkpoints to keep, offload or rebuild; module segments
    on two in three) at budgets where keep-all does not fit, with few enough candidates
    to try every assignment; host costs on even seeds, links slow enough for copies to
    matter."""
    out = []
    for seed in range(2000):
        rng = random.Random(seed)
        profile = block_step(rng, rng.randint(1, 2))
        for t in profile.tensors:
            t.bytes *= 100
        if seed % 3:
            forward = sum(op.phase == "forward" for op in profile.ops)
            profile.module_events = sorted(rng.sample(range(1, forward + 1),
                                                      rng.randint(1, forward)))
        rate = rng.uniform(5e7, 2e9)
        hw = link_hardware(rate, rate, rate, rate * rng.uniform(0.3, 1), 1e-6,
                           host=NO_HOST if seed % 2 else None)
        ctx = PlanContext(profile, hw,
                          int(rng.choice([0.3, 0.4, 0.5, 0.6, 0.7]) * profile.keep_all_peak))
        checkpoints = tuple(sorted(profile.checkpointable))
        if (ctx.reachable and pressure_points(ctx)
                and 2 <= len(ctx.candidates) + len(checkpoints) <= 6):
            out.append((ctx, checkpoints))
        if len(out) == count:
            break
    return out


STEPS = _steps(24)


@functools.cache
def _best(k: int) -> float:
    """The best simulated retention of step ``k`` over every assignment."""
    ctx, checkpoints = STEPS[k]
    return best_assignment(ctx, checkpoints)


def _lp(ctx: PlanContext, exact: bool) -> _BoundLP:
    """The program with its decision rows only: the LP's points and timing options, or the
    exact model's (every point, rebuild timing, ``tight``)."""
    if exact:
        lp = _BoundLP(ctx, _every_point(ctx), 2, checkpoint_timing=True, rebuild_timing=True,
                      tight=True)
    else:
        lp = _BoundLP(ctx, _strongest(ctx, pressure_points(ctx), POINTS), 2)
    lp.choice_rows()
    return lp


def _lp_rows(lp: _BoundLP) -> None:
    """Every family the LP bound has (``_BoundLP.build``), at every point."""
    thresholds, points = len(lp.acts) + 1, len(lp.p.ops)
    lp.memory_rows(thresholds)
    lp.reload_rows(points)
    lp.transfer_rows(thresholds, points)
    lp.host_rows(points)


# family -> (the exact model's options and integer decisions, the rows below it, its rows)
FAMILIES: dict[str, tuple[bool, Callable[[_BoundLP], None], Callable[[_BoundLP], None]]] = {
    "memory": (False, lambda lp: None, lambda lp: lp.memory_rows(THRESHOLDS)),
    "time": (False, lambda lp: lp.memory_rows(THRESHOLDS),
             lambda lp: (lp.reload_rows(POINTS), lp.transfer_rows(THRESHOLDS, POINTS))),
    "host": (False, lambda lp: lp.memory_rows(THRESHOLDS), lambda lp: lp.host_rows(POINTS)),
    "rebuild timing": (True, lambda lp: lp.memory_rows(len(lp.acts) + 1),
                       lambda lp: lp.lateness_rows()),
    "reload timing": (True, _lp_rows, lambda lp: lp.timing_rows()),
    "queue": (True, _lp_rows, lambda lp: lp.queue_rows()),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_bounds_every_plan_and_tightens_some(family: str) -> None:
    exact, below, rows = FAMILIES[family]
    tighter = 0
    for k, (ctx, _) in enumerate(STEPS):
        without = _lp(ctx, exact)
        below(without)
        loose = without.retention(without.solve(integral=exact))
        lp = _lp(ctx, exact)
        below(lp)
        rows(lp)
        bound = lp.retention(lp.solve(integral=exact))
        assert bound <= loose + 1e-9, (family, k)
        assert _best(k) <= bound + 1e-9, (family, k)
        tighter += bound < loose - 1e-6
    assert tighter >= 1, f"the {family} rows never tightened the bound"
