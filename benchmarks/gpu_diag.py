"""One workload's step on a GPU, measured against its simulation, with traces.

    python benchmarks/gpu_diag.py --model gpt2-xl --layers 12 --out DIR
    python benchmarks/gpu_diag.py --model bert-large --layers 8 --strategies slackswap --out DIR
    python benchmarks/gpu_diag.py --device cpu --model gpt2-xl-tiny --out DIR   # a smoke test
    python benchmarks/gpu_diag.py --summary SESSION_DIR                        # one table

It builds the workload with real weights on the device, profiles one real step
(``mode="measured"``) and saves that profile (``DIR/profile.json``, the file
``slackswap profile -o`` writes, so a CPU can replay the step in the simulator), then
runs keep-all and each strategy's plan at the budget for ``--steps`` steps after a
warm-up, and records per plan: the median step and forward time, the step's peak
allocated memory above what was allocated at its start (CUDA; weight gradients are kept
between steps, so activations and temporaries, as the simulator counts them) against the
budget, the simulated step, peak and retention, and the runtime's stats; the plans go to
``DIR/plans/``. It takes a ``torch.profiler`` trace of one keep-all and one SlackSwap
step (``DIR/trace-*.json.gz``; first, after SlackSwap's plan is measured, so a run cut
short keeps them) and summarises each per stream: compute busy,
compute idle waiting for the host and waiting for copies, copy rates each way, and the
forward's host time. Everything goes to ``DIR/diag.json``, written after each part, so a
run stopped early keeps what it measured.

The memory claim of "Exact and on budget": each plan's measured peak is within 1% over
its budget; printed as ``PASS``/``FAIL`` lines (CUDA only: a CPU measures no peak).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import sys
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import torch

import slackswap
from slackswap.core.jsonio import atomic_write, atomic_write_text
from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile
from slackswap.models import build_model, with_layers
from slackswap.planners.api import STRATEGIES

HARDWARE = "h200"
BUDGET_SLACK = 0.01  # measured peak may exceed the budget by this fraction
SIM_TOLERANCE = 0.05  # |measured - simulated peak| / simulated, reported beside
MIN_GAP_US = 20.0  # compute-stream gaps shorter than this are launch jitter
TRACED = ("keep-all", "slackswap")


# ---------------------------------------------------------------- measuring steps


def sync(device: str) -> None:
    """Wait for the device (no-op on a CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def one_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: Plan | None,
             profile: StepProfile, device: str,
             forward_s: list[float] | None = None) -> dict[str, Any] | None:
    """Forward and backward once, under ``plan`` (plain PyTorch when None); the runtime's
    stats. With ``forward_s``, waits for the device after forward and appends its time."""
    stats = None
    start = time.perf_counter()
    with torch.profiler.record_function("STEP_FORWARD"):
        if plan is None:
            loss = model(**batch).loss
        else:
            runtime = slackswap.apply(model, plan, profile=profile)
            with runtime:
                loss = model(**batch).loss
            stats = runtime.stats
    if forward_s is not None:
        sync(device)
        forward_s.append(time.perf_counter() - start)
    with torch.profiler.record_function("STEP_BACKWARD"):
        loss.backward()
    model.zero_grad(set_to_none=False)
    return None if stats is None else stats.as_dict()


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def timed(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: Plan | None,
          profile: StepProfile, device: str, steps: int) -> dict[str, Any]:
    """Median step and forward time over ``steps`` steps after a warm-up, the largest
    peak above each step's start (CUDA) and the last step's runtime stats."""
    one_step(model, batch, plan, profile, device)
    sync(device)
    times: list[float] = []
    forwards: list[float] = []
    peak: int | None = None
    stats = None
    for _ in range(steps):
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        stats = one_step(model, batch, plan, profile, device, forwards)
        sync(device)
        times.append(time.perf_counter() - start)
        if device == "cuda":
            peak = max(peak or 0, torch.cuda.max_memory_allocated() - before)
    return {"step_ms": 1e3 * median(times), "forward_ms": 1e3 * median(forwards),
            "all_ms": [round(1e3 * t, 3) for t in times], "peak_bytes": peak,
            "stats": stats}


