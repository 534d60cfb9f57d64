"""What the runtime costs per step when it moves nothing, and with a plan.

Run: python benchmarks/runtime_overhead.py [--model gpt2-xl-tiny] [--layers N]
    [--batch B] [--seq S] [--steps K] [--device cpu|cuda]
The runtime's dispatch mode and hooks run Python on every forward op; this prints the
median step time without the runtime, with a keep-all plan (pure overhead), and with a
SlackSwap plan at 50% (or the smallest feasible budget), and the overhead per forward op
in microseconds. On a GPU the overhead is CPU time that overlaps kernels already
queued, so it matters only when the step is launch-bound. On CPU about a third of it
is Python's cyclic garbage collector, which the runtime's per-op records set off more
often (the records live until backward).
"""

from __future__ import annotations

import argparse
import time

import torch

import slackswap
from slackswap.core.plan import Plan
from slackswap.models import MODEL_PRESETS, build_model, with_layers
from slackswap.planners.api import smallest_feasible_budget


def median_step(model, batch, plan, profile, steps: int, device: str) -> float:
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if plan is None:
            loss = model(**batch).loss
        else:
            with slackswap.apply(model, plan, profile=profile):
                loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl-tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    name = with_layers(args.model, args.layers)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    model, batch = build_model(name, batch=args.batch, seq=args.seq, dtype=dtype, fake=False,
                               device=args.device)
    mode = "measured" if args.device == "cuda" else "analytic"
    profile = slackswap.profile(model, batch, mode=mode, name=name,
                                kernels=None if args.device == "cuda" else "native")
    forward_ops = sum(op.phase == "forward" for op in profile.ops)
    plain = median_step(model, batch, None, profile, args.steps, args.device)
    keep = median_step(model, batch, Plan.keep_all(profile), profile, args.steps, args.device)
    budget = max(int(0.5 * profile.keep_all_peak), smallest_feasible_budget(profile))
    planned = median_step(model, batch, slackswap.plan(profile, budget), profile, args.steps,
                          args.device)
    print(f"model                 {name} ({forward_ops} forward ops, {args.device})")
    print(f"plain step            {plain * 1e3:9.2f} ms")
    print(f"runtime, keep-all     {keep * 1e3:9.2f} ms")
    share = budget / profile.keep_all_peak
    print(f"runtime, {share:4.0%} plan    {planned * 1e3:9.2f} ms")
    print(f"overhead per fwd op   {(keep - plain) / forward_ops * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
