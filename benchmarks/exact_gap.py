"""SlackSwap against the exact model's optimum on small steps (the gate's cases, issue 12).

Run: python benchmarks/exact_gap.py [--steps bert-large-mlm@1,llama-7b@1]
         [--budgets 0.5,0.6,0.7] [--op-ends] [--tight] [--time-limit 120] [--store FILE]
         [--search SIMULATIONS] [--rebuild-depth 3]
For each step and budget: SlackSwap's simulated retention, the integer program's optimum
(a retention no plan exceeds; 'proven' when solved to optimality) and the program's own
plan, simulated. Where that plan reaches the optimum the best plan is known exactly, and
a gap there is the planner's. ``--op-ends --tight`` is the program at its tightest
(NOTE [tight timing] in ``planners/bound.py``): minutes per case instead of seconds.
Profiles are cached as ``slackswap reproduce`` caches them. ``--store`` adds each bound,
proven or the solver's dual bound at its time limit (a retention no plan exceeds either
way), with the best plan known (the program's, SlackSwap's, or with ``--search`` the best
of a seeded search from SlackSwap's, ``benchmarks/best_known.py``'s) and digests of the
profile and hardware it was solved for, to a JSON file (``tests/data/exact_optima.json``
is the gate's: ``tests/test_exact.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import slackswap
from slackswap.core.hardware import Hardware
from slackswap.core.jsonio import atomic_write_text, content_digest
from slackswap.models.presets import with_layers
from slackswap.planners import STRATEGIES
from slackswap.planners.bound import REBUILD_DEPTH
from slackswap.planners.context import PlanContext
from slackswap.planners.exact import exact_optimum
from slackswap.planners.perturb import perturbed_search
from slackswap.reproduce import cached_profile


def small_contexts(steps: str, budgets: str, hw: Hardware
                   ) -> Iterator[tuple[str, float, PlanContext | None]]:
    """Each step (``name@layers``, comma-separated) at each budget (fractions of its
    keep-all peak): its planning context, or None below the step's working set."""
    for step in steps.split(","):
        base, layers = step.split("@")
        profile = cached_profile(with_layers(base, int(layers)), hw)
        for budget in (float(b) for b in budgets.split(",")):
            ctx = PlanContext(profile, hw, int(budget * profile.keep_all_peak))
            yield step, budget, ctx if ctx.reachable else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="bert-large-mlm@1,llama-7b@1")
    parser.add_argument("--budgets", default="0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--op-ends", action="store_true")
    parser.add_argument("--tight", action="store_true")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--rebuild-depth", type=int, default=REBUILD_DEPTH,
                        help="links of rebuilt tensors a read is followed through "
                             "(NOTE [read depth] in planners/exact.py)")
    parser.add_argument("--store", type=Path, default=None)
    parser.add_argument("--search", type=int, default=0,
                        help="simulations of a seeded search for a better plan to store")
    args = parser.parse_args()
    stored = json.loads(args.store.read_text()) if args.store and args.store.exists() else []
    hw = slackswap.load_hardware(args.hardware)
    print(f"{'step':18s} {'budget':>6s} {'slackswap':>9s} {'bound':>8s} {'proven':>6s} "
          f"{'its plan':>8s} {'gap':>6s} {'solve':>6s}")
    for step, budget, ctx in small_contexts(args.steps, args.budgets, hw):
        if ctx is None:
            print(f"{step:18s} {budget:6.0%} below the step's working set")
            continue
        start = time.perf_counter()
        exact = exact_optimum(ctx, time_limit_s=args.time_limit, op_ends=args.op_ends,
                              tight=args.tight, rebuild_depth=args.rebuild_depth)
        solve = time.perf_counter() - start
        attempt = ctx.attempt(STRATEGIES["slackswap"])
        ours = attempt[1].retention
        print(f"{step:18s} {budget:6.0%} {ours:9.2%} {exact.bound:8.2%} "
              f"{'yes' if exact.proven else 'no':>6s} {exact.achieved:8.2%} "
              f"{(exact.bound - ours) * 100:6.2f} {solve:5.0f}s", flush=True)
        if args.store and exact.plan is not None:
            known = [("program", exact.plan, exact.achieved), ("slackswap", *attempt)]
            if args.search:
                known.append(("search", *perturbed_search(ctx, attempt, args.search)))
            known = [(source, plan, r if isinstance(r, float) else
                      r.retention if r.feasible else 0.0) for source, plan, r in known]
            source, plan, retention = max(known, key=lambda k: k[2])
            entry = {"step": step, "budget": budget, "hardware": args.hardware,
                     "op_ends": args.op_ends, "tight": args.tight,
                     "rebuild_depth": args.rebuild_depth, "bound": exact.bound,
                     "proven": exact.proven, "time_limit_s": args.time_limit,
                     "plan": {"decisions": plan.decisions, "prefetch": plan.prefetch},
                     "plan_source": source, "plan_retention": retention,
                     "profile_digest": content_digest(ctx.profile),
                     "hardware_digest": content_digest(hw)}
            stored = [e for e in stored if (e["step"], e["budget"], e["hardware"])
                      != (step, budget, args.hardware)] + [entry]
            atomic_write_text(args.store, json.dumps(stored, indent=1) + "\n")


if __name__ == "__main__":
    main()
