"""Validate plans on a real GPU: measured against simulated retention and memory.

Run on a machine with a CUDA GPU:
    python benchmarks/gpu_validate.py --model gpt2-xl --layers 12 --hardware h200
    python benchmarks/gpu_validate.py --model llama-7b --layers 8 --hardware h200
It builds the workload on the device, profiles one real step (measured mode), plans at
the budget, then runs keep-all and the plan for --steps steps each and prints (and
writes, with --out) measured retention, peak allocated memory against the budget,
simulated retention for the same plan and the simulated-vs-measured step-time error.
``--device cpu`` runs the same path on a CPU (a smoke test; times mean little there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

import slackswap
from slackswap.core.jsonio import atomic_write_text
from slackswap.models import MODEL_PRESETS, build_model


def timed_steps(model, batch, plan, steps: int, device: str) -> tuple[float, int]:
    """Median step time and peak allocated bytes (CUDA) over ``steps`` steps."""
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps + 1):  # the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if plan is None:
            loss = model(**batch).loss
        else:
            with slackswap.apply(model, plan):
                loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return sorted(times[1:])[len(times[1:]) // 2], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--layers", type=int, help="fewer layers, to fit the GPU")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--hardware", default="h200", help="preset for the host link model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    name = args.model
    if args.layers:
        name = f"{args.model}@{args.layers}"
        MODEL_PRESETS[name] = dataclasses.replace(MODEL_PRESETS[args.model], name=name,
                                                  layers=args.layers)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    model, batch = build_model(name, batch=args.batch, seq=args.seq, dtype=dtype, fake=False,
                               device=args.device)
    profile = slackswap.profile(model, batch, args.hardware, mode="measured", name=name)
    plan = slackswap.plan(profile, args.budget, args.hardware)
    simulated = slackswap.simulate(profile, plan, args.hardware, memory_limit=args.budget)
    keep_time, keep_peak = timed_steps(model, batch, None, args.steps, args.device)
    plan_time, plan_peak = timed_steps(model, batch, plan, args.steps, args.device)
    state = profile.model_state_bytes
    figures = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": name, "budget_fraction": args.budget, "hardware_preset": args.hardware,
        "keep_all_step_s": keep_time, "plan_step_s": plan_time,
        "measured_retention": keep_time / plan_time,
        "simulated_retention": simulated.retention,
        "simulated_step_s": simulated.step_time_s,
        "step_time_error": simulated.step_time_s / plan_time - 1,
        "keep_all_peak_allocated_bytes": keep_peak, "plan_peak_allocated_bytes": plan_peak,
        "activation_budget_bytes": plan.budget_bytes, "model_state_bytes": state,
        "plan_activation_peak_bytes": max(plan_peak - state, 0) if plan_peak else None,
        "simulated_peak_bytes": simulated.peak_bytes,
    }
    for key, value in figures.items():
        print(f"{key:32s} {value}")
    if args.out:
        atomic_write_text(args.out, json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
