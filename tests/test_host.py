"""The host in the simulator: issue times, what the runtime costs it, retention, the
trace's host track, hardware files without [host], and the planner's view of it."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from stepgraphs import (
    GPU_ONLY,
    NO_HOST,
    Op,
    T,
    build,
    link_hardware,
    random_plan,
    random_step,
    with_host,
)

from slackswap.core.hardware import HOST_SOURCES, Host, load_hardware
from slackswap.core.plan import Plan
from slackswap.errors import InputError
from slackswap.planners import STRATEGIES, plan_with_result
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import pressure_points
from slackswap.planners.recompute import choose_recompute, rebuild_cost
from slackswap.runtime.watch import watch_for
from slackswap.sim import simulate
from slackswap.sim.engine import run_schedule
from slackswap.sim.host import HostTimes
from slackswap.sim.outputs import chrome_trace

US = 1e-6


def host_only(**costs: float):
    """The reference preset whose host costs only what is given."""
    return with_host(**{**NO_HOST, **costs})


# -- issue times, by hand ----------------------------------------------------------------


def test_a_host_bound_chain_ends_where_the_recurrence_says() -> None:
    """Kernels of 1, 5, 1, 1, 4 us, each issued 3 us after the last: the host issues at
    3, 6, 9, 12, 15 and each item starts at max(previous end, its issue):
    0 -> 3-4, 6-11, 11-12, 12-13, 15-19 us. The step is 19 us against 12 us of kernels,
    7 us of it waiting for the host."""
    durations = [1, 5, 1, 1, 4]
    ops = [Op("forward", d * US, [i - 1] if i else [], [i]) for i, d in enumerate(durations)]
    profile = build(ops, [T(1000) for _ in durations])
    r = simulate(profile, None, host_only(dispatch_s=3 * US))
    starts = [s.start for s in r.run.timeline.spans if s.stream == "compute"]
    assert starts == pytest.approx([3 * US, 6 * US, 11 * US, 12 * US, 15 * US], rel=1e-12)
    assert r.step_time_s == pytest.approx(19 * US, rel=1e-12)
    assert r.stall_s["host"] == pytest.approx(7 * US, rel=1e-12)
    assert r.busy_fraction["host"] == pytest.approx(15 / 19, rel=1e-12)
    # keep-all is the ideal: eager dispatch is not the plan's cost
    assert r.ideal_step_time_s == r.step_time_s and r.retention == 1.0
    assert simulate(profile, None, GPU_ONLY).step_time_s == pytest.approx(12 * US, rel=1e-12)


def _offload_case():
    """f0 makes A (2 KiB, saved by f1: packed after f0 is issued, before f1 is);
    f1, f2 1 us each; b3 unpacks A. Module hooks split forward at ops 1 and 3."""
    tensors = [T(2048, saved=True, first_backward_use=3), T(1000), T(1000), T(1000)]
    ops = [Op("forward", 1 * US, [], [0]), Op("forward", 1 * US, [0], [1]),
           Op("forward", 1 * US, [1], [2]), Op("backward", 1 * US, [0], [3])]
    profile = build(ops, tensors)
    return profile.model_copy(update={"saves": [(0, 1)], "module_events": [1, 3]})


def test_runtime_costs_land_on_the_items_that_pay_them() -> None:
    """Dispatch 100 us, pack 50 us, unpack 30 us, link 1 us per copy: the host issues
    f0 at 100, f1 at 250 (after A's pack, which starts A's offload at 150), f2 at 350,
    b3 at 480 (after unpacking A); A's reload starts when b3 is issued (its prefetch
    point: the start of backward), lands at 481, and b3 runs 481-482 us."""
    profile = _offload_case()
    hw = link_hardware(2048e6, 2048e6, 2048e6, 2048e6, 0.0,
                       host={**NO_HOST, "dispatch_s": 100 * US, "pack_s": 50 * US,
                             "unpack_s": 30 * US, "watch_s": 1.0, "replay_s": 1.0})
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t0": "offload"})
    r = simulate(profile, plan, hw)
    host = r.run.host
    assert host.cost == pytest.approx([100 * US, 150 * US, 100 * US, 130 * US], rel=1e-12)
    assert host.issued == pytest.approx([100 * US, 250 * US, 350 * US, 480 * US], rel=1e-12)
    spans = {(s.stream, s.index): (s.start, s.end) for s in r.run.timeline.spans}
    assert spans["d2h", 0] == pytest.approx((150 * US, 151 * US), rel=1e-12)
    assert spans["h2d", 0] == pytest.approx((480 * US, 481 * US), rel=1e-12)
    assert spans["compute", 3] == pytest.approx((481 * US, 482 * US), rel=1e-12)
    assert r.step_time_s == pytest.approx(482 * US, rel=1e-12)
    # idle before an item is issued is the host's; after, the reload's
    assert r.stall_s["host"] == pytest.approx(477 * US, rel=1e-12)
    assert r.stall_s["reload"] == pytest.approx(1 * US, rel=1e-12)
    # no op is watched to offload (watch_s of 1 s would show)
    assert watch_for(profile, plan).watched_ops == 0


def test_copies_cost_the_host_where_they_are_issued() -> None:
    """NOTE [copy costs]: the case above with offload 20 us and reload 40 us: A's pack
    issues its offload after 70 us of host work in f1 (the copy starts at 170), and b3,
    where the host reaches A's prefetch point, pays the reload with the unpack: issued at
    540, A lands at 541, the step ends at 542. Left out, they cost nothing, and the
    hardware's JSON does not name them."""
    profile = _offload_case()
    host = {**NO_HOST, "dispatch_s": 100 * US, "pack_s": 50 * US, "unpack_s": 30 * US,
            "watch_s": 1.0, "replay_s": 1.0}
    hw = link_hardware(2048e6, 2048e6, 2048e6, 2048e6, 0.0,
                       host={**host, "offload_s": 20 * US, "reload_s": 40 * US})
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t0": "offload"})
    r = simulate(profile, plan, hw)
    assert r.run.host.cost == pytest.approx([100 * US, 170 * US, 100 * US, 170 * US],
                                            rel=1e-12)
    spans = {(s.stream, s.index): (s.start, s.end) for s in r.run.timeline.spans}
    assert spans["d2h", 0] == pytest.approx((170 * US, 171 * US), rel=1e-12)
    assert spans["h2d", 0] == pytest.approx((540 * US, 541 * US), rel=1e-12)
    assert r.step_time_s == pytest.approx(542 * US, rel=1e-12)
    free = link_hardware(2048e6, 2048e6, 2048e6, 2048e6, 0.0, host=host)
    assert simulate(profile, plan, free).step_time_s == pytest.approx(482 * US, rel=1e-12)
    assert "offload_s" not in free.model_dump_json() and "reload_s" in hw.model_dump_json()


