"""Planner and simulator speed, with a digest of every plan and simulated number.

Run: PYTHONPATH=src python benchmarks/planner_speed.py [--cases DIR] [--only NAME] [--profile]

Plans a fixed set of cases: the joint graphs ``slackswap.compile`` plans for the tiny
test models (gpt2-xl-tiny, llama-7b-tiny, bert-large-tiny at budget 0.8, gpt2-xl-tiny at 0.6: the
slowest planning in the default test run), and analytic profiles of the tiny presets
at several budgets and strategies. The compiled cases' planning contexts are recorded
once (compiling with aot_eager) into ``--cases`` and read back on later runs, so a run
times planning alone. Prints each case's wall time, the total, and a sha256 over every
plan's decisions and reload points and its simulated result: a change that makes the
planner faster must leave the digest as it was.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import time
from pathlib import Path
from typing import Any

_COMPILED = [("gpt2-xl-tiny", 0.8), ("gpt2-xl-tiny", 0.6), ("llama-7b-tiny", 0.8),
             ("bert-large-tiny", 0.8)]
_ANALYTIC = [(m, b, s) for m in ("gpt2-xl-tiny", "llama-7b-tiny", "bert-large-tiny")
             for b in (0.6, 0.8) for s in ("slackswap", "capuchin", "checkpoint-offload")]


def _record_compiled(cases: Path) -> None:
    """Compiles each compiled case with aot_eager and keeps the planning contexts its
    partitioner made (profile, budget, what the offloading pass can offload)."""
    import torch

    import slackswap
    from slackswap.compiled import api
    from slackswap.core.jsonio import atomic_write_text
    from slackswap.models.presets import build_model

    cases.mkdir(parents=True, exist_ok=True)
    for model_name, budget in _COMPILED:
        seen: list[Any] = []
        original = api.CompiledPlan._attempt

        def spy(self: Any, ctx: Any, joint: Any, seen: list[Any] = seen,
                original: Any = original) -> Any:
            seen.append(ctx)
            return original(self, ctx, joint)

        api.CompiledPlan._attempt = spy  # type: ignore[method-assign]
        try:
            torch.manual_seed(0)
            model, batch = build_model(model_name, fake=False, dtype="fp32")
            slackswap.compile(model, batch, budget, backend="aot_eager")
        finally:
            api.CompiledPlan._attempt = original  # type: ignore[method-assign]
        for i, ctx in enumerate(seen):
            stem = str(cases / f"{model_name}-{budget}-{i}")
            ctx.profile.save(stem + ".profile.json")
            atomic_write_text(stem + ".hw.json", ctx.hw.model_dump_json())
            atomic_write_text(stem + ".ctx.json", json.dumps(
                {"budget": ctx.budget, "offloadable": sorted(ctx.offloadable)}))


def _cases(cases: Path) -> list[tuple[str, Any, str]]:
    """(name, planning context, strategy) for every case."""
    import slackswap
    from slackswap.compiled.api import PassContext
    from slackswap.core.hardware import Hardware, profile_hardware
    from slackswap.core.profile import StepProfile
    from slackswap.core.units import resolve_budget
    from slackswap.models.presets import build_model
    from slackswap.planners.context import PlanContext

    out: list[tuple[str, Any, str]] = []
    for path in sorted(cases.glob("*.ctx.json")):
        stem = str(path)[: -len(".ctx.json")]
        meta = json.loads(path.read_text())
        profile = StepProfile.load(stem + ".profile.json")
        hw = Hardware.model_validate_json(Path(stem + ".hw.json").read_text())
        # the recorded hardware already holds the pass's overrides: a plain context
        # over it with the pass's offloadable set
        ctx = PassContext.__new__(PassContext)
        PlanContext.__init__(ctx, profile, hw, meta["budget"])
        ctx.offloadable = frozenset(meta["offloadable"])
        out.append((Path(stem).name, ctx, "slackswap"))
    for model_name, budget, strategy in _ANALYTIC:
        model, batch = build_model(model_name)
        profile = slackswap.profile(model, batch, name=model_name, hardware="a100-80gb")
        hw = profile_hardware(profile.hardware)
        ctx = PlanContext(profile, hw, resolve_budget(budget, profile.keep_all_peak))
        out.append((f"{model_name}-{budget}-{strategy}", ctx, strategy))
    return out


def _digest_of(attempt: Any) -> str:
    if attempt is None:
        return "none"
    plan, result = attempt
    return json.dumps({"decisions": sorted(plan.decisions.items()),
                       "prefetch": sorted((plan.prefetch or {}).items()),
                       "result": result.model_dump(mode="json")}, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=Path("/tmp/slackswap-planner-cases"))
    parser.add_argument("--only", default=None, help="plan only cases whose name has this")
    parser.add_argument("--profile", action="store_true", help="cProfile the planning")
    args = parser.parse_args()
    if not any(args.cases.glob("*.ctx.json")):
        _record_compiled(args.cases)
    from slackswap.planners import plan_in_context

    cases = [c for c in _cases(args.cases) if args.only is None or args.only in c[0]]
    digest = hashlib.sha256()
    profiler = cProfile.Profile() if args.profile else None
    total, cpu = 0.0, time.process_time()
    for name, ctx, strategy in cases:
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        attempt = plan_in_context(ctx, strategy)
        if profiler:
            profiler.disable()
        took = time.perf_counter() - start
        total += took
        one = _digest_of(attempt)
        digest.update(name.encode() + one.encode())
        print(f"{name:45s} {took:7.2f} s  {hashlib.sha256(one.encode()).hexdigest()[:12]}")
    cpu = time.process_time() - cpu  # (the machine's cores are shared: CPU time is steadier)
    print(f"total {total:.2f} s  cpu {cpu:.2f} s  digest {digest.hexdigest()}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
