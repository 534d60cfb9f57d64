"""The step simulator: invariants on random graphs, a SimPy reference, hand-computed cases."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simpy_reference import reference_run
from stepgraphs import (
    GPU_ONLY,
    NO_HOST,
    Op,
    T,
    build,
    link_hardware,
    random_plan,
    random_step,
)

from slackswap.core.hardware import load_hardware, with_overrides
from slackswap.core.plan import Plan
from slackswap.errors import InputError
from slackswap.runtime.checks import checkpoint_releases
from slackswap.sim import simulate
from slackswap.sim.outputs import chrome_trace, write_memory_plot, write_trace
from slackswap.sim.schedule import build_schedule
from slackswap.sim.simulate import offload_frees

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
# the reference preset, read once: a random case overrides its link and host costs (reading
# the file for each case took longer than simulating it)
PRESET = load_hardware("a100-80gb")
LINK = [f"host_link.{k}" for k in ("d2h_bandwidth", "h2d_bandwidth", "duplex_d2h_bandwidth",
                                   "duplex_h2d_bandwidth", "latency_s")]


def _case(seed: int, with_limit: bool):
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(1, 14))
    plan = random_plan(rng, profile)
    d2h, h2d = rng.uniform(2e7, 5e8), rng.uniform(2e7, 5e8)
    link = (d2h, h2d, d2h * rng.uniform(0.3, 1), h2d * rng.uniform(0.3, 1),
            rng.choice([0.0, 1e-6, 2e-5]))
    limit = None
    if with_limit:  # from the working set, below which simulate refuses, to above the peak
        limit = int(rng.uniform(profile.working_set[0], 1.1 * profile.keep_all_peak))
    # no host, the preset's, or one that costs as much as the kernels (host-bound steps)
    host = rng.choice([NO_HOST, None, {k: rng.choice([0.0, rng.uniform(0, 5e-4)])
                                       for k in NO_HOST}])
    figures = dict(zip(LINK, link, strict=True)) | {f"host.{k}": v for k, v in (host or {}).items()}
    return profile, plan, load_hardware(PRESET, figures), limit


def independent_keep_all_peak(profile) -> int:
    """Brute force: at every op, the bytes of activations produced by then and used later."""
    last = {}
    for t in profile.tensors:
        if t.kind == "activation":
            uses = [t.producer, *t.forward_consumers, *t.backward_consumers]
            uses += [t.first_backward_use] if t.first_backward_use is not None else []
            last[t.id] = max(uses)
    return max(
        sum(profile.tensors[tid].bytes for tid, end in last.items()
            if profile.tensors[tid].producer <= op.index <= end)
        for op in profile.ops
    )


# -- invariants ------------------------------------------------------------------------


@SETTINGS
@given(seed=st.integers(0, 10**9), with_limit=st.booleans())
def test_invariants(seed: int, with_limit: bool) -> None:
    profile, plan, hw, limit = _case(seed, with_limit)
    result = simulate(profile, plan, hw, limit)
    run = result.run
    sched, tl = run.schedule, run.timeline
    # memory never negative, never above the limit
    assert all(used >= 0 for _, used in tl.memory)
    if limit is not None:
        assert result.peak_bytes <= limit
    # every reload is made for the item that waits for it first, which reads it
    for h, copy in enumerate(sched.h2d):
        item = sched.items[copy.need_item]
        assert copy.residency in item.reads and h in item.needs
    # no op starts before every input it reads is resident, nor after it is freed (a
    # blocked run too: its last readers may not have run)
    h2d_end = {s.index: s.end for s in tl.spans if s.stream == "h2d"}
    reload_of = {c.residency: h for h, c in enumerate(sched.h2d)}
    for span in tl.spans:
        if span.stream != "compute":
            continue
        for rid in sched.items[span.index].reads:
            assert tl.alloc_time[rid] <= span.start
            assert tl.free_time.get(rid, math.inf) >= span.end
            if rid in reload_of:
                assert h2d_end[reload_of[rid]] <= span.start
    if not result.feasible:
        assert "short by" in result.infeasible_reason
        return
    assert tl.memory[-1][1] == 0  # everything is freed by the end
    # every offloaded activation is back before its first backward use
    start_of_op = {sched.items[s.index].op: s.start for s in tl.spans
                   if s.stream == "compute" and not sched.items[s.index].recompute
                   and profile.ops[sched.items[s.index].op].phase == "backward"}
    for h, copy in enumerate(sched.h2d):
        use = profile.tensors[copy.tensor].first_backward_use
        assert h2d_end[h] <= start_of_op[use]
    # nothing starts before the host has issued it
    host = run.host
    if host is not None:
        for span in tl.spans:
            ready = {"compute": host.issued, "d2h": host.d2h_ready, "h2d": host.h2d_ready}
            assert span.start >= ready[span.stream][span.index]
        assert result.busy_fraction["host"] <= 1 + 1e-12
    else:
        assert result.stall_s["host"] == 0.0
    # the step takes at least its compute time, which is at least the kernels of keep-all;
    # and at least the ideal (keep-all as eager PyTorch runs it)
    compute = sum(item.duration for item in sched.items)
    assert result.step_time_s >= compute * (1 - 1e-12)
    assert compute >= sched.ideal_time * (1 - 1e-12)
    assert 0 < result.retention <= 1 + 1e-12
    # idle compute stream, by cause, is the step less the compute
    idle = result.stall_s["reload"] + result.stall_s["memory"] + result.stall_s["host"]
    assert idle == pytest.approx(result.step_time_s - compute, rel=1e-9, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**9))
def test_keep_all_is_the_sum_of_op_times_and_the_analytic_peak(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(1, 14))
    result = simulate(profile, None, GPU_ONLY)
    assert result.step_time_s == sum(op.time_s for op in profile.ops)
    assert result.retention == 1.0
    assert result.peak_bytes == independent_keep_all_peak(profile) == profile.keep_all_peak
    assert result.stall_s == {"reload": 0.0, "memory": 0.0, "host": 0.0, "recompute": 0.0}
    # with eager dispatch: each op starts once issued (the host never waits), and the
    # ideal is that step, so keep-all retains everything
    eager = simulate(profile)
    dispatch, issued, end = load_hardware("a100-80gb").host.dispatch_s, 0.0, 0.0
    for op in profile.ops:
        issued += dispatch
        end = max(end, issued) + op.time_s
    assert eager.step_time_s == end == eager.ideal_step_time_s
    assert eager.retention == 1.0 and eager.peak_bytes == result.peak_bytes
    assert eager.stall_s["host"] == pytest.approx(end - sum(op.time_s for op in profile.ops),
                                                  rel=1e-9, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**9))
def test_free_link_offload_equals_keep_all(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(1, 14))
    plan = random_plan(rng, profile, kinds=("keep", "offload"))
    free = link_hardware(math.inf, math.inf, math.inf, math.inf, 0.0, host=NO_HOST)
    result = simulate(profile, plan, free)
    assert result.step_time_s == sum(op.time_s for op in profile.ops)
    # a reload stays a little past its last use, as the runtime holds it (NOTE [rebuild
    # groups] in schedule.py): never more than the reloads on top of keep-all
    reloaded = sum(c.bytes for c in result.run.schedule.h2d)
    assert result.peak_bytes <= profile.keep_all_peak + reloaded


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**9), with_limit=st.booleans())
def test_deterministic(seed: int, with_limit: bool) -> None:
    profile, plan, hw, limit = _case(seed, with_limit)
    first = simulate(profile, plan, hw, limit)
    second = simulate(profile, plan, hw, limit)
    assert first.model_dump_json() == second.model_dump_json()
    assert json.dumps(chrome_trace(first)) == json.dumps(chrome_trace(second))


# -- an independent SimPy model agrees -------------------------------------------------


SIMPY_SEEDS = range(300)  # odd seeds draw a memory limit


@pytest.fixture(scope="module")
def limited_runs():
    """Whether each limited SimPy case ran to the end. The limits are drawn where simulate
    accepts them (no case is refused), and most runs under them finish: checked once every
    limited case has run."""
    finished: dict[int, bool] = {}
    yield finished
    if len(finished) == len(SIMPY_SEEDS) // 2:
        assert sum(finished.values()) >= 0.6 * len(finished), finished


@pytest.mark.parametrize("seed", SIMPY_SEEDS)
def test_agrees_with_simpy_reference(seed: int, limited_runs: dict[int, bool]) -> None:
    profile, plan, hw, limit = _case(seed, with_limit=seed % 2 == 1)
    result = simulate(profile, plan, hw, limit)
    if limit is not None:
        limited_runs[seed] = result.feasible
    starts: dict = {}
    step, peak = reference_run(result.run.schedule, hw.host_link,
                               math.inf if limit is None else limit, result.run.host, starts)
    if result.feasible:
        assert result.step_time_s == pytest.approx(step, rel=1e-9, abs=1e-15)
    else:  # both stop at the same point: the same spans started, the same peak
        assert step == math.inf
    assert result.peak_bytes == peak
    engine = {(s.stream, s.index): s.start for s in result.run.timeline.spans}
    assert engine == pytest.approx(starts, rel=1e-9, abs=1e-15)


# -- hand-computed cases ---------------------------------------------------------------


def _chain(f1_time: float, b_bytes: int | None = None):
    """f0 -> A (offloaded), f1 -> B; backward: b0 reads A (and b1 reads B)."""
    ms = 1e-3
    tensors = [T(1_000_000, saved=True, first_backward_use=2)]
    ops = [Op("forward", 1 * ms, [], [0])]
    if b_bytes is None:
        ops += [Op("forward", f1_time, [0], [1]), Op("backward", 1 * ms, [0], [2])]
        tensors += [T(1000), T(1000)]
    else:
        tensors += [T(b_bytes, saved=True, first_backward_use=3), T(1000), T(1000)]
        ops += [Op("forward", f1_time, [0], [1]), Op("backward", 1 * ms, [0], [2]),
                Op("backward", 1 * ms, [1, 2], [3])]
    return build(ops, tensors)


def test_offload_longer_than_the_compute_it_hides_under() -> None:
    """A takes 2 ms each way and only 1 ms of forward hides the offload: 3 ms of stall."""
    profile = _chain(1e-3)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t0": "offload"})
    hw = link_hardware(0.5e9, 0.5e9, 0.5e9, 0.5e9, 0.0, host=NO_HOST)
    r = simulate(profile, plan, hw)
    # f0 0-1, D2H 1-3, f1 1-2, reload 3-5 (after the offload lands), b0 5-6
    assert r.step_time_s == pytest.approx(6e-3, rel=1e-12)
    assert r.stall_s["reload"] == pytest.approx(3e-3, rel=1e-12)
    assert r.ideal_step_time_s == pytest.approx(3e-3, rel=1e-12)
    assert r.retention == pytest.approx(0.5, rel=1e-12)
    assert r.d2h_bytes == r.h2d_bytes == 1_000_000


def test_duplex_sharing_slows_a_reload() -> None:
    """A's reload overlaps B's offload: both share the link until B lands at 7 ms."""
    profile = _chain(3e-3, b_bytes=1_200_000)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t0": "offload", "t1": "offload"})
    hw = link_hardware(0.5e9, 0.5e9, 0.4e9, 0.2e9, 0.0, host=NO_HOST)
    r = simulate(profile, plan, hw)
    spans = {(s.stream, s.index): (s.start, s.end) for s in r.run.timeline.spans}
    # D2H A 1-3; f1 1-4; D2H B 4-7 at 0.4 GB/s; reload A from 4: 0.6 MB by 7 at 0.2 GB/s,
    # the last 0.4 MB alone at 0.5 GB/s: done at 7.8 instead of 6.0 without sharing
    assert spans["d2h", 1] == pytest.approx((4e-3, 7e-3), rel=1e-12)
    assert spans["h2d", 0] == pytest.approx((4e-3, 7.8e-3), rel=1e-12)
    # b0 7.8-8.8; reload B 7.8-10.2 at full rate; b1 10.2-11.2
    assert spans["h2d", 1] == pytest.approx((7.8e-3, 10.2e-3), rel=1e-12)
    assert r.step_time_s == pytest.approx(11.2e-3, rel=1e-12)


def test_recompute_chain_rebuilds_dropped_inputs_first() -> None:
    """t1 = f(t0), t2 = g(t1); only t2 is saved and recomputed, t1 was never saved."""
    ms = 1e-3
    tensors = [T(1100, saved=True, first_backward_use=3), T(1200), T(1300, saved=True,
               first_backward_use=3), T(10), T(10)]  # planned ones at least 1 KiB
    ops = [Op("forward", 1 * ms, [], [0]), Op("forward", 2 * ms, [0], [1]),
           Op("forward", 4 * ms, [1], [2]), Op("backward", 1 * ms, [0, 2], [3])]
    profile = build(ops, tensors)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t2": "recompute"})
    r = simulate(profile, plan, GPU_ONLY)
    items = [(i.op, i.recompute) for i in r.run.schedule.items]
    assert items == [(0, False), (1, False), (2, False), (1, True), (2, True), (3, False)]
    assert r.recompute_s == pytest.approx(6 * ms)
    assert r.step_time_s == pytest.approx(14 * ms)


def test_a_rebuild_group_lasts_until_backward_unpacks_for_another_op() -> None:
    """The runtime's rebuild group (NOTE [rebuild groups]): max pooling's indices I are
    rebuilt for its backward (op 6) by re-running the pool, which makes its output P again
    too; P's first copy went at op 5, its last use. Both stay through op 7, which reads A,
    a tensor first needed at op 6 as well, and go before op 8 unpacks X."""
    kib = 1024
    tensors = [T(4 * kib, kind="input"), T(8 * kib, saved=True, first_backward_use=6),
               T(2 * kib, saved=True, first_backward_use=5), T(4 * kib, saved=True,
               first_backward_use=6), T(2 * kib), T(8 * kib, saved=True, first_backward_use=8),
               T(10), T(2 * kib), T(8 * kib), T(8 * kib), T(4 * kib)]
    ops = [Op("forward", 1e-3, [0], [1]),  # A
           Op("forward", 1e-3, [1], [2, 3]),  # pool(A) -> P, I
           Op("forward", 1e-3, [2], [4]),  # g(P), saves P
           Op("forward", 1e-3, [0], [5]),  # X
           Op("backward", 1e-3, [], [6]),
           Op("backward", 1e-3, [6, 2], [7]),  # g's backward: P's last use
           Op("backward", 1e-3, [7, 3, 1], [8]),  # pool's backward: I and A
           Op("backward", 1e-3, [8, 1], [9]),  # relu's backward: A again
           Op("backward", 1e-3, [9, 5], [10])]  # X: another op's tensor
    profile = build(ops, tensors)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t3": "recompute"})
    run = simulate(profile, plan).run
    sched = run.schedule
    items = [(i.op, i.recompute) for i in sched.items]
    assert items == [(0, False), (1, False), (2, False), (3, False), (4, False), (5, False),
                     (1, True), (6, False), (7, False), (8, False)]
    made = {sched.residencies[r].tensor: r for r in sched.items[6].allocs}
    assert set(made) == {2, 3}  # P made anew (not its first copy kept on), and I
    freed = {r: k for k, item in enumerate(sched.items) for r in item.frees}
    assert freed[made[2]] == freed[made[3]] == 8  # after op 7, before op 8's unpack
    first_p = next(r for r in sched.items[1].allocs if sched.residencies[r].tensor == 2)
    assert freed[first_p] == 5


def test_a_tensor_joins_the_group_where_it_is_last_unpacked() -> None:
    """A batched matmul's backward unpacks Q and K (op 7), reads Q in its first matmul
    and K in its second (op 8); autograd lets go of Q after op 8 (``released_after``,
    NOTE [held until let go]). Reloaded, both join the runtime's group when unpacked and
    stay until op 10 unpacks Y, a tensor first needed by another op: Q too, though
    autograd let go of it two ops before (NOTE [rebuild groups])."""
    kib = 1024
    tensors = [T(4 * kib, kind="input"), T(8 * kib, saved=True, first_backward_use=7),
               T(8 * kib, saved=True, first_backward_use=7), T(4 * kib),
               T(8 * kib, saved=True, first_backward_use=6),
               T(8 * kib, saved=True, first_backward_use=10), T(10), T(4 * kib),
               T(8 * kib), T(8 * kib), T(4 * kib), T(4 * kib)]
    ops = [Op("forward", 1e-3, [0], [1]),  # Q
           Op("forward", 1e-3, [0], [2]),  # K
           Op("forward", 1e-3, [1, 2], [3]),  # bmm(Q, K)
           Op("forward", 1e-3, [3], [4]),  # X
           Op("forward", 1e-3, [0], [5]),  # Y
           Op("backward", 1e-3, [], [6]),
           Op("backward", 1e-3, [6, 4], [7]),  # X
           Op("backward", 1e-3, [7, 1], [8]),  # the bmm's backward, first matmul: Q
           Op("backward", 1e-3, [7, 2], [9]),  # ... second matmul: K
           Op("backward", 1e-3, [9], [10]),
           Op("backward", 1e-3, [10, 5], [11])]  # Y: another op's tensor
    profile = build(ops, tensors)
    profile.tensors[1].released_after = 8
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t1": "offload", "t2": "offload"})
    sched = simulate(profile, plan, GPU_ONLY).run.schedule
    assert [i.op for i in sched.items] == list(range(11))
    freed = {sched.residencies[r].tensor: k for k, item in enumerate(sched.items)
             for r in item.frees if sched.residencies[r].source == "reload"}
    assert freed == {1: 9, 2: 9}  # after op 9, before op 10's unpack


def test_a_checkpoint_a_rebuild_reads_is_held_with_the_group() -> None:
    """C, kept as a checkpoint, is read by the rebuild of R for op 6; A, first needed at
    op 6 too, is read again at op 7, so the group lasts until op 8 unpacks Y. The runtime
    lets go of a checkpoint when a group after its last rebuild begins
    (``checkpoint_releases``): C stays through op 7, not only through its rebuild."""
    kib = 1024
    tensors = [T(4 * kib, kind="input"), T(8 * kib), T(4 * kib, saved=True,
               first_backward_use=6), T(4 * kib, saved=True, first_backward_use=6),
               T(4 * kib), T(4 * kib, saved=True, first_backward_use=8), T(10),
               T(4 * kib), T(4 * kib), T(4 * kib)]
    ops = [Op("forward", 1e-3, [0], [1]),  # C
           Op("forward", 1e-3, [1], [2]),  # R = f(C)
           Op("forward", 1e-3, [1], [3]),  # A = g(C)
           Op("forward", 1e-3, [2, 3], [4]),
           Op("forward", 1e-3, [0], [5]),  # Y
           Op("backward", 1e-3, [], [6]),
           Op("backward", 1e-3, [6, 2, 3], [7]),
           Op("backward", 1e-3, [7, 3], [8]),  # A again: the same group
           Op("backward", 1e-3, [8, 5], [9])]  # Y: another op's tensor
    profile = build(ops, tensors)
    profile.tensors[1].name = "c1"
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"c1": "keep", "t2": "recompute"})
    sched = simulate(profile, plan, GPU_ONLY).run.schedule
    assert [(i.op, i.recompute) for i in sched.items] == [
        (0, False), (1, False), (2, False), (3, False), (4, False), (5, False), (1, True),
        (6, False), (7, False), (8, False)]
    freed = {sched.residencies[r].tensor: k for k, item in enumerate(sched.items)
             for r in item.frees}
    assert freed[1] == 8  # after op 7, before op 8's unpack
    assert checkpoint_releases(profile, plan) == {"c1": 7}


def test_a_kept_tensor_backward_is_done_with_is_rebuilt_for_a_later_rebuild() -> None:
    """K (kept) is last unpacked at op 4; the rebuild of R (op 5) reads it: the runtime
    holds no copy by then, so K is rebuilt too, rather than kept on from op 4."""
    kib = 1024
    tensors = [T(4 * kib, kind="input"), T(8 * kib, saved=True, first_backward_use=4),
               T(2 * kib, saved=True, first_backward_use=5), T(10), T(2 * kib), T(2 * kib)]
    ops = [Op("forward", 1e-3, [0], [1]),  # K
           Op("forward", 1e-3, [1], [2]),  # R = f(K)
           Op("forward", 1e-3, [2], []),
           Op("backward", 1e-3, [], [3]),
           Op("backward", 1e-3, [3, 1], [4]),
           Op("backward", 1e-3, [4, 2], [5])]
    profile = build(ops, tensors)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t2": "recompute"})
    sched = simulate(profile, plan).run.schedule
    assert [(i.op, i.recompute) for i in sched.items][4:] == [
        (4, False), (0, True), (1, True), (5, False)]


def test_tensors_under_a_kibibyte_are_never_moved() -> None:
    """As in the runtime: the copy's fixed cost outweighs the bytes."""
    tensors = [T(1000, saved=True, first_backward_use=1), T(10)]
    ops = [Op("forward", 1e-3, [], [0]), Op("backward", 1e-3, [0], [1])]
    profile = build(ops, tensors)
    for decision in ("offload", "recompute"):
        plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t0": decision})
        r = simulate(profile, plan)
        assert r.d2h_bytes == r.h2d_bytes == 0 and r.recompute_s == 0.0