def test_watched_ops_are_the_runtimes() -> None:
    """Recomputing A watches its producer's segment (what runtime/watch.py decides);
    a profile without module events is watched whole."""
    profile = _offload_case()
    costs = {"dispatch_s": 100 * US, "pack_s": 50 * US, "unpack_s": 30 * US,
             "watch_s": 20 * US, "replay_s": 40 * US}
    hw = host_only(**costs)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t0": "recompute"})
    r = simulate(profile, plan, hw)
    items = [(i.op, i.recompute) for i in r.run.schedule.items]
    assert items == [(0, False), (1, False), (2, False), (0, True), (3, False)]
    assert watch_for(profile, plan).watched_ops == 1
    # f0 watched, f1 packs A, the rebuild replays, b3 unpacks A
    assert r.run.host.cost == pytest.approx(
        [120 * US, 150 * US, 100 * US, 140 * US, 130 * US], rel=1e-12)
    # host-bound throughout: every item starts as it is issued, the last ends 1 us later
    assert r.step_time_s == pytest.approx(640 * US + 1 * US, rel=1e-12)
    whole = simulate(profile.model_copy(update={"module_events": []}), plan, hw)
    assert sum(whole.run.host.cost) - sum(r.run.host.cost) == pytest.approx(40 * US)


# -- zero host costs change nothing ----------------------------------------------------


