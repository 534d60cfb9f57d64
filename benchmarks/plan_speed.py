"""Planning time against the number of saved activations (target: < 5 s per workload).

Run: python benchmarks/plan_speed.py [--model gpt2-xl] [--budget 0.5]
Profiles the model at a quarter, half and all of its layers (1x, 2x, 4x the saved
activations), then times every strategy and the bound at the budget.
"""

from __future__ import annotations

import argparse
import time

import slackswap
from slackswap.models import MODEL_PRESETS, build_model
from slackswap.planners import STRATEGIES, plan_with_result
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()
    layers = MODEL_PRESETS[args.model].layers
    print(f"{'layers':>6s} {'saved':>6s} " + " ".join(f"{s[:10]:>10s}" for s in STRATEGIES)
          + f" {'bound':>7s}")
    for depth in (layers // 4, layers // 2, layers):
        MODEL_PRESETS[f"{args.model}@{depth}"] = MODEL_PRESETS[args.model].__class__(
            **{**MODEL_PRESETS[args.model].__dict__, "name": f"{args.model}@{depth}",
               "layers": depth})
        model, batch = build_model(f"{args.model}@{depth}")
        profile = slackswap.profile(model, batch, name=f"{args.model}@{depth}")
        times = []
        for strategy in STRATEGIES:
            start = time.perf_counter()
            plan_with_result(profile, args.budget, strategy=strategy)
            times.append(time.perf_counter() - start)
        ctx = PlanContext(profile, slackswap.load_hardware(profile.hardware),
                          int(args.budget * profile.keep_all_peak))
        start = time.perf_counter()
        retention_bound(ctx)
        bound = time.perf_counter() - start
        print(f"{depth:6d} {len(profile.saved_activations):6d} "
              + " ".join(f"{t:9.2f}s" for t in times) + f" {bound:6.2f}s")


if __name__ == "__main__":
    main()