def test_a_prefetch_makes_no_reload_that_nothing_reads() -> None:
    """Reloads are made where backward needs a tensor; a prefetch point only moves one.
    A saved tensor backward never unpacks, offloaded and prefetched, does not come back,
    and the step frees everything. A prefetch point for a tensor the plan keeps or
    recomputes would say nothing: the plan is refused (issue 50)."""
    tensors = [T(2048, saved=True), T(4096, saved=True, first_backward_use=2), T(10)]
    ops = [Op("forward", 1e-3, [], [0]), Op("forward", 1e-3, [0], [1]),
           Op("backward", 1e-3, [1], [2])]
    profile = build(ops, tensors)
    for kept in ("keep", "recompute"):
        plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                    decisions={"t0": "offload", "t1": kept}, prefetch={"t0": 2, "t1": 2})
        with pytest.raises(InputError, match=f"plan prefetches 't1', which it {kept}s: only "
                                             "an offloaded activation is reloaded"):
            simulate(profile, plan, GPU_ONLY, memory_limit=6144)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t0": "offload", "t1": "keep"}, prefetch={"t0": 2})
    r = simulate(profile, plan, GPU_ONLY, memory_limit=6144)
    sched, tl = r.run.schedule, r.run.timeline
    assert r.feasible and [c.tensor for c in sched.d2h] == [0] and sched.h2d == []
    assert tl.memory[-1][1] == 0 and set(tl.free_time) == set(range(len(sched.residencies)))