def _random_case(seed: int):
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(1, 14))
    plan = random_plan(rng, profile)
    d2h, h2d = rng.uniform(2e7, 5e8), rng.uniform(2e7, 5e8)
    hw = link_hardware(d2h, h2d, d2h * rng.uniform(0.3, 1), h2d * rng.uniform(0.3, 1),
                       rng.choice([0.0, 1e-6, 2e-5]), host=NO_HOST)
    limit = int(profile.keep_all_peak * rng.uniform(0.5, 1.1)) if seed % 2 else None
    return profile, plan, hw, limit


@pytest.mark.parametrize("seed", range(60))
def test_a_host_that_costs_nothing_changes_nothing(seed: int) -> None:
    """Zero issue times through the host's code path give the engine's run without a
    host, to the bit; a hardware whose [host] is all zero simulates as that run."""
    profile, plan, hw, limit = _random_case(seed)
    try:
        result = simulate(profile, plan, hw, limit)
    except InputError:
        return
    sched = result.run.schedule
    cap = math.inf if limit is None else limit
    bare = run_schedule(sched, hw.host_link, cap)
    zero = HostTimes([0.0] * len(sched.items), [0.0] * len(sched.items),
                     [0.0] * len(sched.d2h), [0.0] * len(sched.h2d))
    hosted = run_schedule(sched, hw.host_link, cap, zero)
    for tl in (hosted, result.run.timeline):
        assert tl.spans == bare.spans and tl.memory == bare.memory
        assert tl.end == bare.end and tl.peak == bare.peak and tl.stall == bare.stall
        assert tl.blocked == bare.blocked
    assert result.run.host is None and result.stall_s["host"] == 0.0
    assert result.ideal_step_time_s == sum(op.time_s for op in profile.ops)


# -- retention ---------------------------------------------------------------------------


def test_retention_drops_as_the_runtime_costs_more_on_a_host_bound_step() -> None:
    """Kernels of a few ns, issued 20 us apart: the host sets the pace, so every
    microsecond the runtime adds lengthens the step; the ideal (eager, no runtime)
    stays where it was."""
    rng = random.Random(5)
    profile = random_step(rng, 12)
    for op in profile.ops:
        op.time_s *= 1e-4
    plan = random_plan(random.Random(1), profile)
    assert set(plan.decisions.values()) == {"keep", "offload", "recompute"}
    fast = (1e12, 1e12, 1e12, 1e12, 0.0)
    results = [simulate(profile, plan, link_hardware(
        *fast, host={"dispatch_s": 20 * US, "pack_s": c * US, "watch_s": c * US,
                     "replay_s": c * US, "unpack_s": c * US})) for c in (0, 5, 10, 40)]
    retention = [r.retention for r in results]
    assert retention == sorted(retention, reverse=True) and len(set(retention)) == 4
    assert len({r.ideal_step_time_s for r in results}) == 1
    for r in results:  # the host is busy nearly all the step
        assert r.step_time_s >= r.run.host.busy
        assert r.busy_fraction["host"] > 0.99


def test_a_keep_all_step_pays_no_runtime_and_a_moving_plan_does() -> None:
    """The hand case of tests/test_plan.py whose copies hide entirely: on the preset's
    host it retains less than 1 by exactly the runtime watching its first op (a profile
    without module events is watched whole; the host is far ahead after that)."""
    from test_plan import expensive_small_cheap_large

    profile = expensive_small_cheap_large()
    hw = link_hardware(1e9, 1e9, 1e9, 1e9, 0.0)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t0": "offload"},
                prefetch={"t0": 5})
    r = simulate(profile, plan, hw)
    keep = simulate(profile, None, hw)
    assert keep.retention == 1.0 and keep.run.host.cost == [hw.host.dispatch_s] * 7
    assert r.step_time_s == pytest.approx(keep.step_time_s + hw.host.watch_s, rel=1e-12)
    assert r.retention < 1.0


