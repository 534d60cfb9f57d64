"""Planners: hand-built cases with a known best plan, the bound, the reference workloads."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

import pytest
from stepgraphs import NO_HOST, Op, T, best_assignment, build, link_hardware, random_step

import slackswap
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError
from slackswap.models import build_model
from slackswap.planners import (
    STRATEGIES,
    plan_in_context,
    plan_with_result,
    recompute,
    slack,
    smallest_feasible_budget,
)
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import evicted_at, pressure_points
from slackswap.planners.search import score, scores_better
from slackswap.reproduce import cached_profile

MS = 1e-3


def expensive_small_cheap_large() -> StepProfile:
    """B (t0): 1 MB made by a 5 ms op; A (t2): 4 MB made by a 0.1 ms op late in forward.
    At 1 GB/s only B's offload lands before forward ends; A's would not."""
    tensors = [T(1_000_000, saved=True, first_backward_use=6),  # B
               T(1000),
               T(4_000_000, saved=True, first_backward_use=4),  # A
               T(1000), T(1000), T(1000), T(1000)]
    ops = [Op("forward", 5 * MS, [], [0]), Op("forward", 1.5 * MS, [], [1]),
           Op("forward", 0.1 * MS, [], [2]), Op("forward", 1.2 * MS, [2], [3]),
           Op("backward", 2 * MS, [2, 3], [4]), Op("backward", 2 * MS, [4], [5]),
           Op("backward", 2 * MS, [0, 5], [6])]
    return build(ops, tensors)


GB_PER_S = link_hardware(1e9, 1e9, 1e9, 1e9, 0.0, host=NO_HOST)  # tests/test_host.py: with
BUDGET = "4500000"  # bytes: one of the two must go, and only B can leave in time


def test_offloads_the_expensive_and_keeps_the_cheap() -> None:
    profile = expensive_small_cheap_large()
    plan, result = plan_with_result(profile, BUDGET, GB_PER_S)
    assert plan.decisions == {"t0": "offload"}
    assert result.feasible and result.peak_bytes <= 4_500_000
    assert result.retention == 1.0  # the copies hide entirely under compute
    assert plan.prefetch == {"t0": 5}  # issued as b1 starts: b0, A's last use, freed room
    only, rec = plan_with_result(profile, BUDGET, GB_PER_S, "recompute-only")
    assert only.decisions == {"t0": "recompute"} and rec.recompute_s == pytest.approx(5 * MS)
    ctx = PlanContext(profile, GB_PER_S, 4_500_000)
    assert retention_bound(ctx) == pytest.approx(1.0)


def test_keep_all_when_the_budget_allows() -> None:
    profile = expensive_small_cheap_large()
    plan, result = plan_with_result(profile, 1.0, GB_PER_S)
    assert set(plan.decisions.values()) == {"keep"} and result.retention == 1.0
    assert plan.budget_bytes == profile.keep_all_peak


def test_a_budget_slackswap_fits_is_not_called_out_of_every_plans_reach() -> None:
    """A baseline that cannot fit a budget (checkpoint-blocks, with no blocks) says so,
    and that SlackSwap fits it, rather than naming a floor a hybrid plan goes below."""
    profile = expensive_small_cheap_large()
    assert slackswap.plan(profile, 0.85, GB_PER_S).strategy == "slackswap"
    with pytest.raises(InputError, match="out of reach of 'checkpoint-blocks'; the "
                                         "'slackswap' strategy fits it"):
        slackswap.plan(profile, 0.85, GB_PER_S, strategy="checkpoint-blocks")


@pytest.mark.parametrize("seed", range(12))
def test_the_smallest_feasible_budget_is_one_plan_fits(seed: int) -> None:
    """The floor a refusal names is a budget ``plan`` fits (ops wait for offloads to land,
    so it is below the all-offload plan's peak with no limit), and nothing below a
    tenth of a percent under it is called feasible by the same uniform plans."""
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(2, 12))
    rate = rng.uniform(2e7, 5e8)
    hw = link_hardware(rate, rate, rate, rate * rng.uniform(0.3, 1), host=NO_HOST)
    floor = smallest_feasible_budget(profile, hw)
    fitted = slackswap.plan(profile, floor, hw)
    result = slackswap.simulate(profile, fitted, hw, floor)
    assert result.feasible and result.peak_bytes <= floor
    ctx = PlanContext(profile, hw, profile.keep_all_peak)
    below = floor - max(1, profile.keep_all_peak // 1000) - 1
    if below >= ctx.working_set:
        names = [c.name for c in ctx.candidates]
        for decision in ("recompute", "offload"):
            uniform = ctx.plan("all", {n: decision for n in names})
            assert not slackswap.simulate(profile, uniform, hw, below).feasible


@pytest.mark.parametrize("seed", range(16))
def test_never_worse_than_a_baseline_on_random_steps(seed: int) -> None:
    """On random steps, links and budgets, SlackSwap retains at least what every baseline
    does (the baselines' plans are among its starting points, NOTE [starting points])."""
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(3, 12))
    rate = rng.uniform(2e7, 5e8)
    hw = link_hardware(rate, rate, rate, rate * rng.uniform(0.3, 1), host=NO_HOST)
    ctx = PlanContext(profile, hw, int(rng.uniform(0.3, 0.9) * profile.keep_all_peak))
    if not ctx.reachable:
        return
    ours = ctx.attempt(STRATEGIES["slackswap"])
    for strategy, make in STRATEGIES.items():
        other = ctx.attempt(make)
        if other is not None and other[1].feasible:
            assert ours is not None and ours[1].feasible, strategy
            assert ours[1].retention >= other[1].retention - 1e-12, strategy


def test_a_cover_is_found_without_the_solver(monkeypatch) -> None:
    """Where HiGHS stops with no cover (its node limit), a greedy cover is used: a slow
    or limited solve never turns a coverable budget into a refusal."""
    cases = []
    for seed in range(30):
        rng = random.Random(seed)
        profile = random_step(rng, rng.randint(4, 12))
        ctx = PlanContext(profile, GB_PER_S, int(0.6 * profile.keep_all_peak))
        points = pressure_points(ctx, 0)
        if recompute.choose_recompute(ctx, ctx.candidates, points):
            cases.append((ctx, points))
    assert len(cases) >= 5

    class NoCover:
        x = None

    monkeypatch.setattr(recompute, "milp", lambda *a, **k: NoCover())
    for solved, points in cases:
        ctx = PlanContext(solved.profile, solved.hw, solved.budget)  # (covers are kept)
        greedy = recompute.choose_recompute(ctx, ctx.candidates, points)
        assert greedy
        by_name = {c.name: c for c in ctx.candidates}
        for pt in points:  # every point of pressure is covered
            freed = sum(by_name[n].bytes for n in greedy
                        if evicted_at(by_name[n], pt.op, ctx))
            assert freed >= pt.excess


def test_nested_rows_cost_what_dense_rows_cost() -> None:
    """The cover solved with running totals (NOTE [nested rows]) costs what the same
    program with one row per point and a column per candidate costs, and covers every
    point (checked with ``evicted_at``, the planners' own rule)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    solved = 0
    for seed in range(40):
        rng = random.Random(seed)
        profile = random_step(rng, rng.randint(4, 14))
        ctx = PlanContext(profile, GB_PER_S, int(rng.uniform(0.3, 0.9) * profile.keep_all_peak))
        points = pressure_points(ctx, 0)
        chosen = recompute.choose_recompute(ctx, ctx.candidates, points)
        cands = [c for c in ctx.candidates if c.name in profile.recomputable]
        dense = np.array([[c.bytes if evicted_at(c, pt.op, ctx) else 0 for c in cands]
                          for pt in points]).reshape(len(points), len(cands))
        need = np.array([pt.excess for pt in points])
        if chosen is None:
            assert not points or np.any(dense.sum(axis=1) < need)
            continue
        x = np.array([c.name in chosen for c in cands])
        assert np.all(dense @ x >= need)
        if not points:
            continue
        cost = np.array([recompute.rebuild_cost(ctx, c) for c in cands])
        best = milp(cost, constraints=LinearConstraint(dense, need, np.inf),
                    integrality=np.ones(len(cands)), bounds=Bounds(0, 1))
        assert cost @ x == pytest.approx(best.fun, rel=1e-3)
        solved += 1
    assert solved >= 10


def _chain_seconds(ctx: PlanContext, chosen: set[str], kept: set[str], shared: bool) -> float:
    """What rebuilding ``chosen`` re-runs, each op at the longer of its kernel and host
    time, reading ``kept`` checkpoints instead of re-running their producers: per
    activation, or each op once (``shared``). Written apart from the cover's columns."""
    p, issue = ctx.profile, ctx.hw.host.dispatch_s + ctx.hw.host.replay_s
    runs: list[int] = []
    for c in ctx.candidates:
        if c.name not in chosen:
            continue
        seen, stack = {c.producer}, [c.producer]
        while stack:
            op = stack.pop()
            runs.append(op)
            for tid in dict.fromkeys(p.ops[op].inputs):
                t = p.tensors[tid]
                if tid in p.never_saved and t.name not in kept and t.producer not in seen:
                    seen.add(t.producer)
                    stack.append(t.producer)
    return sum(max(p.ops[op].time_s, issue) for op in (set(runs) if shared else runs))


def _checkpoint_readers(ctx: PlanContext) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Each checkpoint a rebuild may read: the last first use of an activation whose
    chain reads it, and those activations."""
    p = ctx.profile
    last: dict[str, int] = {}
    readers: dict[str, set[str]] = {}
    for c in ctx.candidates:
        if c.name not in p.recomputable:
            continue
        stack = [c.producer]
        while stack:
            for tid in p.ops[stack.pop()].inputs:
                t = p.tensors[tid]
                if tid in p.never_saved:
                    if t.name in p.checkpointable and t.bytes >= 1024:
                        last[t.name] = max(last.get(t.name, 0), c.first_use)
                        readers.setdefault(t.name, set()).add(c.name)
                    stack.append(t.producer)
    return last, readers


def _covered(ctx: PlanContext, last: dict[str, int], chosen: set[str], kept: set[str]) -> bool:
    """Every point of pressure, densely: a recompute frees its bytes where ``evicted_at``
    says, a kept checkpoint holds its bytes past its last forward use and, in backward,
    before ``last``."""
    p, fb = ctx.profile, ctx.first_backward

    def held(name: str, op: int) -> bool:
        t = p.checkpointable[name]
        if op < fb:
            return op > max([t.producer, *(q for q in t.forward_consumers if q < fb)])
        return op < last[name]

    return all(sum(c.bytes for c in ctx.candidates
                   if c.name in chosen and evicted_at(c, pt.op, ctx))
               - sum(p.checkpointable[n].bytes for n in kept if held(n, pt.op))
               >= pt.excess for pt in pressure_points(ctx, 0))


def test_covers_with_checkpoints_cost_the_least_of_every_choice() -> None:
    """The cover with chain columns (NOTE [chain columns]) on block steps, whose rebuilds
    read never-saved tensors: against every set of recomputes and kept checkpoints, each
    row checked densely (``_covered``), it covers every row at the least re-run time,
    per activation and with each op paid once, and keeps no checkpoint that no
    recompute reads; keeping checkpoints is the best choice on some steps."""
    from itertools import combinations

    from stepgraphs import block_step

    checked = kept_some = 0
    for seed in range(200):
        rng = random.Random(seed)
        profile = block_step(rng, rng.randint(1, 2))
        hw = link_hardware(1e9, 1e9, 1e9, 1e9, 0.0, host=NO_HOST if seed % 2 else None)
        ctx = PlanContext(profile, hw, int(rng.uniform(0.3, 0.9) * profile.keep_all_peak))
        points = pressure_points(ctx, 0)
        cands = [c.name for c in ctx.candidates if c.name in profile.recomputable]
        last, readers = _checkpoint_readers(ctx)
        names = list(last)
        if not points or not names or len(cands) + len(names) > 12:
            continue
        choices = [(set(x), set(k)) for r in range(len(cands) + 1)
                   for x in combinations(cands, r)
                   for q in range(len(names) + 1) for k in combinations(names, q)]
        choices = [(x, k) for x, k in choices if _covered(ctx, last, x, k)]
        for shared in (False, True):
            cover = recompute.choose_cover(ctx, ctx.candidates, points, checkpoints=True,
                                           shared=shared)
            if not choices:
                assert cover is None
                continue
            best = min(_chain_seconds(ctx, x, k, shared) for x, k in choices)
            chosen = {n for n, d in cover.items() if d == "recompute"}
            kept = {n for n, d in cover.items() if d == "keep"}
            assert _covered(ctx, last, chosen, kept), seed
            assert all(readers[n] & chosen for n in kept), seed  # none kept for nothing
            assert _chain_seconds(ctx, chosen, kept, shared) <= best * (1 + 6e-3) + 1e-12, seed
            kept_some += bool(kept)
            checked += 1
    assert checked >= 20 and kept_some >= 2, (checked, kept_some)


def _rebuild_reads(ctx: PlanContext) -> dict[str, set[str]]:
    """Per candidate, the candidates its rebuild reads: its producer's inputs and those of
    every op its never-saved chain re-runs."""
    p, names = ctx.profile, {c.name for c in ctx.candidates}
    out = {}
    for c in ctx.candidates:
        ops, stack = {c.producer}, [c.producer]
        while stack:
            for tid in p.ops[stack.pop()].inputs:
                if tid in p.never_saved and p.tensors[tid].producer not in ops:
                    ops.add(p.tensors[tid].producer)
                    stack.append(p.tensors[tid].producer)
        out[c.name] = {p.tensors[t].name for q in ops for t in p.ops[q].inputs} & names - {c.name}
    return out


def _joint_cost(ctx: PlanContext, reads: dict[str, set[str]], x: set[str], o: set[str],
                depth: int) -> float | None:
    """What the joint cover (NOTE [joint cover]) prices recomputing ``x`` and offloading
    ``o`` at, in ms; None where a row is not covered or a rebuild pulls recomputes more
    than ``depth`` hops deep. Written apart from its program: each row checked densely,
    every path of pulls walked."""
    by, link, fb = {c.name: c for c in ctx.candidates}, ctx.hw.host_link, ctx.first_backward
    pulled: dict[str, int] = {}  # a pulled candidate -> the earliest first use pulling it

    def walk(root, path) -> bool:
        for j in reads[path[-1]]:
            if by[j].first_use <= by[root].first_use or j in path:
                continue
            if len(path) > depth:  # a (depth + 2)-th activation on the chain
                if j in x:
                    return False
                continue
            if j in x or j in o:
                pulled[j] = min(pulled.get(j, by[root].first_use), by[root].first_use)
            if j in x and not walk(root, (*path, j)):
                return False
        return True

    if not all(walk(root, (root,)) for root in x):
        return None

    def copy_ms(c, rate):
        return 1e3 * (link.latency_s + c.bytes / rate)

    def landed(c):
        at = c.produced_at + copy_ms(c, link.d2h_bandwidth) / 1e3
        return next((q for q in range(c.producer, fb) if ctx.op_start[q] >= at), fb)

    for pt in pressure_points(ctx, 0, every=True):
        op = pt.op
        freed = sum(by[n].bytes for n in x if evicted_at(by[n], op, ctx))
        freed += sum(by[n].bytes for n in o if (max(landed(by[n]), by[n].freed_op) < op
                                                if op < fb else by[n].first_use > op))
        if op >= fb:
            freed -= sum(by[j].bytes for j, at in pulled.items() if at <= op < by[j].first_use)
        if freed < pt.excess:
            return None
    d2h = sum(copy_ms(by[n], link.d2h_bandwidth) for n in o)
    h2d = sum(copy_ms(by[n], link.h2d_bandwidth) for n in o)
    return (1e3 * sum(recompute.rebuild_cost(ctx, by[n]) for n in x) + 1e-3 * h2d
            + max(0.0, d2h - 1e3 * ctx.forward_end)
            + max(0.0, h2d - 1e3 * (max(ctx.op_end) - ctx.forward_end)))


def test_the_joint_cover_costs_the_least_of_every_choice() -> None:
    """The joint cover (NOTE [joint cover]) on small random and block-shaped steps, each
    depth: against every recompute/offload assignment, each priced and checked apart
    (``_joint_cost``), its choice is covered at the least cost (within the solver's gap),
    and None only where no assignment is."""
    from itertools import product

    from stepgraphs import block_step

    from slackswap.planners.joint import choose_joint

    checked = 0
    for seed in range(240):
        rng = random.Random(seed)
        profile = (block_step(rng, rng.randint(1, 2)) if seed % 2
                   else random_step(rng, rng.randint(3, 8)))
        for t in profile.tensors:  # megabytes: HiGHS's tolerances are 100 bytes here
            t.bytes *= 1000
        rate = rng.uniform(2e10, 2e12)
        hw = link_hardware(rate, rate, rate, rate, 1e-6, host=NO_HOST)
        ctx = PlanContext(profile, hw, int(rng.uniform(0.3, 0.8) * profile.keep_all_peak))
        names = [c.name for c in ctx.candidates]
        if not pressure_points(ctx, 0) or not 2 <= len(names) <= 7:
            continue
        reads = _rebuild_reads(ctx)
        choices = [_sets(ch, names) for ch in product("kxo", repeat=len(names))]
        choices = [(x, o) for x, o in choices if not x - profile.recomputable]
        for depth in (1, 2, 3):
            costs = [c for x, o in choices
                     if (c := _joint_cost(ctx, reads, x, o, depth)) is not None]
            chosen = choose_joint(ctx, pressure_points(ctx, 0, every=True), depth)
            if not costs:
                assert chosen is None, (seed, depth)
                continue
            x = {n for n, d in chosen.items() if d == "recompute"}
            o = {n for n, d in chosen.items() if d == "offload"}
            cost = _joint_cost(ctx, reads, x, o, depth)
            assert cost is not None, (seed, depth)
            assert cost <= min(costs) * (1 + 6e-3) + 1e-9, (seed, depth)
            checked += 1
    assert checked >= 40, checked


def test_a_rebuild_pulls_what_it_reads_back_early() -> None:
    """A small head on a chain (a -> b -> c -> L, the loss's spike in backward): recomputing
    a and b is the cheapest cover when each rebuild is priced alone, yet b's rebuild, at
    b's first use, makes a again there too, long before a's own, and the step does not
    fit. The joint cover, which counts that pull (NOTE [joint cover]), offloads b
    instead; its plan fits, and SlackSwap's retains at least as much."""
    from slackswap.planners.joint import choose_joint

    mb = 1_000_000
    tensors = [T(mb, kind="input", saved=True),
               T(16 * mb, saved=True, first_backward_use=6),  # a
               T(16 * mb, saved=True, first_backward_use=5),  # b
               T(mb, saved=True, first_backward_use=4),  # c
               T(16 * mb, saved=True, first_backward_use=4),  # L
               T(16 * mb), T(mb), T(mb), T(mb)]  # gradients
    ops = [Op("forward", 1 * MS, [0], [1]), Op("forward", 1 * MS, [1], [2]),
           Op("forward", 0.1 * MS, [2], [3]), Op("forward", 1 * MS, [3], [4]),
           Op("backward", 1 * MS, [4, 3], [5]), Op("backward", 2 * MS, [5, 2], [6]),
           Op("backward", 2 * MS, [6, 1], [7]), Op("backward", 2 * MS, [7, 0], [8])]
    profile = build(ops, tensors)
    hw = link_hardware(2e9, 2e9, 2e9, 2e9, 1e-6, host=NO_HOST)
    ctx = PlanContext(profile, hw, int(0.7 * profile.keep_all_peak))
    alone = recompute.choose_cover(ctx, ctx.candidates, pressure_points(ctx, 0))
    assert alone == {"t1": "recompute", "t2": "recompute"}
    assert not ctx.simulate(ctx.plan("x", alone)).feasible
    for depth in (1, 2, 3):
        joint = choose_joint(ctx, pressure_points(ctx, 0, every=True), depth)
        assert joint == {"t1": "recompute", "t2": "offload"}
        fits = ctx.simulate(ctx.plan("x", joint))
        assert fits.feasible
    assert STRATEGIES["slackswap"](ctx)[1].retention >= fits.retention


def _sets(choice: tuple[str, ...], names: list[str]) -> tuple[set[str], set[str]]:
    """The recomputed ('x') and the offloaded ('o') names of a choice per name."""
    return ({n for n, d in zip(names, choice, strict=True) if d == "x"},
            {n for n, d in zip(names, choice, strict=True) if d == "o"})


def _covers(ctx: PlanContext, points, chosen) -> bool:
    """Every point's excess freed by the recomputes of ``chosen`` (``evicted_at``)."""
    return all(sum(c.bytes for c in chosen if evicted_at(c, pt.op, ctx)) >= pt.excess
               for pt in points)


def _watch_priced(ctx: PlanContext, chosen, behind: bool) -> float:
    """Seconds a cover with watch columns prices ``chosen`` at, written apart from it: its
    rebuilds, plus, for the segments holding an op they re-run, each one's watch beyond
    the GPU's keep-all lead at its first op (the keep-all start less the host's
    dispatches and packs by then) or, ``behind``, the most by which the host falls behind
    in forward: at any forward op c, the dispatches and packs up to c and the watch of
    every such segment ending by c, less c's keep-all start."""
    from slackswap.core.offloads import forward_packs as packs
    from slackswap.core.watched import forward_segments

    p, host = ctx.profile, ctx.hw.host
    fb = ctx.first_backward
    before = [b for _, b in packs(p)]
    ops: set[int] = set()
    for c in chosen:
        stack = [c.producer]
        ops.add(c.producer)
        while stack:
            for tid in p.ops[stack.pop()].inputs:
                if tid in p.never_saved and p.tensors[tid].producer not in ops:
                    ops.add(p.tensors[tid].producer)
                    stack.append(p.tensors[tid].producer)

    def issued(c: int) -> float:
        return (c + 1) * host.dispatch_s + host.pack_s * sum(b <= c for b in before)

    watched = [(start, end) for start, end in forward_segments(p)
               if any(start <= q < end for q in ops)]
    if not behind:
        late = sum(max(host.watch_s * (end - start) - max(ctx.op_start[start] - issued(start),
                                                            0.0), 0.0)
                   for start, end in watched)
    else:
        late = 0.0
        for c in range(fb):
            watches = sum(host.watch_s * (end - start) for start, end in watched
                          if min(end, fb) - 1 <= c)
            late = max(late, issued(c) + watches - ctx.op_start[c])
    return sum(recompute.rebuild_cost(ctx, c) for c in chosen) + late


@pytest.mark.parametrize("behind", [False, True], ids=["segments", "behind"])
def test_covers_that_price_watches_cost_the_least_of_every_choice(behind: bool) -> None:
    """Covers with watch columns (NOTE [watch columns]) on block steps with module
    segments and a host that watches: against every recompute set, each row checked
    densely and each set priced apart (its rebuilds, plus the watches of the segments
    they re-run an op in, each beyond the GPU's lead there or, ``behind``, as the most
    the host falls behind the GPU in forward), the cover is covered at the least cost.
    (Where pricing watches changes the plan: two bert-large-mlm layers at 60%, gated in
    ``tests/test_exact.py``, and a whole step whose forward waits on the host:
    ``test_a_host_bound_step_is_planned_with_its_watches``.)"""
    from itertools import combinations

    from stepgraphs import block_step, with_host

    checked = 0
    for seed in range(400):
        rng = random.Random(seed)
        profile = block_step(rng, rng.randint(1, 4))
        forward = sum(op.phase == "forward" for op in profile.ops)
        seg = random.Random(-seed)
        profile.module_events = sorted(seg.sample(range(1, forward + 1),
                                                  seg.randint(1, forward)))
        hw = with_host(link_hardware(1e9, 1e9, 1e9, 1e9, 0.0), dispatch_s=2e-6, pack_s=3e-5,
                       watch_s=rng.uniform(5e-5, 1e-3), replay_s=0.0, unpack_s=0.0)
        ctx = PlanContext(profile, hw, int(rng.uniform(0.3, 0.9) * profile.keep_all_peak))
        points = pressure_points(ctx, 0)
        cands = [c for c in ctx.candidates if c.name in profile.recomputable]
        if not points or not cands or len(cands) > 10:
            continue
        sets = [x for r in range(len(cands) + 1) for x in combinations(cands, r)
                if _covers(ctx, points, x)]
        cover = recompute.choose_cover(ctx, ctx.candidates, points,
                                       watches="behind" if behind else "segments")
        if not sets:
            assert cover is None, seed
            continue
        chosen = [c for c in cands if cover.get(c.name) == "recompute"]
        assert _covers(ctx, points, chosen), seed
        least = min(_watch_priced(ctx, x, behind) for x in sets)
        assert _watch_priced(ctx, chosen, behind) <= least * (1 + 6e-3) + 1e-12, seed
        checked += 1
    assert checked >= 20, checked


def test_a_cover_asked_again_is_the_cover_a_fresh_context_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``choose_cover`` keeps its answers on the context: every question (candidates,
    credit, checkpoints, chains, watch pricing), asked in turn on one context, is
    answered as a context that never saw another one answers it, and the answer handed
    out is the caller's to change. And no answer is handed out for a question that
    differs in anything but credit that leaves the rows the same (on these steps chains
    and watch pricing seldom change a cover, so the solver alone would not show it)."""
    from stepgraphs import block_step, with_host

    def contexts() -> Iterator[tuple[random.Random, PlanContext, list]]:
        for seed in range(30):
            rng = random.Random(seed)
            profile = block_step(rng, rng.randint(1, 3))
            forward = sum(op.phase == "forward" for op in profile.ops)
            profile.module_events = sorted(rng.sample(range(1, forward + 1),
                                                      rng.randint(1, forward)))
            hw = with_host(link_hardware(1e9, 1e9, 1e9, 1e9, 0.0), dispatch_s=2e-6,
                           pack_s=3e-5, watch_s=rng.uniform(5e-5, 1e-3), replay_s=0.0,
                           unpack_s=0.0)
            ctx = PlanContext(profile, hw, int(rng.uniform(0.3, 0.9) * profile.keep_all_peak))
            points = pressure_points(ctx, 0)
            if not points:
                continue
            questions = []
            for _ in range(2):  # each set of candidates and credit under every pricing
                cands = rng.sample(ctx.candidates, rng.randint(1, len(ctx.candidates)))
                credit = {pt.op: rng.choice([0, pt.excess // 2]) for pt in points}
                questions += [(cands, points, credit, checkpoints, shared, watches)
                              for checkpoints in (False, True) for shared in (False, True)
                              for watches in (None, "segments", "behind")]
            yield ctx, questions + questions

    asked = 0
    for ctx, questions in contexts():
        for question in questions:
            answer = recompute.choose_cover(ctx, *question)
            fresh = recompute.choose_cover(PlanContext(ctx.profile, ctx.hw, ctx.budget),
                                           *question)
            assert answer == fresh
            if answer:
                answer.clear()  # the caller's copy: the kept answer stays whole
            asked += 1
    assert asked >= 500, asked

    def labelled(ctx: PlanContext, candidates: list, rows: list, *flags: object) -> dict:
        return {"asked": (tuple(c.name for c in candidates),
                          tuple((pt.op, need) for pt, need in rows), *flags)}

    monkeypatch.setattr(recompute, "_cover", labelled)
    for ctx, questions in contexts():
        for cands, points, credit, *flags in questions:
            answer = recompute.choose_cover(ctx, cands, points, credit, *flags)
            if answer:
                names, rows, *asked_flags = answer["asked"]
                assert asked_flags == flags
                assert set(names) <= {c.name for c in cands}
                assert dict(rows) == {pt.op: pt.excess - credit.get(pt.op, 0)
                                      for pt in points if pt.op in dict(rows)}


def test_a_plan_simulated_again_is_answered_as_the_simulator_answers() -> None:
    """``PlanContext.simulate`` keeps what it simulated: a plan asked for again (the
    same decisions, prefetch points and strategy) gets the figures a fresh simulation
    gives, counted as a simulation all the same, without its timeline until
    ``with_run`` adds it; a plan that differs in any of the three is simulated anew."""
    checked = 0
    for seed, ctx in _random_contexts(80, 8):
        if not ctx.reachable:
            continue
        rng = random.Random(seed)
        names = [c.name for c in ctx.candidates]
        plans = []
        for _ in range(4):
            decisions = {n: rng.choice(["keep", "offload", "recompute"]) for n in names}
            moved = [n for n in names if decisions[n] == "offload"]  # (only these reload)
            plans.append(ctx.plan(rng.choice(["a", "b"]), decisions,
                                  {n: rng.randrange(len(ctx.profile.ops))
                                   for n in rng.sample(moved, rng.randint(0, len(moved)))}))
        plans += [p.model_copy(update=change) for p in plans  # each differing in one
                  for change in ({"strategy": "c"}, {"prefetch": {}})]
        for plan in plans + plans[::-1]:
            before = ctx.simulations
            answer = ctx.simulate(plan)
            fresh = slackswap.simulate(ctx.profile, plan, ctx.hw, ctx.budget)
            assert ctx.simulations == before + 1
            assert answer.model_dump() == fresh.model_dump()
            ran = ctx.with_run((plan, answer))[1]
            assert ran.model_dump() == fresh.model_dump()
            assert ran.run.timeline.end == fresh.run.timeline.end
            checked += 1
    assert checked >= 200, checked


def _random_contexts(seeds: int, most_ops: int) -> Iterator[tuple[int, PlanContext]]:
    """Random steps of 3 to ``most_ops`` forward ops on a link of random speed, at 30 to
    90% of their peaks: (seed, context)."""
    for seed in range(seeds):
        rng = random.Random(seed)
        profile = random_step(rng, rng.randint(3, most_ops))
        rate = rng.uniform(2e7, 5e8)
        hw = link_hardware(rate, rate, rate, rate * rng.uniform(0.3, 1), host=NO_HOST)
        yield seed, PlanContext(profile, hw, int(rng.choice([0.3, 0.5, 0.7, 0.9])
                                                 * profile.keep_all_peak))


@pytest.mark.heavy  # searches every assignment of many small steps (20 s on two loaded cores)
def test_the_best_assignment_on_small_steps() -> None:
    """On small random steps (3 to 7 planable activations, every budget from 30%), the
    plan retains within half a point of the best of all 3^n keep/offload/recompute
    assignments, each simulated (reload timing is the simulator's; an exact model that
    also chooses it is open work)."""
    checked = 0
    for seed, ctx in _random_contexts(120, 10):
        names = [c.name for c in ctx.candidates]
        if not ctx.reachable or not 3 <= len(names) <= 7:
            continue
        best = best_assignment(ctx)
        ours = STRATEGIES["slackswap"](ctx)
        retained = ours[1].retention if ours is not None and ours[1].feasible else 0.0
        assert retained >= best - 0.005, (seed, retained, best)
        checked += 1
    assert checked >= 15


def test_budget_below_every_plan_names_the_smallest() -> None:
    profile = expensive_small_cheap_large()
    with pytest.raises(InputError, match=r"smallest budget known to fit this profile is"):
        slackswap.plan(profile, 0.05, GB_PER_S)
    with pytest.raises(InputError, match="unknown strategy 'magic'; strategies: slackswap"):
        slackswap.plan(profile, 0.5, GB_PER_S, strategy="magic")
    with pytest.raises(InputError, match="must be positive"):
        slackswap.plan(profile, -0.5, GB_PER_S)
    with pytest.raises(InputError, match="not a byte count"):
        slackswap.plan(profile, "half", GB_PER_S)


@pytest.mark.parametrize("seed", range(25))
def test_no_strategy_beats_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(3, 14))
    for t in profile.tensors:  # above the planners' size floor
        t.bytes *= 100
    hw = link_hardware(rng.uniform(1e9, 3e10), rng.uniform(1e9, 3e10), 1e9, 1e9, 1e-6)
    budget = rng.uniform(0.3, 0.9)
    ctx = PlanContext(profile, hw, int(budget * profile.keep_all_peak))
    bound = retention_bound(ctx)
    for strategy in STRATEGIES:
        attempt = plan_with_result(profile, budget, hw, strategy)
        if attempt is not None and attempt[1].feasible:
            assert attempt[1].peak_bytes <= ctx.budget
            assert attempt[1].retention <= bound + 1e-9, strategy


@functools.cache
def reference(name: str) -> StepProfile:
    model, batch = build_model(name)
    return slackswap.profile(model, batch, name=name)


@pytest.mark.slow
# gpt2-xl and llama-7b are ``heavy`` (36 and 117 s of planning on two loaded cores)
@pytest.mark.parametrize("name", ["bert-large", *(pytest.param(n, marks=pytest.mark.heavy)
                                                  for n in ("gpt2-xl", "llama-7b"))])
def test_reference_workloads_at_half_budget(name: str) -> None:
    profile = reference(name)
    ctx = PlanContext(profile, slackswap.load_hardware("a100-80gb"),
                      int(0.5 * profile.keep_all_peak))
    ours = plan_in_context(ctx)[1]  # every strategy in one context, as ``reproduce``
    assert ours.feasible and ours.peak_bytes <= ctx.budget
    for strategy in STRATEGIES:
        attempt = plan_in_context(ctx, strategy)
        if attempt is not None and attempt[1].feasible:
            assert ours.retention >= attempt[1].retention, strategy
    bound = retention_bound(ctx)
    assert ours.retention <= bound + 1e-9
    if name == "llama-7b":  # on bert-large and gpt2-xl the gap (0.7-0.8 points) is
        # reported by ``reproduce``; the exact model of small steps (test_exact.py) is
        # the gate on the planner
        assert ours.retention >= bound - 0.005


def test_the_late_window_takes_a_copy_that_crosses_in_backward() -> None:
    """NOTE [late slack]: a 4 MB activation made 0.1 ms before forward ends cannot cross
    at 1 GB/s in forward, but can while the loss's 5 ms backward op runs, and come back
    long before the op 15 ms later that needs it; it frees memory there only once landed."""
    tensors = [T(1000), T(4_000_000, saved=True, first_backward_use=4), T(1000), T(1000),
               T(1000)]
    ops = [Op("forward", 5 * MS, [], [0]), Op("forward", 0.1 * MS, [0], [1]),
           Op("backward", 5 * MS, [], [2]), Op("backward", 10 * MS, [2], [3]),
           Op("backward", 2 * MS, [1, 3], [4])]
    ctx = PlanContext(build(ops, tensors), GB_PER_S, 2_000_000)
    [c] = ctx.candidates
    assert slack.offload_within_slack(ctx, [c]) == []
    assert slack.offload_within_slack(ctx, [c], late=True) == [c]
    assert slack.d2h_landing(ctx, [c], late=True) == {c.name: pytest.approx(9.1 * MS)}
    assert slack.eviction_credit(ctx, [c], [2, 3], late=True) == {2: 0, 3: 4_000_000}
    # the reload waits for the copy out: at 0.35 GB/s it lands after backward needs it
    slow = PlanContext(ctx.profile, link_hardware(1e9, 0.35e9, 1e9, 0.35e9, 0.0,
                                                  host=NO_HOST), 2_000_000)
    assert slack.offload_within_slack(slow, slow.candidates, late=True) == []


@pytest.mark.parametrize("seed", range(40))
def test_the_late_window_agrees_where_every_copy_lands_in_forward(seed: int) -> None:
    """Every offload set the forward window takes, the late one takes too, and credits
    with the same bytes at every op: the two differ only where a copy lands in backward."""
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(3, 12))
    rate = rng.uniform(1e8, 5e9)
    ctx = PlanContext(profile, link_hardware(rate, rate, rate, rate, 0.0, host=NO_HOST),
                      int(0.5 * profile.keep_all_peak))
    order = rng.sample(ctx.candidates, len(ctx.candidates))
    chosen = slack.offload_within_slack(ctx, order)
    landed = slack.d2h_landing(ctx, chosen, late=True)
    assert landed == slack.d2h_landing(ctx, chosen)
    assert slack.reloads_in_time(ctx, chosen, landed)
    ops = list(range(len(profile.ops)))
    assert slack.eviction_credit(ctx, chosen, ops, late=True) == slack.eviction_credit(
        ctx, chosen, ops)
    late = slack.offload_within_slack(ctx, order, late=True)
    assert set(slack.d2h_landing(ctx, late, late=True)) == {c.name for c in late}
    assert slack.reloads_in_time(ctx, late, slack.d2h_landing(ctx, late, late=True))


@pytest.mark.slow
@pytest.mark.heavy  # a whole full-size step planned (28-34 s on two loaded cores)
def test_peak_never_rises_as_the_budget_falls() -> None:
    profile = reference("gpt2-xl")
    peaks = [plan_with_result(profile, b / 10)[1].peak_bytes for b in range(10, 1, -2)]
    assert peaks == sorted(peaks, reverse=True)


@pytest.mark.full
@pytest.mark.parametrize("preset", [p for p in slackswap.hardware_presets()
                                    if not p.startswith("dgx")])
def test_never_worse_than_a_baseline_on_every_preset(preset: str) -> None:
    """The sweep of ``benchmarks/baseline_sweep.py`` (every workload and budget there)
    for bert-large at three budgets: no baseline retains more than SlackSwap, and
    SlackSwap no more than the bound."""
    hw = slackswap.load_hardware(preset)
    profile = cached_profile("bert-large", hw)
    for fraction in (0.3, 0.5, 0.7):
        ctx = PlanContext(profile, hw, int(fraction * profile.keep_all_peak))
        ours = ctx.attempt(STRATEGIES["slackswap"])
        assert ours[1].retention <= retention_bound(ctx) + 1e-9, fraction
        for strategy, make in STRATEGIES.items():
            other = ctx.attempt(make)
            if other is not None and other[1].feasible:
                assert ours[1].retention >= other[1].retention, (fraction, strategy)


@pytest.mark.slow
@pytest.mark.heavy  # a whole full-size step planned (28-34 s on two loaded cores)
def test_a_host_bound_step_is_planned_with_its_watches() -> None:
    """gpt2-xl at 50% on h100-sxm, a whole step (a search budget of the minimum): the
    plan made with the host's costs unpriced waits on the host (its packs and the
    watches of the segments it recomputes in outrun the GPU in forward), so the planner
    runs again with them priced (NOTE [watch columns]) and keeps the better plan, which
    waits less on the host and retains more."""
    from slackswap.planners import slackswap as planner

    hw = slackswap.load_hardware("h100-sxm")
    profile = cached_profile("gpt2-xl", hw)
    ctx = PlanContext(profile, hw, int(0.5 * profile.keep_all_peak))
    assert planner._search_budget(ctx) == planner.SEARCH_SIMULATIONS  # not a short step
    unpriced = planner._pipeline(ctx)[1]
    assert planner._host_bound((None, unpriced))
    ours = ctx.attempt(STRATEGIES["slackswap"])[1]
    assert ours.feasible and ours.peak_bytes <= ctx.budget
    assert ours.stall_s["host"] < unpriced.stall_s["host"]
    assert ours.retention >= unpriced.retention + 0.005
    assert ours.retention <= retention_bound(ctx) + 1e-9


@pytest.mark.slow
@pytest.mark.heavy  # a whole full-size step planned (28-34 s on two loaded cores)
def test_a_whole_workload_stops_spending_less_slack_past_the_best(monkeypatch) -> None:
    """bert-large at 30% on a100-80gb (420 candidates): in each run the slack fractions
    are tried until one's plan rates below the best so far, where all five are tried on
    a step of fewer candidates; the plan is the one made trying all five (NOTE
    [slack])."""
    from slackswap.planners import slackswap as planner

    hw = slackswap.load_hardware("a100-80gb")
    profile = reference("bert-large")
    tried: dict[str | None, list[float]] = {}
    hybrid = planner._hybrid

    def spy(ctx, offload, checkpoints=False, shared=False, watches=None, late=False):
        attempt = hybrid(ctx, offload, checkpoints, shared, watches, late)
        if not (checkpoints or shared or late):  # the fractions' own covers come first
            tried.setdefault(watches, []).append(attempt[1].retention if attempt else 0.0)
        return attempt

    def plan() -> float:
        ctx = PlanContext(profile, hw, int(0.3 * profile.keep_all_peak))
        return ctx.attempt(STRATEGIES["slackswap"])[1].retention

    assert not PlanContext(profile, hw, 1).short_step

    monkeypatch.setattr(planner, "_hybrid", spy)
    ours = plan()
    n = len(planner.SLACK_FRACTIONS)
    for got in tried.values():  # the first below the best before it is the last tried
        assert all(got[i] >= max(got[:i]) for i in range(1, len(got) - 1))
        assert len(got) == n or got[-1] < max(got[:-1])
    assert any(len(got) < n for got in tried.values())
    monkeypatch.setattr(planner, "_stops_past_best", lambda ctx: False)
    tried.clear()
    assert plan() == ours
    assert all(len(got) == n for got in tried.values())


@pytest.mark.slow
@pytest.mark.heavy  # every strategy over budgets (14 s on two loaded cores)
def test_never_worse_than_a_baseline_across_budgets() -> None:
    """bert-large on a100-80gb at 20-80% in steps of 20 (30, 50 and 70% on every preset:
    ``test_never_worse_than_a_baseline_on_every_preset``, ``-m full``)."""
    profile = reference("bert-large")
    hw = slackswap.load_hardware("a100-80gb")
    for tenths in (2, 4, 6, 8):
        ctx = PlanContext(profile, hw, int(tenths / 10 * profile.keep_all_peak))
        ours = ctx.attempt(STRATEGIES["slackswap"])
        for strategy, make in STRATEGIES.items():
            attempt = ctx.attempt(make)
            if attempt is not None and attempt[1].feasible:
                assert ours[1].retention >= attempt[1].retention, (tenths, strategy)


@pytest.mark.heavy  # plans every strategy (9 s on two loaded cores)
def test_planning_writes_nothing_to_stdout(capfd) -> None:
    """HiGHS prints a stray debug line from C++ on some MIP solves (NOTE [solver output]
    in planners/quiet.py), as it does planning one bert-large-mlm layer at 50% on
    h100-sxm: stdout, where the CLI writes JSON, stays empty."""
    from slackswap.models.presets import with_layers

    hw = slackswap.load_hardware("h100-sxm")
    profile = cached_profile(with_layers("bert-large-mlm", 1), hw)
    capfd.readouterr()
    ctx = PlanContext(profile, hw, int(0.5 * profile.keep_all_peak))
    assert ctx.attempt(STRATEGIES["slackswap"])[1].feasible
    assert capfd.readouterr().out == ""


def test_the_perturbed_search_finds_the_best_assignment_and_never_loses() -> None:
    """NOTE [perturbed search] on small random steps, from keep-all: never worse than its
    start, the same plan again with the same seed, and, given ten times as many plans to
    score as there are assignments, the best of every keep/offload/recompute
    assignment."""
    from slackswap.planners.perturb import perturbed_search

    checked = 0
    for seed, ctx in _random_contexts(60, 8):
        n = len(ctx.candidates)
        if not ctx.reachable or not 3 <= n <= 6 or ctx.profile.checkpointable:
            continue
        keep = ctx.plan("keep-all", {})
        start = (keep, ctx.simulate(keep))
        found = perturbed_search(ctx, start, 10 * 3 ** n, seed)
        again = perturbed_search(ctx, start, 10 * 3 ** n, seed)
        assert found[0].decisions == again[0].decisions
        assert not scores_better(score(start[1]), score(found[1]))
        best = best_assignment(ctx)
        assert (found[1].retention if found[1].feasible else 0.0) == pytest.approx(best), seed
        checked += 1
    assert checked >= 10


# SlackSwap's plan for two bert-large-mlm layers at 50% on h100-sxm before recompute
# releases (75.70%): the rest of the step's tensors kept, its checkpoints rebuilt
BEFORE_RELEASES = {
    "bert.embeddings.LayerNorm:native_layer_norm:1": "offload",
    "bert.embeddings.LayerNorm:native_layer_norm:2": "offload",
    "bert.embeddings.dropout:native_dropout:0": "offload",
    "bert.embeddings.dropout:native_dropout:1": "offload",
    "bert.embeddings:add:1": "offload",
    "bert.embeddings:gather:0": "offload",
    "bert.encoder.layer.0.attention.output.LayerNorm:native_layer_norm:0": "recompute",
    "bert.encoder.layer.0.attention.self.key:addmm:0": "offload",
    "bert.encoder.layer.0.attention.self.query:addmm:0": "offload",
    "bert.encoder.layer.0.attention.self.value:addmm:0": "offload",
    "bert.encoder.layer.0.attention.self:attention:1": "offload",
    "bert.encoder.layer.0.intermediate.dense:addmm:0": "recompute",
    "bert.encoder.layer.0.intermediate.intermediate_act_fn:gelu:0": "recompute",
    "bert.encoder.layer.0.output.LayerNorm:native_layer_norm:0": "recompute",
    "bert.encoder.layer.1.attention.output.LayerNorm:native_layer_norm:0": "recompute",
    "bert.encoder.layer.1.attention.self.query:addmm:0": "recompute",
    "bert.encoder.layer.1.intermediate.dense:addmm:0": "recompute",
    "bert.encoder.layer.1.intermediate.intermediate_act_fn:gelu:0": "recompute",
}


@pytest.mark.slow
def test_a_recompute_released_by_offloads_that_alone_change_nothing() -> None:
    """Two bert-large-mlm layers at 50% on h100-sxm, where the host sets the pace: from
    the plan the planner's earlier stages end at (75.70%), recompute releases (NOTE
    [starting points]) keep layer 1's query projection and offload two of the tensors
    whose offload alone changes nothing to make room (a dropout mask and the MLM head's
    GELU output): 76.02%. The planner as a whole, its perturbed search last, reaches 76.43
    there (``benchmarks/best_known.py --hardware h100-sxm --budgets 0.5``)."""
    from slackswap.models.presets import with_layers
    from slackswap.planners.slackswap import _recompute_releases, _search_budget

    hw = slackswap.load_hardware("h100-sxm")
    profile = cached_profile(with_layers("bert-large-mlm", 2), hw)
    ctx = PlanContext(profile, hw, int(0.5 * profile.keep_all_peak))
    plan = ctx.plan("slackswap", BEFORE_RELEASES)
    start = (plan, ctx.simulate(plan))
    assert start[1].retention == pytest.approx(0.7570, abs=5e-5)
    for name in ("bert.encoder.layer.1.output.dropout:native_dropout:1",
                 "cls.predictions.transform.transform_act_fn:gelu:0"):  # each alone
        alone = ctx.simulate(ctx.plan("slackswap", {**BEFORE_RELEASES, name: "offload"}))
        assert alone.retention == pytest.approx(start[1].retention, abs=1e-12)
    found, result = _recompute_releases(ctx, start, _search_budget(ctx))
    assert result.retention >= 0.7600
    assert found.decisions.get("bert.encoder.layer.1.attention.self.query:addmm:0",
                               "keep") == "keep"



def _too_small_to_move() -> StepProfile:
    """Three Linear(16, 16) layers with tanh on a batch of 8: every saved activation is
    512 bytes, under MIN_PLANNED_BYTES."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(16, 16),
                                                                 torch.nn.Tanh())])
    return slackswap.profile(model, torch.randn(8, 16), mode="traced",
                             loss_fn=lambda out: out.square().mean())


@pytest.mark.parametrize("strategy", sorted(slackswap.STRATEGIES))
def test_a_step_with_nothing_to_move_is_refused_under_its_peak(strategy: str) -> None:
    """No candidate at all (a tiny model: every activation under 1 KiB): a budget under
    the keep-all peak is refused as out of reach, in one line, never a crash of the
    planner (SlackSwap's joint cover once built its program from empty float arrays);
    the peak itself is planned, keeping everything."""
    profile = _too_small_to_move()
    assert not PlanContext(profile, slackswap.load_hardware(profile.hardware),
                           profile.keep_all_peak).candidates
    with pytest.raises(InputError, match="fits no plan"):
        slackswap.plan(profile, 0.7, strategy=strategy)
    plan = slackswap.plan(profile, 1.0, strategy=strategy)
    assert set(plan.decisions.values()) <= {"keep"}
