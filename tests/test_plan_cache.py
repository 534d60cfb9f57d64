"""NOTE [plan cache]: a cached plan is the plan, its result the fresh plan's, and nothing
but the same profile, hardware, budget, strategy and code finds it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from stepgraphs import block_step

import slackswap
import slackswap.plan_cache as plan_cache
from slackswap.core.hardware import with_overrides
from slackswap.planners import STRATEGIES, plan_in_context
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path))
    return tmp_path / "plans"


def _context(seed: int = 0, fraction: float = 0.5, hw=None) -> PlanContext:
    profile = block_step(random.Random(seed), 3)
    hw = hw or slackswap.load_hardware("a100-80gb")
    return PlanContext(profile, hw, int(fraction * profile.keep_all_peak))


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (a[0].model_dump() == b[0].model_dump() and a[1].model_dump() == b[1].model_dump()
            and a[1].run is not None and b[1].run is not None
            and a[1].run.timeline.spans == b[1].run.timeline.spans)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_hit_is_the_fresh_plan_and_its_result(strategy: str, cache: Path) -> None:
    fresh = plan_in_context(_context(), strategy)
    made, seconds = plan_cache.cached_attempt(_context(), strategy)
    assert _same(made, fresh)
    assert len(list(cache.iterdir())) == 1
    again, recorded = plan_cache.cached_attempt(_context(), strategy)
    assert _same(again, fresh) and recorded == seconds  # the time it took to make


def test_only_the_same_inputs_and_code_find_a_plan(cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base = _context()
    plan_cache.cached_attempt(base, "slackswap")
    hw = with_overrides(base.hw, {"host.watch_s": 2 * base.hw.host.watch_s})
    for other in (_context(seed=1), _context(fraction=0.6), _context(hw=hw)):
        plan_cache.cached_attempt(other, "slackswap")
    plan_cache.cached_attempt(base, "capuchin")
    assert len(list(cache.iterdir())) == 5
    plan_cache.cached_attempt(base, "slackswap")
    assert len(list(cache.iterdir())) == 5
    monkeypatch.setattr(plan_cache, "_code_digest", lambda: "edited")  # a changed planner
    plan_cache.cached_attempt(base, "slackswap")
    assert len(list(cache.iterdir())) == 6


def test_a_damaged_entry_is_planned_again(cache: Path) -> None:
    fresh, _ = plan_cache.cached_attempt(_context(), "slackswap")
    [entry] = cache.iterdir()
    entry.write_text('{"value": {"decisions": 3}')
    again, _ = plan_cache.cached_attempt(_context(), "slackswap")
    assert _same(again, fresh)
    assert entry.read_text().startswith('{"value": {')  # written whole again
    assert _same(plan_cache.cached_attempt(_context(), "slackswap")[0], fresh)


def test_the_bound_is_cached_as_solved(cache: Path) -> None:
    bound, seconds = plan_cache.cached_bound(_context())
    assert bound == retention_bound(_context()) > 0
    assert plan_cache.cached_bound(_context()) == (bound, seconds)
    assert len(list(cache.iterdir())) == 1


def test_a_traced_step_is_planned_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``slackswap.plan(model, batch)`` off CUDA: a step traced the same way again is
    planned from the cache (the planner is not asked), and the plan is the same."""
    from factories import mlp

    model, x = mlp()
    first = slackswap.plan(model, x, budget=0.5)
    assert len(list(cache.iterdir())) == 1

    def planner_asked(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(plan_cache, "plan_in_context", planner_asked)
    again = slackswap.plan(model, x, budget=0.5)
    assert again.model_dump() == first.model_dump()
    assert again._profile is not None  # so that ``apply`` prefetches without being told
    with pytest.raises(AssertionError, match="planned again"):  # another budget: a miss
        slackswap.plan(model, x, budget=0.6)