def simulated(profile: StepProfile, plan: Plan, budget: float | None) -> dict[str, Any]:
    """The simulator's step, peak and retention for ``plan`` on the hardware preset."""
    sim = slackswap.simulate(profile, plan, HARDWARE, memory_limit=budget)
    return {"sim_step_ms": 1e3 * sim.step_time_s, "sim_retention": sim.retention,
            "sim_peak_bytes": sim.peak_bytes, "sim_feasible": sim.feasible}


def memory_check(label: str, row: dict[str, Any]) -> tuple[str, str]:
    """``(verdict, line)``: PASS when the measured peak is at most the budget plus 1%,
    FAIL when over, SKIP without a measured peak or a budget."""
    peak, budget = row.get("peak_bytes"), row.get("budget_bytes")
    if peak is None or budget is None:
        return "SKIP", f"SKIP memory {label}: no measured peak (CUDA only) or no plan"
    verdict = "PASS" if peak <= budget * (1 + BUDGET_SLACK) else "FAIL"
    sim = row.get("sim_peak_bytes") or 0
    off_sim = f"{(peak - sim) / sim:+.1%}" if sim else "n/a"
    return verdict, (f"{verdict} memory {label}: peak {peak / 1e6:.1f} MB <= budget "
                     f"{budget / 1e6:.1f} MB + {BUDGET_SLACK:.0%} "
                     f"(measured {peak / budget - 1:+.2%} of the budget; "
                     f"{off_sim} of simulated {sim / 1e6:.1f} MB)")


# ---------------------------------------------------------------- traces


def _stream_summary(events: list[dict[str, Any]], t_start: float) -> dict[str, Any]:
    """Busy time (overlaps merged), span and per-kind counts, time, bytes and rate of one
    stream's device events."""
    events.sort(key=lambda e: e["ts"])
    busy, end = 0.0, float("-inf")
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b > end:
            busy += b - max(a, end)
            end = b
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for e in events:
        kind = kinds["kernel" if e.get("cat") == "kernel" else e["name"][:60]]
        kind[0] += 1
        kind[1] += e["dur"] / 1e3
        kind[2] += int(e.get("args", {}).get("bytes", 0) or 0)
    return {
        "events": len(events), "busy_ms": round(busy / 1e3, 3),
        "first_ms": round((events[0]["ts"] - t_start) / 1e3, 3),
        "last_ms": round((events[-1]["ts"] + events[-1]["dur"] - t_start) / 1e3, 3),
        "by_kind": {k: {"n": n, "ms": round(ms, 3), "GB": round(nbytes / 1e9, 4),
                        "GBps": round(nbytes / 1e9 / (ms / 1e3), 1) if ms and nbytes else None}
                    for k, (n, ms, nbytes) in kinds.items()},
    }


