"""``slackswap reproduce``: the paper's table, regenerated and extended.

Profiles the reference workloads (cached on disk by fingerprint), plans each with every
strategy at one budget, simulates, and writes a results folder: ``results.json``, a
Markdown report and a Perfetto trace of each SlackSwap plan; with a budget sweep, a
retention-against-budget plot per workload too. A strategy with no plan that fits has
retention null in the JSON, "infeasible" in the report and a gap in the plot, never 0%.
``results.json`` is strict JSON: never a NaN or an infinity (NOTE [finite JSON] in
``slackswap.core.jsonio``).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slackswap.core.hardware import Hardware, load_hardware, on_node
from slackswap.core.jsonio import (
    atomic_write,
    atomic_write_text,
    dump_model,
    json_text,
    refuse_unwritable,
    validate_model,
)
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes
from slackswap.errors import InputError
from slackswap.planners import STRATEGIES, smallest_feasible_budget
from slackswap.planners.cache import (
    cached_attempt,
    cached_bound,
    entry_path,
    read_entry,
    write_entry,
)
from slackswap.planners.context import PlanContext
from slackswap.planners.summary import checkpoint_bytes, decision_bytes
from slackswap.sim.outputs import write_trace

__all__ = ["PAPER", "WORKLOADS", "reproduce", "cached_profile", "SWEEP", "steps", "REFERENCES",
           "reference_peak", "loss_ops", "sweep_figure", "written_files"]

# Throughput retained at a 50% budget on A100 + PCIe 4.0, as the paper reports it
# (its own simulation; it did not run on hardware).
PAPER = {"bert-large": 0.963, "gpt2-xl": 0.976, "llama-7b": 0.996}
WORKLOADS = ("bert-large", "gpt2-xl", "llama-7b")
SWEEP = tuple(round(0.1 * i, 1) for i in range(1, 11))

Progress = Callable[[str], None]


def _without_host(hw: Hardware) -> dict[str, Any]:
    """What of ``hw`` prices no op: its host costs and their sources."""
    return {"host": True, "sources": {k for k in hw.sources if k.startswith("host.")}}


def cached_profile(name: str, hw: Hardware, batch: int | None = None,
                   seq: int | None = None) -> StepProfile:
    """The analytic profile of preset ``name`` on ``hw`` (at its own batch and sequence
    length unless ``batch`` or ``seq`` is given), from the cache when it is there.

    The key is the model's fingerprint, the hardware preset's content, the SlackSwap
    version and the source of the code that makes a profile (``_profiler_digest``), so a
    changed model, preset or profiler never reuses a stale profile, even in a checkout
    whose version has not moved. The host's costs are left out: they price no op (the
    simulator reads them from ``hw``).
    """
    from importlib.metadata import version

    from slackswap.models import build_model
    from slackswap.profiling import profile
    from slackswap.profiling.step import fingerprint

    model, example = build_model(name, batch=batch, seq=seq)
    print_ = fingerprint(model, example)
    key = hashlib.sha256(
        f"{print_}|{hw.model_dump_json(exclude=_without_host(hw))}|"
        f"{version('slackswap')}|{_profiler_digest()}".encode()
    ).hexdigest()[:24]
    path = entry_path("profiles", key, name, hw.name)  # (hw.name is a file's: any text)

    def read(value: Any) -> StepProfile:
        found = validate_model(StepProfile, value, str(path))
        if found.model != name or found.fingerprint != print_:
            raise ValueError(f"it holds another model's profile ({found.model})")
        return found

    if (entry := read_entry(path, key, read)) is not None:  # (NOTE [cache entries])
        return entry[0]
    result = profile(model, example, hw, name=name)
    write_entry(path, key, result.model_dump(mode="json"), 0.0)
    return result


@functools.cache
def _profiler_digest() -> str:
    """A digest of the source of the modules a profile depends on: the profiler, the
    cost model, the data model and the model presets."""
    root = Path(__file__).parent
    files = sorted([*(root / "profiling").glob("*.py"), root / "core" / "costmodel.py",
                    root / "core" / "profile.py", root / "core" / "hardware.py",
                    *(root / "models").glob("*.py")])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _no_plan(ctx: PlanContext) -> str:
    """Why a strategy returned no plan at all."""
    if not ctx.reachable:
        return (f"the budget is below the {format_bytes(ctx.working_set)} one op needs at "
                "once")
    return "the strategy has no plan for this model"


def _bound(ctx: PlanContext) -> tuple[float | None, float]:
    """The bound's retention, None where no plan can fit (``retention_bound`` says 0),
    and the seconds its solve took (from the cache: NOTE [plan cache])."""
    bound, seconds = cached_bound(ctx)
    return bound if bound > 0 else None, seconds


def _strategy_entry(ctx: PlanContext, strategy: str) -> tuple[dict[str, Any], Any]:
    """``strategy``'s row of the results: retention None and a reason when it is
    infeasible; the plan from the cache when it is there (NOTE [plan cache])."""
    attempt, elapsed = cached_attempt(ctx, strategy)
    if attempt is None:
        return {"retention": None, "peak_bytes": None, "feasible": False,
                "reason": _no_plan(ctx), "offloaded_bytes": 0, "recomputed_bytes": 0,
                "plan_time_s": elapsed}, None
    plan, result = attempt
    totals = decision_bytes(ctx.profile, plan, by="total").get("total", {})
    checkpoints = checkpoint_bytes(ctx.profile, plan)
    return {
        "retention": result.retention if result.feasible else None,
        "peak_bytes": result.peak_bytes,
        "feasible": result.feasible,
        "reason": None if result.feasible else result.infeasible_reason,
        "offloaded_bytes": totals.get("offload", 0) + checkpoints["offload"],
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
    overrides: Mapping[str, Any] | None = None,
    reference: str = "keep-all",
) -> dict[str, Any]:
    """Run the comparison and write the results folder; returns the results JSON.

    ``sweep``: budgets (fractions) at which every strategy and the bound are planned
    again for the plots (``SWEEP``: 10 to 100%). ``progress`` is called as each of
    ``steps(workloads, sweep)`` steps begins, with what it does.

    ``gpus`` > 1: every plan is made for, and simulated on, one of that many GPUs of the
    node ``hardware`` describes, all running the step in lockstep (NOTE [the node]); each
    workload also shows the SlackSwap plan made for one GPU, simulated on that node.

    ``overrides``: hardware figures to replace (:func:`~slackswap.core.hardware.
    with_overrides`). ``reference``: the peak ``budget`` is a fraction of (``REFERENCES``)."""
    if not 0 < budget <= 1:
        raise InputError(f"--budget {budget} must be a fraction in (0, 1]")
    if reference not in REFERENCES:
        raise InputError(f"unknown reference '{reference}'; use {' or '.join(REFERENCES)}")
    single = load_hardware(hardware, overrides)
    hw = on_node(single, gpus)
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file or a dangling link at its name, a file above it
        raise InputError(f"cannot make the results folder {folder}: {e.strerror or e}; "
                         "name a folder, or a new name, as --out") from None
    for name in _output_names(workloads, sweep):  # before the work, not after half of it
        refuse_unwritable(folder / name)
    results: dict[str, Any] = {"hardware": hw.name, "budget_fraction": budget,
                               "reference": reference, "gpus": gpus, "workloads": []}
    for name in workloads:
        progress(f"{name}: profiling")
        prof = cached_profile(name, single)
        progress(f"{name}: planning at {budget:.0%}")
        peak = reference_peak(prof, reference)
        ctx = PlanContext(prof, hw, int(budget * peak))
        entry: dict[str, Any] = {
            "name": name, "ideal_step_time_s": ctx.ideal,
            "keep_all_peak_bytes": ctx.keep_all_peak, "reference_peak_bytes": peak,
            "budget_bytes": ctx.budget, "working_set_bytes": ctx.working_set,
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
            entry["single_gpu_plan"] = _single_gpu_plan(prof, single, hw, ctx.budget)
        entry["bound_retention"], entry["bound_time_s"] = _bound(ctx)
        if not any(e["feasible"] for e in entry["strategies"].values()):
            # what budget would do: a plan is known to fit this one
            entry["smallest_feasible_budget_bytes"] = smallest_feasible_budget(prof, hw)
        if sweep:
            entry["sweep"] = _sweep(prof, hw, sweep, name, progress, peak)
            _plot_sweep(entry, folder / f"{name}-retention.png")
            entry["plot"] = f"{name}-retention.png"
        results["workloads"].append(entry)
    path = folder / "results.json"
    atomic_write_text(path, json_text(results, str(path), indent=2))  # NOTE [finite JSON]
    atomic_write_text(folder / "report.md", report(results))
    return results


def _output_names(workloads: tuple[str, ...], sweep: tuple[float, ...]) -> list[str]:
    """The files :func:`reproduce` writes in its folder."""
    per = ["slackswap-trace.json", "slackswap-plan.json", *(["retention.png"] if sweep
                                                              else [])]
    return ["results.json", "report.md", *(f"{w}-{p}" for w in workloads for p in per)]


# NOTE [reference peak]
#     A budget given as a fraction is a fraction of a reference peak. ``keep-all`` (the
#     default): the activation peak of the step with everything kept. ``outside-loss``:
#     the same keep-all memory curve (memory in use while each op runs, as the simulator
#     counts it), its peak taken over the ops outside the loss: ``loss_ops`` are the ops
#     around the turn from forward to backward that belong to no submodule of the model
#     (for the presets: the loss function's upcast, log-softmax and NLL, and their
#     backward). The loss's spike (its log-probabilities and their gradient, logits-sized)
#     then is not part of what the fraction scales.
REFERENCES = {
    "keep-all": "the keep-all activation peak",
    "outside-loss": "the keep-all activation peak over the ops outside the loss and its "
                    "backward",
}


def loss_ops(prof: StepProfile) -> range:
    """Indices of the ops of the loss and its backward (NOTE [reference peak]): the run of
    ops of no submodule at the turn from forward to backward (empty when there is none)."""
    ops = prof.ops
    turn = next((op.index for op in ops if op.phase == "backward"), len(ops))
    start, end = turn, turn
    while start > 0 and ops[start - 1].module == "":
        start -= 1
    while end < len(ops) and ops[end].module == "":
        end += 1
    return range(start, end)


def reference_peak(prof: StepProfile, reference: str = "keep-all") -> int:
    """The peak a budget fraction is taken of (NOTE [reference peak])."""
    if reference == "keep-all":
        return prof.keep_all_peak
    if reference != "outside-loss":
        raise InputError(f"unknown reference '{reference}'; use {' or '.join(REFERENCES)}")
    from slackswap.core.plan import Plan
    from slackswap.sim.schedule import build_schedule

    schedule = build_schedule(prof, Plan.keep_all(prof))
    loss, res = loss_ops(prof), schedule.residencies
    level = peak = 0
    for item in schedule.items:  # as PlanContext.memory: allocations at start, frees at end
        level += sum(res[r].bytes for r in item.allocs)
        if item.op not in loss:
            peak = max(peak, level)
        level -= sum(res[r].bytes for r in item.frees)
    return peak


def steps(workloads: tuple[str, ...], sweep: tuple[float, ...] = (), gpus: int = 1) -> int:
    """How many times ``reproduce`` calls ``progress``: for a progress bar."""
    return len(workloads) * (2 + (gpus > 1) + len(sweep))


def _single_gpu_plan(prof: StepProfile, single: Hardware, node: Hardware,
                     budget: int) -> dict[str, Any]:
    """The SlackSwap plan made for one GPU, simulated on the node's ranks."""
    from slackswap.sim import simulate

    ctx = PlanContext(prof, single, budget)
    attempt = cached_attempt(ctx, "slackswap")[0]
    if attempt is None:
        return {"retention": None, "feasible": False, "reason": "no plan for one GPU"}
    result = simulate(prof, attempt[0], node, ctx.budget)
    return {"retention": result.retention if result.feasible else None,
            "feasible": result.feasible,
            "reason": result.infeasible_reason,
            "stall_s": sum(v for k, v in result.stall_s.items() if k != "recompute")}


