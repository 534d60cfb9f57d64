"""Where a plan's measured CUDA peak comes from: the blocks alive at the step's peak.

    python benchmarks/gpu_memory_peak.py --model llama-7b --layers 8 --budget 0.5

Plans the workload from a measured profile (as ``gpu_validate.py`` does), runs one
warm-up step, then records one step with PyTorch's allocator history and replays it in
issue order: the peak above what was allocated before the step (weight gradients exist
already, so this is activation memory and temporaries, as the simulator counts it), in
forward or backward, and the bytes alive then, grouped by the first frame in slackswap
or the model's code that allocated them. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

import slackswap
from slackswap.models import MODEL_PRESETS, build_model, with_layers

GiB = 1 << 30


def _site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "slackswap" in name or "/models/" in name:
            return f"{name.rsplit('/', 2)[-1]}:{f.get('line')} {f.get('name')}"
    return "(torch internals)"


def replay(trace: list[dict], forward_end: int) -> None:
    """Live bytes after each allocator event, in issue order; print the peak's makeup."""
    live: dict[int, tuple[int, str, int]] = {}  # addr -> (size, site, index)
    used = peak = peak_at = 0
    peak_live: dict[int, tuple[int, str, int]] = {}
    for i, e in enumerate(trace):
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            live[addr] = (size, _site(e.get("frames", [])), i)
            used += size
            if used > peak:
                peak, peak_at, peak_live = used, i, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            used -= live.pop(addr)[0]
    phase = "forward" if peak_at < forward_end else "backward"
    print(f"peak {peak / GiB:.3f} GiB above the step's start, at event {peak_at} of "
          f"{len(trace)} ({phase}; forward ends at event {forward_end})")
    by_site: Counter[str] = Counter()
    for size, site, index in peak_live.values():
        by_site[f"{'fwd' if index < forward_end else 'bwd'} {site}"] += size
    for site, nbytes in by_site.most_common(25):
        print(f"  {nbytes / GiB:8.3f} GiB  {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--hardware", default="h200")
    args = parser.parse_args()
    name = with_layers(args.model, args.layers)
    model, batch = build_model(name, dtype="bf16", fake=False, device="cuda")
    profile = slackswap.profile(model, batch, args.hardware, mode="measured", name=name)
    plan = slackswap.plan(profile, args.budget, args.hardware)
    sim = slackswap.simulate(profile, plan, args.hardware, memory_limit=args.budget)
    print(f"{name}: budget {plan.budget_bytes / GiB:.3f} GiB, simulated peak "
          f"{sim.peak_bytes / GiB:.3f} GiB")

    def step(record: bool) -> None:
        with slackswap.apply(model, plan, profile=profile) as runtime:
            loss = model(**batch).loss
        forward_end = len(torch.cuda.memory._snapshot()["device_traces"][0]) if record else 0
        loss.backward()
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        if record:
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            replay(trace, forward_end)
            print("runtime:", runtime.stats.as_dict())

    step(False)  # warm-up: gradients exist from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc",
                                             stacks="python")
    step(True)
    print(f"max_memory_allocated above the start: "
          f"{(torch.cuda.max_memory_allocated() - before) / GiB:.3f} GiB")


if __name__ == "__main__":
    main()