def test_no_reload_starts_before_backward() -> None:
    """The runtime issues reloads from backward's unpacks, so a prefetch point in forward
    is backward's first op: the tensor, copied out long before, comes back once backward
    has begun, and the plan simulates as with its prefetch point there."""
    profile = _two_megabytes()
    hw = link_hardware(1e10, 1e10, 1e10, 1e10, 0.0, host=NO_HOST)  # 0.1 ms a copy
    runs = [simulate(profile, Plan(fingerprint=profile.fingerprint, strategy="hand",
                                   decisions={"t0": "offload"}, prefetch={"t0": at}), hw)
            for at in (0, 2)]
    for r in runs:
        reloads = [s for s in r.run.timeline.spans if s.stream == "h2d"]
        assert len(reloads) == 1 and reloads[0].start >= 2e-3
    assert runs[0].step_time_s == runs[1].step_time_s


def _two_megabytes():
    """f0 -> A, f1 -> B (1 MB each, saved); backward: b0 reads B, b1 reads A."""
    ms = 1e-3
    tensors = [T(1_000_000, saved=True, first_backward_use=3),
               T(1_000_000, saved=True, first_backward_use=2), T(10), T(10)]
    ops = [Op("forward", 1 * ms, [], [0]), Op("forward", 1 * ms, [], [1]),
           Op("backward", 1 * ms, [1], [2]), Op("backward", 1 * ms, [0, 2], [3])]
    return build(ops, tensors)


