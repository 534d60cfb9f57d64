"""``slackswap reproduce``: the paper's table, regenerated and extended.

Profiles the reference workloads (cached on disk by fingerprint), plans each with every
strategy at one budget, simulates, and writes a results folder: ``results.json``, a
Markdown report and a Perfetto trace of each SlackSwap plan; with a budget sweep, a
retention-against-budget plot per workload too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slackswap.core.hardware import Hardware, load_hardware, on_node
from slackswap.core.jsonio import atomic_write_text, dump_model, load_model
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes
from slackswap.errors import InputError
from slackswap.planners import STRATEGIES
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.summary import decision_bytes
from slackswap.sim.outputs import write_trace

__all__ = ["PAPER", "WORKLOADS", "reproduce", "cached_profile", "SWEEP", "steps"]

# Throughput retained at a 50% budget on A100 + PCIe 4.0, as the paper reports it
# (its own simulation; it did not run on hardware).
PAPER = {"bert-large": 0.963, "gpt2-xl": 0.976, "llama-7b": 0.996}
WORKLOADS = ("bert-large", "gpt2-xl", "llama-7b")
SWEEP = tuple(round(0.1 * i, 1) for i in range(1, 11))

Progress = Callable[[str], None]


def _cache_dir() -> Path:
    root = os.environ.get("SLACKSWAP_CACHE") or Path.home() / ".cache" / "slackswap"
    return Path(root) / "profiles"


def _without_host(hw: Hardware) -> dict[str, Any]:
    """What of ``hw`` prices no op: its host costs and their sources."""
    return {"host": True, "sources": {k for k in hw.sources if k.startswith("host.")}}


def cached_profile(name: str, hw: Hardware) -> StepProfile:
    """The analytic profile of preset ``name`` on ``hw``, from the cache when it is there.

    The key is the model's fingerprint, the hardware preset's content and the SlackSwap
    version, so a changed model, preset or profiler never reuses a stale profile. The
    host's costs are left out: they price no op (the simulator reads them from ``hw``).
    """
    from importlib.metadata import version

    from slackswap.models import build_model
    from slackswap.profiling import profile
    from slackswap.profiling.step import fingerprint

    model, batch = build_model(name)
    key = hashlib.sha256(
        f"{fingerprint(model, batch)}|{hw.model_dump_json(exclude=_without_host(hw))}|"
        f"{version('slackswap')}".encode()
    ).hexdigest()[:24]
    path = _cache_dir() / f"{name}-{hw.name}-{key}.json"
    if path.exists():
        try:
            return load_model(StepProfile, path)
        except InputError:
            pass  # a damaged cache entry is rebuilt
    result = profile(model, batch, hw, name=name)
    dump_model(result, path)
    return result


def _strategy_entry(ctx: PlanContext, strategy: str) -> tuple[dict[str, Any], Any]:
    start = time.perf_counter()
    attempt = ctx.attempt(STRATEGIES[strategy]) if ctx.reachable else None
    elapsed = time.perf_counter() - start
    if attempt is None:
        return {"retention": 0.0, "peak_bytes": None, "feasible": False,
                "offloaded_bytes": 0, "recomputed_bytes": 0, "plan_time_s": elapsed}, None
    plan, result = attempt
    totals = decision_bytes(ctx.profile, plan, by="total").get("total", {})
    return {
        "retention": result.retention if result.feasible else 0.0,
        "peak_bytes": result.peak_bytes,
        "feasible": result.feasible,
        "offloaded_bytes": totals.get("offload", 0),
        "recomputed_bytes": totals.get("recompute", 0),
        "plan_time_s": elapsed,
    }, attempt


def reproduce(
    out: str | Path = "slackswap-results",
    budget: float = 0.5,
    hardware: str | Path = "a100-80gb",
    workloads: tuple[str, ...] = WORKLOADS,
    sweep: tuple[float, ...] = (),
    progress: Progress = lambda message: None,
    gpus: int = 1,
) -> dict[str, Any]:
    """Run the comparison and write the results folder; returns the results JSON.

    ``sweep``: budgets (fractions) at which every strategy and the bound are planned
    again for the plots (``SWEEP``: 10 to 100%). ``progress`` is called as each of
    ``steps(workloads, sweep)`` steps begins, with what it does.

    ``gpus`` > 1: every plan is made for, and simulated on, one of that many GPUs of the
    node ``hardware`` describes, all running the step in lockstep (NOTE [the node]); each
    workload also shows the SlackSwap plan made for one GPU, simulated on that node."""
    if not 0 < budget <= 1:
        raise InputError(f"--budget {budget} must be a fraction in (0, 1]")
    single = load_hardware(hardware)
    hw = on_node(single, gpus)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"hardware": hw.name, "budget_fraction": budget,
                               "gpus": gpus, "workloads": []}
    for name in workloads:
        progress(f"{name}: profiling")
        prof = cached_profile(name, single)
        progress(f"{name}: planning at {budget:.0%}")
        ctx = PlanContext(prof, hw, int(budget * prof.keep_all_peak))
        entry: dict[str, Any] = {
            "name": name, "ideal_step_time_s": ctx.ideal,
            "keep_all_peak_bytes": ctx.keep_all_peak, "budget_bytes": ctx.budget,
            "paper_retention": PAPER.get(name), "strategies": {},
        }
        for strategy in STRATEGIES:
            entry["strategies"][strategy], attempt = _strategy_entry(ctx, strategy)
            if strategy == "slackswap" and attempt is not None:
                write_trace(attempt[1], folder / f"{name}-slackswap-trace.json")
                dump_model(attempt[0], folder / f"{name}-slackswap-plan.json")
                entry["trace"] = f"{name}-slackswap-trace.json"
        if gpus > 1:
            progress(f"{name}: the plan for one GPU, on {gpus}")
            entry["single_gpu_plan"] = _single_gpu_plan(prof, single, hw, budget)
        start = time.perf_counter()
        entry["bound_retention"] = retention_bound(ctx)
        entry["bound_time_s"] = time.perf_counter() - start
        if sweep:
            entry["sweep"] = _sweep(prof, hw, sweep, name, progress)
            _plot_sweep(entry, folder / f"{name}-retention.png")
        results["workloads"].append(entry)
    atomic_write_text(folder / "results.json", json.dumps(results, indent=2))
    atomic_write_text(folder / "report.md", report(results))
    return results


def steps(workloads: tuple[str, ...], sweep: tuple[float, ...] = (), gpus: int = 1) -> int:
    """How many times ``reproduce`` calls ``progress``: for a progress bar."""
    return len(workloads) * (2 + (gpus > 1) + len(sweep))


def _single_gpu_plan(prof: StepProfile, single: Hardware, node: Hardware,
                     budget: float) -> dict[str, Any]:
    """The SlackSwap plan made for one GPU, simulated on the node's ranks."""
    from slackswap.sim import simulate

    ctx = PlanContext(prof, single, int(budget * prof.keep_all_peak))
    attempt = STRATEGIES["slackswap"](ctx) if ctx.reachable else None
    if attempt is None:
        return {"retention": 0.0, "feasible": False, "reason": "no plan for one GPU"}
    result = simulate(prof, attempt[0], node, ctx.budget)
    return {"retention": result.retention, "feasible": result.feasible,
            "reason": result.infeasible_reason,
            "stall_s": sum(v for k, v in result.stall_s.items() if k != "recompute")}