def _copy_rates(device_events: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Bytes, copy-engine time and rate of the device-to-host and host-to-device copies."""
    out = {}
    for direction in ("DtoH", "HtoD"):
        copies = [e for e in device_events
                  if e.get("cat") == "gpu_memcpy" and direction in e["name"]]
        nbytes = sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in copies)
        ms = sum(e["dur"] for e in copies) / 1e3
        out[direction] = {"n": len(copies), "GB": round(nbytes / 1e9, 4), "ms": round(ms, 3),
                          "GBps": round(nbytes / 1e9 / (ms / 1e3), 1) if ms and nbytes else None}
    return out


def summarise_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Per stream of a chrome trace from ``torch.profiler``: device events, busy time and
    copy rates; the compute stream's idle time, split into waiting for the host (the next
    kernel was launched after the gap began) and waiting for copies (launched before:
    held by an event), by phase; the forward's and backward's host time (the
    ``STEP_FORWARD``/``STEP_BACKWARD`` annotations); and the runtime API's calls."""
    xs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in xs
             if e.get("cat") == "user_annotation" and e["name"].startswith("STEP_")}
    device = [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    out: dict[str, Any] = {
        "host_ms": {k.removeprefix("STEP_").lower(): round((b - a) / 1e3, 3)
                    for k, (a, b) in spans.items()},
        "streams": {}, "copies": _copy_rates(device), "compute_stream": None,
        "compute_busy_ms": 0.0, "compute_idle_ms": {"host": 0.0, "copies": 0.0},
        "compute_idle_by_phase_ms": {}, "gpu_span_ms": 0.0, "gaps": [], "runtime_calls": {},
    }
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        calls[e["name"]][0] += 1
        calls[e["name"]][1] += e["dur"] / 1e3
    out["runtime_calls"] = {k: {"n": n, "ms": round(ms, 3)}
                            for k, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1])}
    if not device:
        return out
    by_stream: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in device:
        by_stream[e.get("args", {}).get("stream")].append(e)
    t_start = min(e["ts"] for e in device)
    out["gpu_span_ms"] = round((max(e["ts"] + e["dur"] for e in device) - t_start) / 1e3, 3)
    out["streams"] = {str(s): _stream_summary(es, t_start) for s, es in by_stream.items()}
    compute = max(by_stream, key=lambda s: sum(e.get("cat") == "kernel" for e in by_stream[s]))
    out["compute_stream"] = str(compute)
    out["compute_busy_ms"] = out["streams"][str(compute)]["busy_ms"]
    _compute_gaps(out, by_stream[compute], runtime, spans.get("STEP_FORWARD"), t_start)
    return out


def _compute_gaps(out: dict[str, Any], kernels: list[dict[str, Any]],
                  runtime: list[dict[str, Any]], forward: tuple[float, float] | None,
                  t_start: float) -> None:
    """Fill ``out``'s compute idle time, by cause and phase, and its 40 largest gaps."""
    launches = {e.get("args", {}).get("correlation"): e for e in runtime}
    total = {"host": 0.0, "copies": 0.0}
    by_phase: dict[str, float] = defaultdict(float)
    gaps = []
    for prev, nxt in pairwise(kernels):
        gap_start = prev["ts"] + prev["dur"]
        gap = nxt["ts"] - gap_start
        if gap < MIN_GAP_US:
            continue
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        kind = ("host" if launch is not None and launch["ts"] + launch["dur"] > gap_start + 5
                else "copies")
        total[kind] += gap
        in_forward = (forward is not None and launch is not None
                      and gap_start < forward[1] + 2000 and launch["ts"] < forward[1])
        by_phase[f"{'forward' if in_forward else 'backward'}_{kind}"] += gap
        gaps.append({"at_ms": round((gap_start - t_start) / 1e3, 3),
                     "gap_ms": round(gap / 1e3, 3), "kind": kind, "next": nxt["name"][:50],
                     "launch_lag_ms": (round((launch["ts"] - gap_start) / 1e3, 3)
                                       if launch is not None else None)})
    out["compute_idle_ms"] = {k: round(v / 1e3, 3) for k, v in total.items()}
    out["compute_idle_by_phase_ms"] = {k: round(v / 1e3, 3) for k, v in by_phase.items()}
    out["gaps"] = sorted(gaps, key=lambda g: -g["gap_ms"])[:40]