def _sweep(prof: StepProfile, hw: Hardware, budgets: tuple[float, ...], name: str,
           progress: Progress, reference: int) -> dict[str, Any]:
    rows: dict[str, Any] = {"budgets": list(budgets), "bound": [],
                            **{s: [] for s in STRATEGIES}, "peak_bytes": []}
    for fraction in budgets:
        progress(f"{name}: budget sweep {fraction:.0%}")
        ctx = PlanContext(prof, hw, int(fraction * reference))
        peak = None
        for strategy in STRATEGIES:
            entry, _ = _strategy_entry(ctx, strategy)
            rows[strategy].append(entry["retention"])
            if strategy == "slackswap":
                peak = entry["peak_bytes"]
        rows["peak_bytes"].append(peak)
        rows["bound"].append(_bound(ctx)[0])
    return rows


def _percent(values: list[float | None]) -> list[float]:
    """Retentions in %, an infeasible point NaN: a gap in the line, not 0%."""
    return [math.nan if r is None else r * 100 for r in values]


def sweep_figure(entry: dict[str, Any]) -> Any:
    """The retention-against-budget figure of a workload's ``sweep``: an infeasible point
    is a gap in its strategy's line; budgets no plan fits (the bound infeasible) are
    shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = entry["sweep"]
    xs = [b * 100 for b in sweep["budgets"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(xs, _percent(sweep["bound"]), color="0.5", ls=":", label="bound")
    for i, strategy in enumerate(STRATEGIES):
        ax.plot(xs, _percent(sweep[strategy]), marker="o", ms=3,
                lw=2.2 if strategy == "slackswap" else 1.2, color=f"C{i}", label=strategy)
    half = min((b - a for a, b in zip(xs, xs[1:], strict=False) if b > a), default=10) / 2
    label = "no plan fits"
    for x, bound in zip(xs, sweep["bound"], strict=True):
        if bound is None:
            ax.axvspan(x - half, x + half, color="0.9", lw=0, label=label)
            label = "_"
    ax.set_xlabel("activation memory budget (% of keep-all peak)")
    ax.set_ylabel("throughput retained (%)")
    ax.set_ylim(0, 101)
    ax.set_title(f"{entry['name']}: retention against budget (a gap: infeasible)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def _plot_sweep(entry: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = sweep_figure(entry)
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)


def report(results: dict[str, Any]) -> str:
    """The Markdown report of a reproduce run."""
    budget = results["budget_fraction"]
    lines = [
        "# SlackSwap: throughput retained under an activation-memory budget", "",
        f"Hardware `{results['hardware']}`, budget {budget:.0%} of "
        f"{REFERENCES[results.get('reference', 'keep-all')]}, simulated. Paper: the "
        "SlackSwap paper's own simulation (A100, PCIe 4.0, 50% budget).", "",
        "| workload | paper | SlackSwap | bound | " + " | ".join(
            s for s in STRATEGIES if s != "slackswap") + " |",
        "|---" * (len(STRATEGIES) + 3) + "|",
    ]
    for w in results["workloads"]:
        st = w["strategies"]
        paper = f"{w['paper_retention']:.1%}" if w["paper_retention"] else "-"
        cells = [_pct(st[s]) for s in STRATEGIES if s != "slackswap"]
        lines.append(f"| {w['name']} | {paper} | **{_pct(st['slackswap'])}** | "
                     f"{bound_cell(w)} | " + " | ".join(cells) + " |")
    lines += ["", "Infeasible: the strategy found no plan that fits the budget; in the bound "
              "column, no plan can fit it.", ""]
    lines += [f"- {line}" for w in results["workloads"] if (line := _none_fits(w))]
    if lines[-1].startswith("- "):
        lines.append("")
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
            # an infeasible plan's peak is where its step stopped: no peak of a step
            peak = format_bytes(e["peak_bytes"]) if e["feasible"] else "-"
            lines.append(f"| {s} | {_pct_why(e)} | {peak} | "
                         f"{format_bytes(e['offloaded_bytes'])} "
                         f"| {format_bytes(e['recomputed_bytes'])} | {e['plan_time_s']:.2f} s |")
        if w.get("plot"):
            lines += ["", f"![retention against budget]({w['plot']}) (a gap: infeasible)"]
        if w.get("trace"):
            ours = w["strategies"]["slackswap"]
            what = "" if ours["feasible"] else f", which does not fit ({ours['reason']})"
            lines += ["", f"Trace of the SlackSwap plan{what}: `{w['trace']}` "
                      "(open it at ui.perfetto.dev)."]
        lines.append("")
    return "\n".join(lines)


def _pct(entry: dict[str, Any]) -> str:
    return f"{entry['retention']:.1%}" if entry["feasible"] else "infeasible"


def _pct_why(entry: dict[str, Any]) -> str:
    """The retention, or "infeasible" and why, for a Markdown table cell."""
    if entry["feasible"] or not entry.get("reason"):
        return _pct(entry)
    return f"infeasible: {entry['reason']}".replace("|", "\\|")


def bound_cell(workload: dict[str, Any]) -> str:
    """The bound's retention as a table shows it: "infeasible" when no plan can fit."""
    bound = workload["bound_retention"]
    return "infeasible" if bound is None else f"{bound:.1%}"