def test_memory_limit_makes_ops_wait_or_is_infeasible() -> None:
    """A and B (1 MB each) cannot both be resident under a 1.5 MB limit."""
    ms = 1e-3
    profile = _two_megabytes()
    hw = link_hardware(0.5e9, 0.5e9, 0.5e9, 0.5e9, 0.0, host=NO_HOST)
    keep = simulate(profile, None, hw, memory_limit=1_500_000)
    assert not keep.feasible
    assert keep.infeasible_reason.startswith("op 1 (k1 in (top)) needs 976.56 KiB")
    assert "short by 488.28 KiB" in keep.infeasible_reason
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t0": "offload"})
    ok = simulate(profile, plan, hw, memory_limit=1_500_000)
    # f1 waits for A's offload (1-3) to free its memory: f1 3-4; b0 4-5 frees B; A's
    # reload waits for that memory too: 5-7; b1 7-8
    assert ok.feasible and ok.peak_bytes <= 1_500_000
    assert ok.stall_s["memory"] == pytest.approx(2 * ms, rel=1e-12)
    assert ok.stall_s["reload"] == pytest.approx(2 * ms, rel=1e-12)
    assert ok.step_time_s == pytest.approx(8 * ms, rel=1e-12)


def test_offload_frees_name_the_op_before_which_the_copy_is_done() -> None:
    """The runtime frees an offloaded tensor where the simulator does (NOTE [offloads free
    where simulated]): before the first op to start once its copy is done."""
    profile = _chain(1e-3)  # f0 0-1, D2H of A 1-3, f1 1-2, b0 at 5
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand", decisions={"t0": "offload"})
    hw = link_hardware(0.5e9, 0.5e9, 0.5e9, 0.5e9, 0.0, host=NO_HOST)
    assert offload_frees(profile, plan, hw) == {"t0": 2}
    assert offload_frees(profile, Plan.keep_all(profile), hw) == {}
    # under a budget the next op waits for the copy, so A goes before it (op 1)
    tight = _two_megabytes()
    plan = Plan(fingerprint=tight.fingerprint, strategy="hand", decisions={"t0": "offload"},
                budget_bytes=1_500_000)
    assert offload_frees(tight, plan, hw) == {"t0": 1}


