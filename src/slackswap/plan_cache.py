"""Plans and bounds cached on disk by content, beside the profiles ``reproduce`` caches:
run again (another output, target or report), ``slackswap reproduce`` and ``slackswap
fit`` plan nothing, and solve no bound, they have before; ``slackswap.plan(model,
batch)`` off CUDA plans a step it has planned before at once.

NOTE [plan cache]
    A plan depends on the profile, the hardware, the budget and the strategy, and on
    the code that makes it: nothing else (node limits, not time limits, stop the solver;
    the perturbed search's generator is seeded). The key is the content of the first
    two, the budget and strategy, and a digest of SlackSwap's own source with the
    versions of SciPy (its HiGHS) and NumPy, so an edited checkout or another solver
    never reuses a plan. A hit is simulated once more, so its result carries the
    schedule and timeline a fresh plan's does, and reports the time the plan took to
    make when it was made. Only profiles that are the same on every run use it: the
    preset-driven commands' analytic ones, and the steps ``slackswap.plan(model, batch)``
    traces off CUDA (and ``auto`` and ``attach`` with it). A profile measured on a GPU
    differs from run to run and would only fill the cache. The bound
    (``retention_bound``) is cached the same way: on the reference workloads its LP is
    most of a warm ``reproduce``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pydantic

from slackswap.core.jsonio import atomic_write_text, content_digest
from slackswap.core.plan import Plan
from slackswap.planners import plan_in_context
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.search import Attempt
from slackswap.sim.simulate import simulate

__all__ = ["cache_root", "cached_attempt", "cached_bound"]


def cache_root() -> Path:
    """``$SLACKSWAP_CACHE``, or ``~/.cache/slackswap``."""
    return Path(os.environ.get("SLACKSWAP_CACHE") or Path.home() / ".cache" / "slackswap")


@functools.cache
def _code_digest() -> str:
    """SlackSwap's source, and the versions of the libraries a plan's numbers come from."""
    root = Path(__file__).parent
    digest = hashlib.sha256(f"{version('scipy')}|{version('numpy')}".encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cached(ctx: PlanContext, what: str, make: Callable[[], Any],
            read: Callable[[Any], Any], write: Callable[[Any], Any]) -> tuple[Any, float]:
    """``make()`` and the seconds it took, or the entry for ``ctx`` and ``what`` stored
    by an earlier run (``write`` turns the value into JSON, ``read`` back)."""
    key = hashlib.sha256(
        f"{content_digest(ctx.profile)}|{content_digest(ctx.hw)}|{ctx.budget}|{what}|"
        f"{version('slackswap')}|{_code_digest()}".encode()).hexdigest()[:24]
    path = cache_root() / "plans" / f"{what}-{key}.json"
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        return read(entry["value"]), float(entry["seconds"])
    except (OSError, ValueError, KeyError, TypeError, pydantic.ValidationError):
        pass  # none yet, or damaged: made (again)
    start = time.perf_counter()
    value = make()
    seconds = time.perf_counter() - start
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"value": write(value), "seconds": seconds}))
    except OSError:
        pass  # a cache that cannot be written only costs the next run its time
    return value, seconds


def cached_attempt(ctx: PlanContext, strategy: str) -> tuple[Attempt | None, float]:
    """``plan_in_context(ctx, strategy)`` and the seconds it took to make, from the cache
    when it is there (NOTE [plan cache])."""

    def read(plan: Any) -> Attempt | None:
        if plan is None:
            return None
        plan = Plan.model_validate(plan)
        return plan, simulate(ctx.profile, plan, ctx.hw, ctx.budget)

    return _cached(ctx, strategy, lambda: plan_in_context(ctx, strategy), read,
                   lambda attempt: None if attempt is None else attempt[0].model_dump(
                       mode="json"))


def cached_bound(ctx: PlanContext) -> tuple[float, float]:
    """``retention_bound(ctx)`` and the seconds it took to solve, from the cache when it
    is there (NOTE [plan cache])."""
    return _cached(ctx, "bound", lambda: retention_bound(ctx), float, float)
