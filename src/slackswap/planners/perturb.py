"""Iterated local search against the simulator: a short step's last stage, and, run much
longer, the search that puts a floor under the best plan (``benchmarks/best_known.py``).

NOTE [perturbed search]
    The planner's own searches move along structured neighbourhoods (single moves in a
    fixed order, swaps, kicks, exchanges) and settle in a basin. This one descends
    through every change of one decision (an activation kept, offloaded or recomputed; a
    checkpoint kept, offloaded or left to be rebuilt) in a random order, the first that
    scores better taken, then from the best plan so far changes two to six decisions at
    random and descends again, for a fixed number of simulations. The generator is seeded,
    so a plan still depends on the profile and hardware alone. Hand-written: this is the
    textbook iterated local search over a few dozen decisions, whose score is the
    simulator's, not a library's objective.
"""

from __future__ import annotations

import random

from slackswap.core.plan import Decision
from slackswap.planners.context import PlanContext
from slackswap.planners.search import Attempt, Score, scores_better
from slackswap.planners.search import score as _score

__all__ = ["perturbed_search"]

def perturbed_search(ctx: PlanContext, start: Attempt, simulations: int, seed: int = 0
                     ) -> Attempt:
    """The best plan NOTE [perturbed search] finds from ``start`` within ``simulations``
    plans scored, a plan met again counted again (``start`` itself when none scores
    better)."""
    rng = random.Random(seed)
    p = ctx.profile
    options: dict[str, list[Decision | None]] = {
        c.name: [Decision.KEEP, Decision.OFFLOAD]
        + ([Decision.RECOMPUTE] if c.name in p.recomputable else [])
        for c in ctx.candidates}
    options.update({n: [d for d in (Decision.KEEP, Decision.OFFLOAD, None)
                        if d != Decision.OFFLOAD or n in p.offloadable_checkpoints]
                    for n in sorted(p.checkpointable)})
    names = list(options)
    activations = {c.name for c in ctx.candidates}
    left = simulations
    seen: dict[tuple, Score] = {}  # scores only: a long search meets many plans
    top: list = [_score(start[1]), start]  # the best score met, and its attempt

    def score(d: dict[str, Decision | None]) -> Score:
        nonlocal left
        key = tuple(d[n] for n in names)
        left -= 1  # (a plan met again counts too: the search ends on a step of few plans)
        if key not in seen:
            plan = ctx.plan(start[0].strategy, {k: v for k, v in d.items() if v is not None})
            result = ctx.simulate(plan)
            seen[key] = _score(result)
            if scores_better(seen[key], top[0]):
                top[:] = [seen[key], (plan, result)]
        return seen[key]

    def descend(d: dict, s: Score) -> tuple[dict, Score]:
        improved = True
        while improved and left > 0:
            improved = False
            for n in rng.sample(names, len(names)):
                for v in options[n]:
                    if v != d[n] and left > 0 and scores_better(t := score({**d, n: v}), s):
                        d, s, improved = {**d, n: v}, t, True
                        break
        return d, s

    first = {n: start[0].decisions.get(n, Decision.KEEP if n in activations else None)
             for n in names}
    best, best_score = descend(first, score(first))
    while left > 0:
        trial = dict(best)
        for n in rng.sample(names, min(rng.randint(2, 6), len(names))):
            trial[n] = rng.choice(options[n])
        trial, s = descend(trial, score(trial))
        if scores_better(s, best_score):
            best, best_score = trial, s
    return top[1]