def take_trace(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: Plan | None,
               profile: StepProfile, device: str, path: Path) -> dict[str, Any]:
    """Trace one step (after a warm-up one) with ``torch.profiler``, gzip the chrome
    trace to ``path`` (``.json.gz``) and summarise it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    one_step(model, batch, plan, profile, device)
    sync(device)
    with torch_profile(activities=activities) as prof:
        one_step(model, batch, plan, profile, device)
        sync(device)
    raw = path.with_suffix("")  # trace-x.json
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f:
        summary = summarise_trace(json.load(f))

    def gzipped(out: BinaryIO) -> None:
        with open(raw, "rb") as f, gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6) as g:
            shutil.copyfileobj(f, g)

    atomic_write(path, gzipped)
    raw.unlink()
    return summary


def trace_line(label: str, s: dict[str, Any]) -> str:
    """One line of a trace summary."""
    idle = s["compute_idle_ms"]
    rates = " ".join(f"{d} {c['GB']} GB at {c['GBps']} GB/s" for d, c in s["copies"].items()
                     if c["n"])
    return (f"trace {label}: GPU span {s['gpu_span_ms']} ms, compute busy "
            f"{s['compute_busy_ms']} ms, idle for the host {idle['host']} ms, for copies "
            f"{idle['copies']} ms (by phase {s['compute_idle_by_phase_ms']}); host time "
            f"{s['host_ms']}; copies: {rates or 'none'}")


# ---------------------------------------------------------------- one workload


def _installed(package: str) -> str:
    """The installed version of ``package``, or ``source`` when run from a checkout."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "source"


def versions() -> dict[str, str]:
    """Versions of what the measurement depends on."""
    import pydantic
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "pydantic": pydantic.__version__,
           "slackswap": _installed("slackswap"),
           "cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


