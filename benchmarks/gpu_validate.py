"""Validate plans on a real GPU: measured against simulated retention and memory.

Run on a machine with a CUDA GPU:
    python benchmarks/gpu_validate.py --model gpt2-xl --layers 12 --hardware h200
    python benchmarks/gpu_validate.py --model llama-7b --layers 8 --hardware h200
It builds the workload on the device, profiles one real step (measured mode), plans at
the budget, then runs keep-all, the runtime with nothing to move (its overhead) and the plan for
--steps steps each, and prints (and writes, with --out) measured retention, the step's
peak allocated memory above what was allocated before it (activations, gradients and
temporaries) against the budget, simulated retention and peak for the same plan, the
simulated-vs-measured step-time error and the runtime's stats; then the same for a
plan from the analytic profile (traced on fake tensors, priced by the cost model).
``--device cpu`` runs the same path on a CPU (a smoke test; times mean little there).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import slackswap
from slackswap.core.jsonio import atomic_write_text
from slackswap.errors import InputError
from slackswap.models import MODEL_PRESETS, build_model, with_layers


def timed_steps(model, batch, plan, profile, steps: int, device: str) -> dict:
    """Median step, forward and backward times, and the step's peak allocated bytes above
    what was allocated before it (CUDA; weight gradients are kept between steps, so the
    peak is activation memory and temporaries, as the simulator counts it) over ``steps``
    steps after a warm-up, and the runtime's stats of the last step."""
    times, forwards, peak, held, stats = [], [], 0, 0, None
    cuda = device == "cuda"
    for i in range(steps + 1):  # the first is a warm-up, which also makes the gradients
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        if plan is None:
            loss = model(**batch).loss
        else:
            runtime = slackswap.apply(model, plan, profile=profile)
            with runtime:
                loss = model(**batch).loss
        if cuda:
            torch.cuda.synchronize()
            if i:
                held = max(held, torch.cuda.memory_allocated() - before)
        forwarded = time.perf_counter()
        loss.backward()
        model.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
            if i:
                peak = max(peak, torch.cuda.max_memory_allocated() - before)
        end = time.perf_counter()
        if i:
            times.append(end - start)
            forwards.append(forwarded - start)
        if plan is not None:
            stats = runtime.stats
    result = {"step_s": sorted(times)[len(times) // 2],
              "forward_s": sorted(forwards)[len(forwards) // 2],
              "peak_bytes": peak, "after_forward_bytes": held}
    if stats is not None:
        result |= stats.as_dict()
    return result


def analytic_figures(args, name: str, dtype: str, model, batch, keep_step_s: float) -> dict:
    """The same workload traced on fake tensors with the target's kernel semantics and
    priced by the roofline cost model (no GPU needed): how far that profile's step time is
    from this GPU's, and how its plan runs here."""
    fake, fake_batch = build_model(name, batch=args.batch, seq=args.seq, dtype=dtype)
    kernels = "cuda" if args.device == "cuda" else "native"
    analytic = slackswap.profile(fake, fake_batch, args.hardware, kernels=kernels, name=name)
    keep_all = slackswap.simulate(analytic, slackswap.Plan.keep_all(analytic), args.hardware)
    figures = {"analytic_keep_all_step_s": keep_all.step_time_s,
               "analytic_step_time_error": keep_all.step_time_s / keep_step_s - 1}
    try:
        plan = slackswap.plan(analytic, args.budget, args.hardware)
        run = timed_steps(model, batch, plan, analytic, args.steps, args.device)
    except InputError as err:  # recorded, so the measured figures still come back
        return figures | {"analytic_plan_error": str(err)}
    simulated = slackswap.simulate(analytic, plan, args.hardware, memory_limit=args.budget)
    return figures | {
        "analytic_plan_step_s": run["step_s"],
        "analytic_plan_measured_retention": keep_step_s / run["step_s"],
        "analytic_plan_simulated_retention": simulated.retention,
        "analytic_plan_step_peak_bytes": run["peak_bytes"],
        "analytic_plan_simulated_peak_bytes": simulated.peak_bytes,
    }


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
    name = with_layers(args.model, args.layers)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    model, batch = build_model(name, batch=args.batch, seq=args.seq, dtype=dtype, fake=False,
                               device=args.device)
    profile = slackswap.profile(model, batch, args.hardware, mode="measured", name=name)
    plan = slackswap.plan(profile, args.budget, args.hardware)
    simulated = slackswap.simulate(profile, plan, args.hardware, memory_limit=args.budget)
    keep = timed_steps(model, batch, None, profile, args.steps, args.device)
    # the runtime with nothing to move: its own overhead (dispatch mode, hooks)
    runtime_only = timed_steps(model, batch, slackswap.Plan.keep_all(profile), profile,
                               args.steps, args.device)
    planned = timed_steps(model, batch, plan, profile, args.steps, args.device)
    simulated_keep = slackswap.simulate(profile, slackswap.Plan.keep_all(profile), args.hardware)
    figures = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "model": name, "budget_fraction": args.budget,
        "hardware_preset": args.hardware, "profile_ops": len(profile.ops),
        "keep_all_step_s": keep["step_s"], "runtime_overhead_step_s": runtime_only["step_s"],
        "plan_step_s": planned["step_s"],
        "keep_all_forward_s": keep["forward_s"], "plan_forward_s": planned["forward_s"],
        "measured_retention": keep["step_s"] / planned["step_s"],
        "simulated_retention": simulated.retention,
        "simulated_keep_all_step_s": simulated_keep.step_time_s,
        "simulated_step_s": simulated.step_time_s,
        "step_time_error": simulated.step_time_s / planned["step_s"] - 1,
        "activation_budget_bytes": plan.budget_bytes,
        "keep_all_step_peak_bytes": keep["peak_bytes"],
        "plan_step_peak_bytes": planned["peak_bytes"],
        "keep_all_after_forward_bytes": keep["after_forward_bytes"],
        "plan_after_forward_bytes": planned["after_forward_bytes"],
        "simulated_keep_all_peak_bytes": profile.keep_all_peak,
        "simulated_peak_bytes": simulated.peak_bytes,
        "plan_stats": {k: v for k, v in planned.items()
                       if k not in ("step_s", "forward_s", "peak_bytes", "after_forward_bytes")},
    }
    for key, value in figures.items():
        print(f"{key:32s} {value}")
    analytic = analytic_figures(args, name, dtype, model, batch, keep["step_s"])
    for key, value in analytic.items():
        print(f"{key:32s} {value}")
    if args.out:
        atomic_write_text(args.out, json.dumps(figures | analytic, indent=2))


if __name__ == "__main__":
    try:
        main()
    except InputError as err:
        raise SystemExit(f"error: {err}") from None