def _sweep(prof: StepProfile, hw: Hardware, budgets: tuple[float, ...], name: str,
           progress: Progress) -> dict[str, Any]:
    rows: dict[str, Any] = {"budgets": list(budgets), "bound": [],
                            **{s: [] for s in STRATEGIES}, "peak_bytes": []}
    for fraction in budgets:
        progress(f"{name}: budget sweep {fraction:.0%}")
        ctx = PlanContext(prof, hw, int(fraction * prof.keep_all_peak))
        peak = None
        for strategy in STRATEGIES:
            entry, _ = _strategy_entry(ctx, strategy)
            rows[strategy].append(entry["retention"])
            if strategy == "slackswap":
                peak = entry["peak_bytes"]
        rows["peak_bytes"].append(peak)
        rows["bound"].append(retention_bound(ctx))
    return rows


def _plot_sweep(entry: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = entry["sweep"]
    xs = [b * 100 for b in sweep["budgets"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(xs, [r * 100 for r in sweep["bound"]], color="0.5", ls=":", label="bound")
    for i, strategy in enumerate(STRATEGIES):
        ax.plot(xs, [r * 100 for r in sweep[strategy]], marker="o", ms=3,
                lw=2.2 if strategy == "slackswap" else 1.2, color=f"C{i}", label=strategy)
    ax.set_xlabel("activation memory budget (% of keep-all peak)")
    ax.set_ylabel("throughput retained (%)")
    ax.set_ylim(0, 101)
    ax.set_title(f"{entry['name']}: retention against budget")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def report(results: dict[str, Any]) -> str:
    """The Markdown report of a reproduce run."""
    budget = results["budget_fraction"]
    lines = [
        "# SlackSwap: throughput retained under an activation-memory budget", "",
        f"Hardware `{results['hardware']}`, budget {budget:.0%} of the keep-all activation "
        "peak, simulated. Paper: the SlackSwap paper's own simulation (A100, PCIe 4.0, "
        "50% budget).", "",
        "| workload | paper | SlackSwap | bound | " + " | ".join(
            s for s in STRATEGIES if s != "slackswap") + " |",
        "|---" * (len(STRATEGIES) + 3) + "|",
    ]
    for w in results["workloads"]:
        st = w["strategies"]
        paper = f"{w['paper_retention']:.1%}" if w["paper_retention"] else "-"
        cells = [_pct(st[s]) for s in STRATEGIES if s != "slackswap"]
        lines.append(f"| {w['name']} | {paper} | **{_pct(st['slackswap'])}** | "
                     f"{w['bound_retention']:.1%} | " + " | ".join(cells) + " |")
    lines += ["", "Infeasible: the strategy found no plan that fits the budget.", ""]
    if results.get("gpus", 1) > 1:
        lines += [f"On {results['gpus']} GPUs of the node running in lockstep, the SlackSwap "
                  "plan made for one GPU, simulated on the node:", ""]
        for w in results["workloads"]:
            one = w["single_gpu_plan"]
            lines.append(f"- {w['name']}: {_pct(one)}"
                         + (f" ({one['reason']})" if one.get("reason") else "")
                         + f", against {_pct(w['strategies']['slackswap'])} planned for it")
        lines.append("")
    for w in results["workloads"]:
        lines += [
            f"## {w['name']}", "",
            f"Ideal step {w['ideal_step_time_s'] * 1e3:.1f} ms; keep-all peak "
            f"{format_bytes(w['keep_all_peak_bytes'])}; budget "
            f"{format_bytes(w['budget_bytes'])}.", "",
            "| strategy | retention | peak | offloaded | recomputed | plan time |",
            "|---|---|---|---|---|---|",
        ]
        for s, e in w["strategies"].items():
            peak = format_bytes(e["peak_bytes"]) if e["peak_bytes"] is not None else "-"
            lines.append(f"| {s} | {_pct(e)} | {peak} | {format_bytes(e['offloaded_bytes'])} "
                         f"| {format_bytes(e['recomputed_bytes'])} | {e['plan_time_s']:.2f} s |")
        if "sweep" in w:
            lines += ["", f"![retention against budget]({w['name']}-retention.png)"]
        if w.get("trace"):
            lines += ["", f"Trace of the SlackSwap plan: `{w['trace']}` "
                      "(open it at ui.perfetto.dev)."]
        lines.append("")
    return "\n".join(lines)


def _pct(entry: dict[str, Any]) -> str:
    return f"{entry['retention']:.1%}" if entry["feasible"] else "infeasible"