# -- trace -------------------------------------------------------------------------------


def test_the_trace_has_a_host_track() -> None:
    profile = _offload_case()
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t0": "recompute"})
    r = simulate(profile, plan, load_hardware("a100-80gb"))
    events = chrome_trace(r)["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert (1, "host (simulated)") in names and (1, "issuing thread") in names
    host = sorted((e for e in events if e["ph"] == "X" and e["pid"] == 1),
                  key=lambda e: e["args"]["item"])
    compute = sorted((e for e in events if e["ph"] == "X" and e["cat"] == "compute"),
                     key=lambda e: e["args"]["item"])
    assert [e["name"] for e in host] == [e["name"] for e in compute]
    assert "recompute k0" in [e["name"] for e in host]
    assert [e["dur"] for e in host] == pytest.approx([c * 1e6 for c in r.run.host.cost])
    end = 0.0
    for h, c in zip(host, compute, strict=True):
        assert h["ts"] == pytest.approx(end)  # the host never idles
        end = h["ts"] + h["dur"]
        assert c["ts"] >= end * (1 - 1e-12)  # nothing runs before it is issued
    quiet = chrome_trace(simulate(profile, plan, GPU_ONLY))["traceEvents"]
    assert not [e for e in quiet if e["pid"] == 1]


# -- hardware files ----------------------------------------------------------------------


def _preset_text() -> str:
    return (Path(load_hardware.__code__.co_filename).parent.parent / "hardware" / "presets"
            / "a100-80gb.toml").read_text()


def _without_host(text: str) -> str:
    out, section = [], ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        if section == "host" or line.startswith('"host.'):
            continue
        out.append(line)
    return "\n".join(out)


def test_a_file_without_host_loads_with_the_presets_host(tmp_path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(_without_host(_preset_text()))
    hw = load_hardware(path)
    assert hw.host == Host() == load_hardware("a100-80gb").host
    for name in HOST_SOURCES:  # the defaults cite their sources
        assert HOST_SOURCES[name] in hw.sources[f"host.{name}"]
    # the copies' costs are a GPU host's, no default's: left out, nothing is counted
    assert set(Host.model_fields) - set(HOST_SOURCES) == {"offload_s", "reload_s"}
    assert hw.host.offload_s == hw.host.reload_s == 0
    partial = tmp_path / "partial.toml"
    partial.write_text(_without_host(_preset_text()).replace(
        "[sources]", "[host]\ndispatch_s = 2e-6\n\n[sources]"))
    hw = load_hardware(partial)
    assert hw.host.dispatch_s == 2e-6 and hw.host.pack_s == Host().pack_s
    assert "host.dispatch_s" not in hw.sources  # what the file sets, the file cites


@pytest.mark.parametrize("line, error", [
    ("dispatch_s = -1e-6", r"field 'host\.dispatch_s'.*greater than or equal to 0"),
    ("launch_s = 1e-6", r"field 'host\.launch_s'.*not permitted"),
])
def test_a_bad_host_field_is_named(tmp_path, line: str, error: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(_preset_text().replace("dispatch_s = 7e-6", line))
    with pytest.raises(InputError, match=error):
        load_hardware(path)


# -- the planner -------------------------------------------------------------------------


def two_small_or_one_large():
    """Forward makes A (2 MB, a 50 us kernel), B1 and B2 (1 MB each, 10 us kernels),
    then a 1.6 MB transient: the peak is 5.6 MB. Under 4.5 MB either A or both Bs must
    go (one B frees too little); backward never needs more than the budget."""
    mb = 1_000_000
    tensors = [T(2 * mb, saved=True, first_backward_use=8),  # A
               T(mb, saved=True, first_backward_use=7),  # B1
               T(mb, saved=True, first_backward_use=6),  # B2
               T(1_600_000), T(1000), T(1000), T(1000), T(1000), T(1000)]
    ops = [Op("forward", 50 * US, [], [0]), Op("forward", 10 * US, [], [1]),
           Op("forward", 10 * US, [], [2]), Op("forward", 100 * US, [], [3]),
           Op("forward", 100 * US, [3], [4]),
           Op("backward", 20 * US, [4], [5]), Op("backward", 20 * US, [5, 2], [6]),
           Op("backward", 20 * US, [6, 1], [7]), Op("backward", 20 * US, [7, 0], [8])]
    return build(ops, tensors)


SLOW_LINK = (1e3, 1e3, 1e3, 1e3, 0.0)  # nothing offloaded could land: recompute only
BUDGET = 4_500_000


def test_rebuild_cost_is_the_slower_of_kernel_and_host() -> None:
    profile = two_small_or_one_large()
    cheap = PlanContext(profile, link_hardware(*SLOW_LINK, host=NO_HOST), BUDGET)
    dear = PlanContext(profile, link_hardware(*SLOW_LINK, host={"replay_s": 100 * US}),
                       BUDGET)
    issue = dear.hw.host.dispatch_s + 100 * US
    for c in cheap.candidates:
        assert rebuild_cost(cheap, c) == c.recompute_s
        assert rebuild_cost(dear, c) == pytest.approx(max(c.recompute_s, issue))


@pytest.mark.parametrize("strategy", ["recompute-only", "slackswap"])
def test_a_dear_host_makes_the_planner_recompute_fewer_larger(strategy: str) -> None:
    """Rebuilding both Bs costs 20 us of kernels, A 50 us: with a free host the least-cost
    cover is the Bs (two recompute items). When each replay costs the host 107 us, the
    Bs cost 214 us and A 107 us: the cover is A alone (one item), and the simulator
    agrees that A alone is the faster step on that host."""
    profile = two_small_or_one_large()
    counts = {}
    for label, host in (("free", NO_HOST), ("dear", {"replay_s": 100 * US})):
        hw = link_hardware(*SLOW_LINK, host=host)
        ctx = PlanContext(profile, hw, BUDGET)
        chosen = choose_recompute(ctx, ctx.candidates, pressure_points(ctx))
        plan, result = plan_with_result(profile, BUDGET, hw, strategy)
        assert result.feasible and result.peak_bytes <= BUDGET
        assert {n for n, d in plan.decisions.items() if d == "recompute"} == chosen
        counts[label] = sum(i.recompute for i in result.run.schedule.items)
        if label == "dear":
            assert chosen == {"t0"}
            other = Plan(fingerprint=profile.fingerprint, strategy="hand",
                         decisions={"t1": "recompute", "t2": "recompute"})
            assert simulate(profile, other, hw, BUDGET).retention < result.retention
        else:
            assert chosen == {"t1", "t2"}
    assert counts == {"free": 2, "dear": 1}


@pytest.mark.parametrize("seed", range(12))
def test_no_strategy_beats_the_bound_on_a_busy_host(seed: int) -> None:
    """As in tests/test_plan.py, with host costs of the order of the kernels."""
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(3, 14))
    for t in profile.tensors:  # above the planners' size floor
        t.bytes *= 100
    host = {k: rng.uniform(0, 3e-4) for k in NO_HOST}
    hw = link_hardware(rng.uniform(1e9, 3e10), rng.uniform(1e9, 3e10), 1e9, 1e9, 1e-6,
                       host=host)
    budget = rng.uniform(0.3, 0.9)
    ctx = PlanContext(profile, hw, int(budget * profile.keep_all_peak))
    bound = retention_bound(ctx)
    assert bound <= 1.0
    for strategy in STRATEGIES:
        attempt = plan_with_result(profile, budget, hw, strategy)
        if attempt is not None and attempt[1].feasible:
            assert attempt[1].retention <= bound + 1e-9, strategy