@SETTINGS
@given(seed=st.integers(0, 10**9), with_limit=st.booleans())
def test_offload_frees_are_where_the_simulated_step_frees(seed: int, with_limit: bool) -> None:
    profile, plan, hw, limit = _case(seed, with_limit)
    plan = plan.model_copy(update={"budget_bytes": limit})
    result = simulate(profile, plan, hw, limit)
    if not result.feasible:
        return
    frees = offload_frees(profile, plan, hw)
    tl, sched = result.run.timeline, result.run.schedule
    spans = [s for s in tl.spans if s.stream == "compute"]
    offloaded = {profile.tensors[c.tensor].name: c for c in sched.d2h}
    assert set(frees) <= set(offloaded)
    for name, position in frees.items():
        freed = tl.free_time[offloaded[name].residency]
        producer = profile.by_name[name].producer
        assert producer < position
        # freed before an item at that op starts (the runtime frees it before the op and
        # the rebuilds that run at it, which is no later)
        assert any(sched.items[s.index].position == position and s.start >= freed
                   for s in spans)
        # and not sooner than needed: every earlier op started with it resident
        earlier = [s.start for s in spans if sched.items[s.index].position < position]
        assert max(earlier) < freed
    # only copies still running when the step ends are left out
    for name, copy in offloaded.items():
        if name not in frees:
            assert tl.free_time[copy.residency] > spans[-1].start