class Diag:
    """One workload's measurements, written to ``out/diag.json`` as they are made."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        (self.out / "plans").mkdir(parents=True, exist_ok=True)
        self.name = with_layers(args.model, args.layers)
        self.device = args.device
        self.results: dict[str, Any] = {
            "model": self.name, "budget": args.budget, "hardware": HARDWARE,
            "device": self.device, "dtype": self.dtype, "steps": args.steps,
            "versions": versions(), "keep_all": None, "plans": {}, "traces": {},
            "memory_checks": [], "timings_s": {}}

    @property
    def dtype(self) -> str:
        return "bf16" if self.device == "cuda" else "fp32"

    def save(self) -> None:
        """Write everything measured so far."""
        atomic_write_text(self.out / "diag.json",
                          json.dumps(self.results, indent=1, default=str) + "\n")

    def build(self) -> None:
        """Build the workload on the device, profile one real step and save the profile."""
        start = time.perf_counter()
        self.model, self.batch = build_model(self.name, dtype=self.dtype, fake=False,
                                             device=self.device)
        self.profile = slackswap.profile(self.model, self.batch, HARDWARE, mode="measured",
                                         name=self.name)
        self.profile.save(self.out / "profile.json")
        self.results["profile"] = {"ops": len(self.profile.ops),
                                   "keep_all_peak_bytes": self.profile.keep_all_peak,
                                   "path": "profile.json"}
        self.results["timings_s"]["build_and_profile"] = round(time.perf_counter() - start, 2)
        print(f"{self.name} on {self.device} ({self.dtype}): {len(self.profile.ops)} ops, "
              f"built and profiled in {time.perf_counter() - start:.1f} s", flush=True)
        self.save()

    def keep_all(self) -> None:
        """Keep-all, measured and simulated."""
        plan = Plan.keep_all(self.profile)
        row = timed(self.model, self.batch, None, self.profile, self.device, self.args.steps)
        row |= simulated(self.profile, plan, None)
        row["profile_peak_bytes"] = self.profile.keep_all_peak
        self.results["keep_all"] = row
        peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 1e6:.1f} MB"
        print(f"keep-all: measured {row['step_ms']:.1f} ms (forward {row['forward_ms']:.1f}), "
              f"simulated {row['sim_step_ms']:.1f} ms; peak {peak}, profile "
              f"{self.profile.keep_all_peak / 1e6:.1f} MB", flush=True)
        self.save()

    def strategies(self, strategies: list[str]) -> dict[str, Plan]:
        """Plan, simulate and run each strategy at the budget, and check its peak against
        the budget; the plans made."""
        plans = {}
        keep_ms = self.results["keep_all"]["step_ms"]
        for strategy in strategies:
            start = time.perf_counter()
            try:
                plan = slackswap.plan(self.profile, self.args.budget, HARDWARE,
                                      strategy=strategy)
            except Exception as err:  # noqa: BLE001 - a strategy that cannot plan is a row
                self.results["plans"][strategy] = {"error": str(err)[:300]}
                print(f"{strategy}: no plan ({str(err)[:120]})", flush=True)
                self.check_memory(strategy)
                continue
            plan_s = time.perf_counter() - start
            plans[strategy] = plan
            plan.save(self.out / "plans" / f"{strategy}.json")
            row = simulated(self.profile, plan, self.args.budget)
            row |= timed(self.model, self.batch, plan, self.profile, self.device,
                         self.args.steps)
            row |= {"budget_bytes": plan.budget_bytes, "plan_s": round(plan_s, 3),
                    "measured_retention": keep_ms / row["step_ms"]}
            self.results["plans"][strategy] = row
            peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 1e6:.1f}"
            print(f"{strategy:18s} measured {row['step_ms']:.1f} ms (forward "
                  f"{row['forward_ms']:.1f}) retention {row['measured_retention']:.3f} | "
                  f"simulated {row['sim_step_ms']:.1f} ms retention "
                  f"{row['sim_retention']:.3f} | peak {peak} MB, simulated "
                  f"{row['sim_peak_bytes'] / 1e6:.1f}, budget {plan.budget_bytes / 1e6:.1f} "
                  f"| planned in {plan_s:.2f} s | stats {row['stats']}", flush=True)
            self.check_memory(strategy)
        return plans

    def check_memory(self, strategy: str) -> None:
        """The budget claim for one plan: a line, kept with the results."""
        verdict, line = memory_check(f"{self.name} {strategy}", self.results["plans"][strategy])
        self.results["memory_checks"].append({"strategy": strategy, "verdict": verdict,
                                              "line": line})
        print(line, flush=True)
        self.save()

    def traces(self, plans: dict[str, Plan]) -> None:
        """Trace one step of each plan --trace names (keep-all and SlackSwap by default)."""
        for label in self.args.trace:
            if label != "keep-all" and label not in plans:
                continue
            plan = None if label == "keep-all" else plans[label]
            path = self.out / f"trace-{label}.json.gz"
            start = time.perf_counter()
            try:
                summary = take_trace(self.model, self.batch, plan, self.profile, self.device,
                                     path)
            except Exception as err:  # noqa: BLE001 - a failed trace must not lose the rest
                self.results["traces"][label] = {"error": repr(err)[:300]}
                print(f"trace {label} failed: {err!r}", flush=True)
                continue
            summary["path"] = path.name
            self.results["traces"][label] = summary
            self.results["timings_s"][f"trace_{label}"] = round(time.perf_counter() - start, 2)
            print(trace_line(label, summary), flush=True)
            self.save()

    def run(self) -> int:
        """Every part; 1 when a memory check failed."""
        start = time.perf_counter()
        self.build()
        self.keep_all()
        # the traced plans first, then their traces, so a run cut short has them
        traced = [s for s in self.args.strategies if s in self.args.trace]
        plans = self.strategies(traced)
        self.traces(plans)
        plans |= self.strategies([s for s in self.args.strategies if s not in traced])
        self.results["timings_s"]["total"] = round(time.perf_counter() - start, 2)
        self.save()
        print(f"done in {time.perf_counter() - start:.1f} s: {self.out / 'diag.json'}",
              flush=True)
        failed = [c for c in self.results["memory_checks"] if c["verdict"] == "FAIL"]
        return 1 if failed else 0


# ---------------------------------------------------------------- the session's table


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _mb(value: int | None) -> str:
    return "" if value is None else f"{value / 1e6:.0f}"


def table_rows(diag: dict[str, Any]) -> list[list[str]]:
    """One row per plan of one workload's ``diag.json``."""
    rows = []
    checks = {c["strategy"]: c["verdict"] for c in diag.get("memory_checks", [])}
    plans: dict[str, Any] = {}
    if diag.get("keep_all"):
        plans["keep-all"] = diag["keep_all"] | {"measured_retention": 1.0}
    plans |= diag.get("plans", {})
    for label, row in plans.items():
        trace = diag.get("traces", {}).get(label) or {}
        if "error" in row:
            rows.append([diag["model"], label, "no plan"] + [""] * 3 + ["SKIP"] + [""] * 3)
            continue
        error = (row["sim_step_ms"] / row["step_ms"] - 1) if row.get("step_ms") else None
        idle = trace.get("compute_idle_ms", {})
        copies = trace.get("copies", {})
        rows.append([
            diag["model"], label,
            f"{_ms(row.get('step_ms'))} / {_ms(row.get('sim_step_ms'))}",
            "" if error is None else f"{error:+.0%}",
            f"{row.get('measured_retention', 0):.3f} / {row.get('sim_retention', 0):.3f}",
            f"{_mb(row.get('peak_bytes'))} / {_mb(row.get('sim_peak_bytes'))} / "
            f"{_mb(row.get('budget_bytes'))}",
            checks.get(label, ""),
            f"{_ms(row.get('forward_ms'))} / {_ms(trace.get('host_ms', {}).get('forward'))}",
            (f"{trace.get('compute_busy_ms', '')} / {idle.get('host', '')} / "
             f"{idle.get('copies', '')}") if trace and "error" not in trace else "",
            (f"{copies.get('DtoH', {}).get('GBps') or '-'} / "
             f"{copies.get('HtoD', {}).get('GBps') or '-'}") if copies else "",
        ])
    return rows


