"""The best plan a long randomized search finds, against SlackSwap's (issue 12).

Run: python benchmarks/best_known.py [--steps bert-large-mlm@2] [--budgets 0.3,0.4,0.5]
         [--hardware a100-80gb] [--simulations 100000] [--seed 0]
Where the exact model's bound is loose or unproven, the planner's gap to the best plan
is unknown; this puts a floor under the best plan. An iterated local search against the
simulator, from SlackSwap's plan: every single change of one activation's decision
(keep, offload, recompute) or one checkpoint's (kept, offloaded, rebuilt) tried in a
seeded random order until none improves, then a random change of two to six decisions
and again, ``--simulations`` in all. The same seed gives the same plans on any machine.
Prints both retentions and the decisions where the plans differ.
"""

from __future__ import annotations

import argparse
import random

from exact_gap import small_contexts  # (a script's own folder is on its path)

import slackswap
from slackswap.errors import SlackSwapError
from slackswap.planners import STRATEGIES
from slackswap.planners.context import PlanContext


def search(ctx: PlanContext, start: dict[str, str], simulations: int, seed: int
           ) -> tuple[dict[str, str], tuple[bool, float]]:
    """The best decisions found from ``start`` and their score (fits, retention)."""
    rng = random.Random(seed)
    p = ctx.profile
    options: dict[str, list[str | None]] = {
        c.name: ["keep", "offload"] + (["recompute"] if c.name in p.recomputable else [])
        for c in ctx.candidates}
    options.update({n: ["keep", "offload", None] for n in sorted(p.checkpointable)})
    names = list(options)
    left = simulations

    def score(d: dict[str, str | None]) -> tuple[bool, float]:
        nonlocal left
        left -= 1
        try:
            r = ctx.simulate(ctx.plan("best-known", {k: v for k, v in d.items() if v}))
        except SlackSwapError:  # a checkpoint the plan cannot hold
            return (False, float("-inf"))
        return (True, r.retention) if r.feasible else (False, -float(r.shortfall_bytes))

    def better(a: tuple[bool, float], b: tuple[bool, float]) -> bool:
        return a > b and (not b[0] or a[1] > b[1] + 1e-9)

    def descend(d: dict, s: tuple[bool, float]) -> tuple[dict, tuple[bool, float]]:
        improved = True
        while improved and left > 0:
            improved = False
            for n in rng.sample(names, len(names)):
                for v in options[n]:
                    if v != d[n] and left > 0 and better(t := score({**d, n: v}), s):
                        d, s, improved = {**d, n: v}, t, True
                        break
        return d, s

    activations = {c.name for c in ctx.candidates}  # (checkpoints are rebuilt unless held)
    best = {n: start.get(n, "keep" if n in activations else None) for n in names}
    best, best_score = descend(best, score(best))
    while left > 0:
        trial = dict(best)
        for n in rng.sample(names, rng.randint(2, 6)):
            trial[n] = rng.choice(options[n])
        trial, s = descend(trial, score(trial))
        if better(s, best_score):
            best, best_score = trial, s
    return {k: v for k, v in best.items() if v}, best_score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="bert-large-mlm@2")
    parser.add_argument("--budgets", default="0.3,0.4,0.5")
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--simulations", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hw = slackswap.load_hardware(args.hardware)
    for step, budget, ctx in small_contexts(args.steps, args.budgets, hw):
        if ctx is None:
            print(f"{step} {budget:.0%}: below the step's working set")
            continue
        ours = ctx.attempt(STRATEGIES["slackswap"])
        start = dict(ours[0].decisions) if ours is not None else {}
        found, (fits, retention) = search(ctx, start, args.simulations, args.seed)
        mine = f"{ours[1].retention:.2%}" if ours and ours[1].feasible else "none"
        print(f"{step} {budget:.0%} on {args.hardware}: slackswap {mine}, best found "
              f"{retention:.2%}" if fits else "nothing fits", flush=True)
        for n in sorted(set(found) | set(start)):
            if found.get(n, "keep") != start.get(n, "keep"):
                print(f"  {n}: {start.get(n, 'keep')} -> {found.get(n, 'keep')}")


if __name__ == "__main__":
    main()