# -- outputs and errors ----------------------------------------------------------------


def test_trace_schema(tmp_path) -> None:
    profile, plan, _, _ = _case(7, with_limit=False)
    for hw, host in ((GPU_ONLY, False), (load_hardware("a100-80gb"), True)):
        result = simulate(profile, plan, hw)
        path = tmp_path / "trace.json"
        write_trace(result, path)
        trace = json.loads(path.read_text())
        events = trace["traceEvents"]
        names = {e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        gpu = {"compute stream", "D2H copy engine", "H2D copy engine"}
        assert names == (gpu | {"issuing thread"} if host else gpu)
        for e in events:
            assert e["ph"] in {"M", "X", "C"} and isinstance(e["pid"], int)
            if e["ph"] == "X":
                assert e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in (0, 1, 2)
            if e["ph"] == "C":
                assert e["args"]["bytes"] >= 0
        spans = [e for e in events if e["ph"] == "X"]
        items = len(result.run.schedule.items)
        assert len([e for e in spans if e["pid"] == 0 and e["tid"] == 0]) == items
        assert len([e for e in spans if e["pid"] == 1]) == (items if host else 0)


def test_memory_plot(tmp_path) -> None:
    profile, plan, hw, _ = _case(3, with_limit=False)
    path = tmp_path / "memory.png"
    write_memory_plot(simulate(profile, plan, hw, memory_limit=0.9), path,
                      keep_all=simulate(profile))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs(tmp_path) -> None:
    profile = _chain(1e-3)
    with pytest.raises(InputError, match="irreducible working set.*1001000 bytes"):
        simulate(profile, memory_limit=1000)
    with pytest.raises(InputError, match="different model or batch shape"):
        simulate(profile, Plan(fingerprint="x", strategy="s", decisions={}))
    with pytest.raises(InputError, match="does not save"):
        simulate(profile, Plan(fingerprint=profile.fingerprint, strategy="s",
                               decisions={"nope": "offload"}))
    preset = Path(__file__).parents[1] / "src/slackswap/hardware/presets/a100-80gb.toml"
    bad = tmp_path / "bad.toml"
    bad.write_text(preset.read_text().replace("h2d_bandwidth = 24.8e9", "h2d_bandwidth = 0"))
    with pytest.raises(InputError, match=r"bad\.toml: field 'host_link\.h2d_bandwidth'"):
        simulate(profile, hardware=bad)


@pytest.mark.parametrize("seed", range(20))
def test_copies_on_the_compute_stream_add_their_time(seed: int) -> None:
    """``host_link.stream = "compute"`` (PyTorch's activation-offloading pass): every copy
    blocks the compute stream, so with no limit and no host the step is its kernels, its
    rebuilds and each copy's latency plus bytes over the link's solo rate, and nothing
    waits for a reload; under its own peak as the limit it runs the same."""
    rng = random.Random(seed)
    profile = random_step(rng, rng.randint(3, 14))
    plan = random_plan(rng, profile)
    rate_out, rate_in = rng.uniform(1e9, 3e10), rng.uniform(1e9, 3e10)
    hw = with_overrides(link_hardware(rate_out, rate_in, 1e9, 1e9, 1e-6, host=NO_HOST),
                        {"host_link.stream": "compute"})
    built = build_schedule(profile, plan)
    copies = (sum(1e-6 + c.bytes / rate_out for c in built.d2h)
              + sum(1e-6 + c.bytes / rate_in for c in built.h2d))
    free = simulate(profile, plan, hw)
    assert free.feasible and free.stall_s["reload"] == 0
    kernels = sum(item.duration for item in built.items)
    assert free.step_time_s == pytest.approx(kernels + copies, rel=1e-12, abs=1e-15)
    assert free.d2h_bytes == sum(c.bytes for c in built.d2h)
    held = simulate(profile, plan, hw, memory_limit=free.peak_bytes)
    assert held.feasible and held.step_time_s == pytest.approx(free.step_time_s, rel=1e-12)
