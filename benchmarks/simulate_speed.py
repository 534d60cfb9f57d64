"""Simulator speed on the llama-7b reference step (target: < 0.5 s per plan on 2 cores).

Run: python benchmarks/simulate_speed.py [--offload N] [--recompute N] [--repeat R]
Profiles llama-7b analytically, then simulates a keep-all plan and a plan that offloads
and recomputes a few hundred activations (largest first), with and without a 50% limit.
"""

from __future__ import annotations

import argparse
import time

import slackswap
from slackswap.core.plan import Plan
from slackswap.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offload", type=int, default=200)
    parser.add_argument("--recompute", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    model, batch = build_model("llama-7b")
    profile = slackswap.profile(model, batch, name="llama-7b")
    acts = sorted((t for t in profile.saved_activations if t.producer is not None),
                  key=lambda t: -t.bytes)
    decisions = {t.name: "offload" for t in acts[: args.offload]}
    decisions |= {t.name: "recompute"
                  for t in acts[args.offload: args.offload + args.recompute]}
    plan = Plan(fingerprint=profile.fingerprint, strategy="bench", decisions=decisions)
    print(f"llama-7b: {len(profile.ops)} ops, {len(acts)} planable activations; "
          f"plan offloads {args.offload}, recomputes {args.recompute}")
    for label, p, limit in (("keep-all", None, None), ("plan", plan, None),
                            ("plan @50%", plan, 0.5)):
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = slackswap.simulate(profile, p, memory_limit=limit)
            times.append(time.perf_counter() - start)
        run = result.run
        events = len(run.timeline.spans) + len(run.timeline.memory)
        best = min(times)
        print(f"{label:10s} best {best * 1e3:7.1f} ms  {events / best:10.0f} events/s  "
              f"retention {result.retention:.3f}  feasible {result.feasible}")


if __name__ == "__main__":
    main()
