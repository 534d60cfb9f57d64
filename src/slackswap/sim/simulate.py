"""``simulate``: time one step of a profile under a plan, with a memory limit."""

from __future__ import annotations

import bisect
import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slackswap.core.hardware import Hardware, load_hardware, profile_hardware
from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.core.result import SimResult
from slackswap.core.units import format_bytes, resolve_budget
from slackswap.errors import InputError
from slackswap.sim.engine import Blocked, Timeline, run_schedule
from slackswap.sim.host import HostTimes, eager_step_time, host_times
from slackswap.sim.schedule import Schedule, build_schedule, min_working_set, on_compute_stream

__all__ = ["simulate", "SimRun", "collector_paused", "offload_frees"]


class SimRun:
    """The schedule, host issue times (None when the host costs nothing) and timeline
    behind a :class:`SimResult`, for traces and plots."""

    def __init__(self, profile: StepProfile, schedule: Schedule, timeline: Timeline,
                 host: HostTimes | None = None) -> None:
        self.profile, self.schedule, self.timeline = profile, schedule, timeline
        self.host = host


def simulate(
    profile: StepProfile,
    plan: Plan | None = None,
    hardware: str | Path | Hardware | None = None,
    memory_limit: str | int | float | None = None,
) -> SimResult:
    """Simulate one step of ``profile`` under ``plan`` (keep-all when None).

    ``hardware`` defaults to the preset the profile was made for; ``memory_limit`` is
    bytes, a string such as ``"24GiB"``, or a fraction of the keep-all peak (``0.5``).
    The result's ``run`` attribute holds the schedule and timeline. The ideal step is
    keep-all with no limit as plain eager PyTorch runs it: each op dispatched by the host
    (``hardware.host.dispatch_s``), no runtime; retention is what the plan costs on top.
    """
    plan = plan or Plan.keep_all(profile)
    plan.check(profile)
    hw = load_hardware(hardware) if hardware else profile_hardware(profile.hardware)
    peak_keep_all = profile.keep_all_peak
    limit = None if memory_limit is None else resolve_budget(memory_limit, peak_keep_all)
    if limit is not None:
        minimum, op = min_working_set(profile)
        if limit < minimum:
            raise InputError(
                f"memory limit {format_bytes(limit)} is below the step's irreducible working "
                f"set: op {op} ({profile.ops[op].kind}) needs {minimum} bytes "
                f"({format_bytes(minimum)}) of activations at once"
            )
    with collector_paused():
        built = build_schedule(profile, plan)
        schedule = built
        link = hw.host_link
        if link.stream == "compute":  # each copy a kernel of its own (HostLink.stream)
            schedule = on_compute_stream(
                built, [link.latency_s + c.bytes / link.d2h_bandwidth for c in built.d2h],
                [link.latency_s + c.bytes / link.h2d_bandwidth for c in built.h2d])
        host = host_times(profile, plan, schedule, hw.host)
        tl = run_schedule(schedule, hw.host_link, math.inf if limit is None else limit, host)
    feasible = tl.blocked is None
    reason = None if feasible else _describe(profile, schedule, tl.blocked)
    pinned = sum(c.bytes for c in built.d2h)  # host memory a rank pins for its copies
    if feasible and hw.node is not None and pinned * hw.ranks > hw.node.host_memory_bytes:
        # NOTE [the node]: every rank pins its offloads in the one host memory
        feasible = False
        reason = (f"host memory: {hw.ranks} ranks pin {format_bytes(pinned)} each, "
                  f"{format_bytes(pinned * hw.ranks)} in all, more than the node's "
                  f"{format_bytes(hw.node.host_memory_bytes)}")
    step = tl.end
    ideal = eager_step_time(profile, hw.host.dispatch_s)
    busy = {"compute": 0.0, "d2h": 0.0, "h2d": 0.0, "host": 0.0}
    for span in tl.spans:
        busy[span.stream] += span.end - span.start
    if host is not None:
        busy["host"] = host.busy
    recompute = sum(i.duration for i in schedule.items if i.recompute)
    result = SimResult(
        fingerprint=profile.fingerprint,
        strategy=plan.strategy,
        feasible=feasible,
        infeasible_reason=reason,
        shortfall_bytes=0 if tl.blocked is None else int(
            tl.blocked.used + tl.blocked.need - tl.blocked.limit),
        step_time_s=step,
        ideal_step_time_s=ideal,
        # (a step that takes no time loses none: all of it retained)
        retention=0.0 if not feasible else ideal / step if step > 0 else 1.0,
        peak_bytes=tl.peak,
        peak_time_s=tl.peak_time,
        keep_all_peak_bytes=peak_keep_all,
        gradient_bytes=profile.gradient_bytes,
        memory_limit_bytes=limit,
        stall_s={**tl.stall, "recompute": recompute},
        d2h_bytes=pinned,
        h2d_bytes=sum(c.bytes for c in built.h2d),
        recompute_s=recompute,
        busy_fraction={k: v / step if step > 0 else 0.0 for k, v in busy.items()},
    )
    result._run = SimRun(profile, schedule, tl, host)
    return result


@contextmanager
def collector_paused() -> Iterator[None]:
    """NOTE [collector paused]: a simulation makes some 10^5 small objects, none in a
    reference cycle, and each burst of them sets off Python's cyclic collector, which
    then walks the profile's million records too: 40% of a planner's time on llama-7b.
    Reference counting frees everything a simulation drops; the collector resumes after
    it (as it was: a caller that turned it off keeps it off). ``PlanContext.attempt``
    keeps it paused over all of a strategy's simulations: resumed after each, it
    collected once per simulation what the last one made (10% of SlackSwap's planning
    time on gpt2-xl)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _describe(profile: StepProfile, schedule: Schedule, b: Blocked) -> str:
    item = schedule.items[b.item]
    op = profile.ops[item.op]
    what = f"{'recompute of ' if item.recompute else ''}op {op.index} ({op.kind} in " \
           f"{op.module or '(top)'})"
    if b.reload is not None:
        tensor = profile.tensors[schedule.h2d[b.reload].tensor]
        what = f"the reload of '{tensor.name}' needed by {what}"
    return (f"{what} needs {format_bytes(b.need)} with {format_bytes(b.used)} of the "
            f"{format_bytes(b.limit)} limit in use and nothing left to free: "
            f"short by {format_bytes(b.used + b.need - b.limit)}")


def offload_frees(profile: StepProfile, plan: Plan,
                  hardware: str | Path | Hardware | None = None) -> dict[str, int]:
    """For each activation ``plan`` offloads, the profile op before which the simulated
    step, under the plan's budget, has freed its device memory (its copy done and its
    forward uses over): the first op to start at or after that moment. Activations the
    simulation never frees (an infeasible run) are left out."""
    if Decision.OFFLOAD not in plan.decisions.values():
        return {}
    run = simulate(profile, plan, hardware, memory_limit=plan.budget_bytes)._run
    items, tl = run.schedule.items, run.timeline
    spans = [s for s in tl.spans if s.stream == "compute"]  # one stream: in time order
    starts = [s.start for s in spans]
    frees = {}
    for copy in run.schedule.d2h:
        freed = tl.free_time.get(copy.residency)
        k = len(spans) if freed is None else bisect.bisect_left(starts, freed)
        if k < len(spans):
            frees[profile.tensors[copy.tensor].name] = items[spans[k].index].position
    return frees
