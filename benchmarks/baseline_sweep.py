"""Where a baseline beats SlackSwap: every preset, workload and budget of a sweep.

    python benchmarks/baseline_sweep.py [--presets h200 a100-80gb] [--budgets 0.3 0.5 0.7]
        [--workloads bert-large bert-large-mlm] [--bound]

Profiles each reference workload on each preset (analytic, cached as ``reproduce``
caches them), plans it with every strategy at every budget, and prints SlackSwap's
retention, the best baseline's and the gap in points; a last line counts the cases where
a baseline is ahead. With ``--bound``, also the LP bound (``retention_bound``: no plan
retains more) and SlackSwap's distance to it in points, and a last line with the largest.
"""

from __future__ import annotations

import argparse
import time

from slackswap.core.hardware import hardware_presets, load_hardware
from slackswap.planners import STRATEGIES
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.reproduce import WORKLOADS, cached_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=None)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--budgets", nargs="*", type=float,
                        default=[0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    parser.add_argument("--bound", action="store_true",
                        help="also the LP bound and SlackSwap's distance to it")
    args = parser.parse_args()
    presets = args.presets or [p for p in hardware_presets() if not p.startswith("dgx")]
    behind = cases = 0
    print(f"{'preset':10s} {'workload':10s} {'budget':>6s} {'slackswap':>9s} "
          f"{'best baseline':>24s} {'gap':>6s} {'plan s':>6s}"
          + (f" {'bound':>7s} {'to bound':>8s}" if args.bound else ""))
    widest = (0.0, "")
    for preset in presets:
        hw = load_hardware(preset)
        for name in args.workloads:
            profile = cached_profile(name, hw)
            for budget in args.budgets:
                ctx = PlanContext(profile, hw, int(budget * profile.keep_all_peak))
                start = time.perf_counter()
                ours = ctx.attempt(STRATEGIES["slackswap"]) if ctx.reachable else None
                seconds = time.perf_counter() - start  # the baselines' plans included
                ours_r = ours[1].retention if ours and ours[1].feasible else 0.0
                best, best_r = "-", 0.0
                for strategy, make in STRATEGIES.items():
                    other = ctx.attempt(make) if ctx.reachable else None
                    if strategy != "slackswap" and other and other[1].feasible and (
                            other[1].retention > best_r):
                        best, best_r = strategy, other[1].retention
                cases += 1
                behind += best_r > ours_r + 1e-9
                line = (f"{preset:10s} {name:10s} {budget:6.2f} {100 * ours_r:9.2f} "
                        f"{best:>15s} {100 * best_r:8.2f} {100 * (ours_r - best_r):6.2f} "
                        f"{seconds:6.1f}")
                if args.bound:
                    bound = retention_bound(ctx)
                    to_bound = bound - ours_r if abs(bound - ours_r) > 1e-9 else 0.0
                    line += f" {100 * bound:7.2f} {100 * to_bound:8.2f}"
                    widest = max(widest, (to_bound, f"{preset} {name} {budget:.2f}"))
                print(line, flush=True)
    print(f"a baseline ahead in {behind} of {cases} cases")
    if args.bound:
        print(f"farthest from the bound: {100 * widest[0]:.2f} points ({widest[1]})")


if __name__ == "__main__":
    main()
