"""Host time per training step: the eager runtime, the compiled path, plain torch.compile.

Run: python benchmarks/compile_overhead.py [--model llama-7b-tiny] [--budget 0.8]
    [--backend aot_eager|inductor] [--steps K]

All on the same model, batch and budget; the steps of the three are interleaved so that
drift in the machine's speed hits them alike, and the median of each is printed, with
the one-off compile times (slackswap.compile plans inside the partition, so its compile
time includes profiling the joint graph and planning it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

import slackswap
from slackswap.models.presets import build_model

_LOSS_TYPE = {"gpt2": "ForCausalLM", "bert": "ForMaskedLM"}  # a graph break otherwise


def _timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b-tiny")
    ap.add_argument("--budget", type=float, default=0.8)
    ap.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    model, batch = build_model(args.model, fake=False, dtype="fp32")
    for family, loss_type in _LOSS_TYPE.items():
        if args.model.startswith(family):
            model.loss_type = loss_type
    models = {k: copy.deepcopy(model) for k in ("eager runtime", "slackswap.compile",
                                                "torch.compile")}
    compile_s: dict[str, float] = {}
    start = time.perf_counter()
    compiled = slackswap.compile(models["slackswap.compile"], batch, budget=args.budget,
                                 backend=args.backend)
    compile_s["slackswap.compile"] = time.perf_counter() - start
    plain = torch.compile(models["torch.compile"], backend=args.backend)
    slackswap.attach(models["eager runtime"], budget=args.budget, strategy="recompute-only")

    def step(m: torch.nn.Module) -> Callable[[], None]:
        return lambda: m(**batch).loss.backward()

    steps = {"eager runtime": step(models["eager runtime"]), "slackswap.compile": step(compiled),
             "torch.compile": step(plain)}
    compile_s["torch.compile"] = _timed(steps["torch.compile"])  # first call compiles
    compile_s["eager runtime"] = _timed(steps["eager runtime"])  # first call plans
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.steps):
        for name, run in steps.items():
            times[name].append(_timed(run))
    print(f"{args.model}, budget {args.budget}, backend {args.backend}, {args.steps} steps "
          f"(recomputed in the compiled graph: {compiled.slackswap.applied()['recomputed']})")
    for name, ts in times.items():
        print(f"  {name:18s} median step {statistics.median(ts) * 1e3:8.2f} ms   "
              f"first call / compile {compile_s[name]:6.2f} s")


if __name__ == "__main__":
    main()
