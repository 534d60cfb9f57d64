"""The best plan a long randomized search finds, against SlackSwap's (issue 12).

Run: python benchmarks/best_known.py [--steps bert-large-mlm@2] [--budgets 0.3,0.4,0.5]
         [--hardware a100-80gb[,h100-sxm,...]] [--simulations 100000] [--seed 0]
Where the exact model's bound is loose or unproven, the planner's gap to the best plan
is unknown; this puts a floor under the best plan: the iterated local search that ends
the planner on a short step (NOTE [perturbed search] in ``planners/perturb.py``), from
SlackSwap's plan, with ``--simulations`` instead of the planner's few hundred. The same
seed gives the same plans on any machine. Prints both retentions and the decisions where
the plans differ. A survey of every preset: ``--hardware`` a comma-separated list, e.g.
``--steps bert-large-mlm@2,gpt2-xl@2,llama-7b@1 --budgets 0.3,0.4,0.5,0.6,0.7,0.8,0.9
--simulations 2000`` (a few minutes a preset).
"""

from __future__ import annotations

import argparse

from exact_gap import small_contexts  # (a script's own folder is on its path)

import slackswap
from slackswap.planners import STRATEGIES
from slackswap.planners.perturb import perturbed_search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="bert-large-mlm@2")
    parser.add_argument("--budgets", default="0.3,0.4,0.5")
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--simulations", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in args.hardware.split(","):
        survey(args, name)


def survey(args: argparse.Namespace, hardware: str) -> None:
    """Each step and budget on one hardware preset."""
    hw = slackswap.load_hardware(hardware)
    for step, budget, ctx in small_contexts(args.steps, args.budgets, hw):
        if ctx is None:
            print(f"{step} {budget:.0%} on {hardware}: below the step's working set")
            continue
        ours = ctx.attempt(STRATEGIES["slackswap"])
        if ours is None:
            print(f"{step} {budget:.0%} on {hardware}: slackswap has no plan to start from")
            continue
        plan, result = perturbed_search(ctx, ours, args.simulations, args.seed)
        mine, found = (f"{r.retention:.2%}" if r.feasible else "none fits"
                       for r in (ours[1], result))
        print(f"{step} {budget:.0%} on {hardware}: slackswap {mine}, best found "
              f"{found}", flush=True)
        start, found = ours[0].decisions, plan.decisions
        checkpoints = ctx.profile.checkpointable  # (one left out of a plan is rebuilt)
        for n in sorted(set(found) | set(start)):
            was, now = (d.get(n, "rebuilt" if n in checkpoints else "keep")
                        for d in (start, found))
            if was != now:
                print(f"  {n}: {was} -> {now}")


if __name__ == "__main__":
    main()