HEADER = ["workload", "plan", "step ms meas/sim", "sim err", "retention meas/sim",
          "peak MB meas/sim/budget", "mem", "fwd ms / fwd host ms",
          "trace busy/idle-host/idle-copies ms", "D2H/H2D GB/s"]


def render(rows: list[list[str]]) -> str:
    """A plain-text table with a header line."""
    rows = [HEADER] + [r[:len(HEADER)] + [""] * (len(HEADER) - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def session_summary(folder: Path) -> str:
    """The table of every ``*/diag.json`` under ``folder``, then the memory checks."""
    rows, verdicts, lines = [], defaultdict(int), []
    for path in sorted(folder.glob("*/diag.json")):
        try:
            diag = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            rows.append([path.parent.name, f"unreadable: {err}"[:80]])
            continue
        rows += table_rows(diag)
        for check in diag.get("memory_checks", []):
            verdicts[check["verdict"]] += 1
            if check["verdict"] != "SKIP":
                lines.append(check["line"])
    if not rows:
        return "no diag.json found under " + str(folder)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items())) or "none"
    return "\n".join([render(rows), *lines, f"memory checks (peak <= budget + "
                                            f"{BUDGET_SLACK:.0%}): {counts}"])


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", help="a preset (gpt2-xl-tiny on a CPU)")
    parser.add_argument("--layers", type=int, help="layers of the preset to build")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="fraction of the keep-all peak (default 0.5)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated strategies (default: every one)")
    parser.add_argument("--trace", default=",".join(TRACED),
                        help="plans to trace, comma-separated ('' for none)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after a warm-up")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, help="folder for this workload's files")
    parser.add_argument("--summary", type=Path, metavar="SESSION_DIR",
                        help="print the table of every */diag.json under SESSION_DIR")
    args = parser.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.trace = [s for s in args.trace.split(",") if s]
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    if args.summary is None and args.out is None:
        parser.error("--out is needed (or --summary)")
    if args.device == "cuda" and args.summary is None and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summary is not None:
        print(session_summary(args.summary))
        return 0
    if args.device == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    return Diag(args).run()


if __name__ == "__main__":
    sys.exit(main())