def _none_fits(w: dict[str, Any]) -> str:
    """The sentence saying no strategy fits a workload's budget, and why; empty when one
    does."""
    if any(e["feasible"] for e in w["strategies"].values()):
        return ""
    budget = format_bytes(w["budget_bytes"])
    if w["budget_bytes"] < w.get("working_set_bytes", 0):
        why = f"it is below the {format_bytes(w['working_set_bytes'])} one op needs at once"
    elif w["bound_retention"] is None:
        why = "the bound shows no plan can fit it"
    else:
        why = f"the bound leaves room for a plan up to {w['bound_retention']:.1%}"
    line = f"**No strategy fits {w['name']} in {budget}**: {why}."
    if "smallest_feasible_budget_bytes" in w:
        least = w["smallest_feasible_budget_bytes"]
        line += (f" The smallest budget a plan is known to fit: {format_bytes(least)} "
                 f"({least / w['reference_peak_bytes']:.1%} of the reference peak).")
    return line


def written_files(results: dict[str, Any]) -> list[str]:
    """The kinds of file a reproduce run wrote, as the command line lists them."""
    files = ["results.json", "report.md"]
    workloads = results["workloads"]
    files += ["plots"] if any(w.get("plot") for w in workloads) else []
    files += ["traces"] if any(w.get("trace") for w in workloads) else []
    return files
