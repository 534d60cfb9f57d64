"""What the runtime costs on the host, side by side with PyTorch's own tools.

Run: python benchmarks/runtime_overhead.py [--model gpt2-xl-tiny] [--layers N]
    [--batch B] [--seq S] [--steps K] [--device cpu|cuda] [--threads T]

Every configuration runs in one process, interleaved step by step so that drift in the
machine's speed hits all of them alike, and the median step time of each is printed:

- plain: no hooks at all;
- keep-all: the runtime with a plan that moves nothing (its pure overhead);
- all-offload: every planable activation offloaded, against
  ``torch.autograd.graph.save_on_cpu`` (which offloads every saved tensor);
- all-recompute: every recomputable activation recomputed, against non-reentrant
  ``torch.utils.checkpoint`` of every transformer block;
- a SlackSwap plan at 50% of the keep-all peak (or the smallest feasible budget).

"added per fwd op" is (step - plain) / forward ops, in microseconds. Targets (issue 10):
all-offload within 1.5x of save_on_cpu (with pinned buffers, so it copies on a CPU too),
all-recompute within 1.5x of block checkpointing, keep-all about 10 us per forward op or
less. On a GPU the runtime's host time overlaps kernels already queued, so it matters
when the step is launch-bound: the simulator's host model charges it per item, and the
last lines print this machine's figures in the terms of a hardware file's [host] table
(NOTE [host costs] in slackswap/core/hardware.py):

- pack_s: (keep-all forward - plain forward) / tensors saved in forward;
- unpack_s: (keep-all backward - plain backward) / tensors saved;
- watch_s: (all-recompute forward - keep-all forward) / ops watched;
- replay_s: (all-recompute backward - keep-all backward) / ops replayed, less the mean
  time of a plain forward op (the replayed kernel itself): a rough split.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
import torch.utils.checkpoint as tuc

import slackswap
from slackswap.core.plan import MIN_PLANNED_BYTES, Plan
from slackswap.models import MODEL_PRESETS, build_model, with_layers
from slackswap.planners.api import smallest_feasible_budget
from slackswap.runtime.watch import watch_for


def _blocks_checkpointed(model: torch.nn.Module, blocks: list[str]) -> contextlib.ExitStack:
    """Every block's forward under non-reentrant checkpointing, undone on exit."""
    stack = contextlib.ExitStack()
    modules = dict(model.named_modules())
    for path in blocks:
        block = modules[path]
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return tuc.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
        stack.callback(setattr, block, "forward", forward)
    return stack


def _all(profile, decision: str) -> Plan:
    names = (profile.recomputable if decision == "recompute"
             else {t.name for t in profile.saved_activations if t.producer is not None})
    decisions = {t.name: (decision if t.name in names and t.bytes >= MIN_PLANNED_BYTES
                          else "keep")
                 for t in profile.saved_activations if t.name is not None}
    return Plan(fingerprint=profile.fingerprint, strategy=f"all-{decision}",
                decisions=decisions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl-tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name = with_layers(args.model, args.layers)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    model, batch = build_model(name, batch=args.batch, seq=args.seq, dtype=dtype, fake=False,
                               device=args.device)
    mode = "measured" if args.device == "cuda" else "traced"
    profile = slackswap.profile(model, batch, mode=mode, name=name)
    forward_ops = sum(op.phase == "forward" for op in profile.ops)
    budget = max(int(0.5 * profile.keep_all_peak), smallest_feasible_budget(profile))
    planned = slackswap.plan(profile, budget)

    recompute_all = _all(profile, "recompute")

    def runtime(plan: Plan) -> Callable[[], contextlib.AbstractContextManager]:
        return lambda: slackswap.apply(model, plan, profile=profile)

    configs: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "plain": contextlib.nullcontext,
        "runtime, keep-all": runtime(Plan.keep_all(profile)),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
        "runtime, all-offload": runtime(_all(profile, "offload")),
        "checkpoint blocks": lambda: _blocks_checkpointed(model, profile.layers),
        "runtime, all-recompute": runtime(recompute_all),
        f"runtime, {budget / profile.keep_all_peak:.0%} plan": runtime(planned),
    }
    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[tuple[float, float]]] = {label: [] for label in configs}
    replayed = 0
    for step in range(args.steps + 1):  # the first round is a warm-up
        for label, context in configs.items():
            torch.manual_seed(0)
            sync()
            start = time.perf_counter()
            with context() as runtime:
                loss = model(**batch).loss
            sync()
            middle = time.perf_counter()
            loss.backward()
            sync()
            end = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if step:
                times[label].append((middle - start, end - middle))
            if label == "runtime, all-recompute":
                replayed = runtime.stats.recomputed_ops

    def med(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    forward = {label: med([f for f, _ in ts]) for label, ts in times.items()}
    backward = {label: med([b for _, b in ts]) for label, ts in times.items()}
    median = {label: med([f + b for f, b in ts]) for label, ts in times.items()}
    plain = median["plain"]
    print(f"model {name}: {forward_ops} forward ops, {args.device}, "
          f"{args.threads} thread(s), median of {args.steps} steps")
    print(f"{'':26s}{'fwd ms':>8s}{'bwd ms':>8s}{'step ms':>9s}{'added us/fwd op':>17s}")
    for label, seconds in median.items():
        added = (seconds - plain) / forward_ops * 1e6
        print(f"{label:26s}{forward[label] * 1e3:8.2f}{backward[label] * 1e3:8.2f}"
              f"{seconds * 1e3:9.2f}{added:17.1f}")
    offload = median["runtime, all-offload"] / median["save_on_cpu"]
    recompute = median["runtime, all-recompute"] / median["checkpoint blocks"]
    print(f"all-offload / save_on_cpu          {offload:5.2f}x (target <= 1.5x)")
    print(f"all-recompute / checkpoint blocks  {recompute:5.2f}x (target <= 1.5x)")
    saves = len(profile.saves)
    watched = watch_for(profile, recompute_all).watched_ops
    keep, rec = "runtime, keep-all", "runtime, all-recompute"
    figures = {
        "pack_s": (forward[keep] - forward["plain"]) / saves,
        "unpack_s": (backward[keep] - backward["plain"]) / saves,
        "watch_s": (forward[rec] - forward[keep]) / max(watched, 1),
        "replay_s": ((backward[rec] - backward[keep]) / max(replayed, 1)
                     - forward["plain"] / forward_ops),
    }
    print(f"[host] figures of this machine ({saves} saves, {watched} ops watched, "
          f"{replayed} replayed per step):")
    print("  " + ", ".join(f"{k} = {v * 1e6:.1f} us" for k, v in figures.items()))


if __name__ == "__main__":
    main()
