"""The exact model (``planners/exact.py``): a valid bound, tighter than the LP, and the
gate on small real steps: SlackSwap within half a point of the optimum it proves."""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path

import pytest
from stepgraphs import NO_HOST, best_assignment, block_step, chain_step, link_hardware, random_step

import slackswap
from slackswap.core.jsonio import content_digest
from slackswap.core.profile import StepProfile
from slackswap.models.presets import with_layers
from slackswap.planners import STRATEGIES
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.exact import exact_optimum, program_value
from slackswap.reproduce import cached_profile


def _random_link(rng: random.Random, seed: int, low: float = 5e8, high: float = 2e10):
    """A host link at a rate drawn from ``rng`` between ``low`` and ``high`` (duplex H2D
    slower by up to 70%), with the host's costs on even seeds and none on odd ones."""
    rate = rng.uniform(low, high)
    return link_hardware(rate, rate, rate, rate * rng.uniform(0.3, 1), 1e-6,
                         host=NO_HOST if seed % 2 else None)


def test_no_plan_beats_the_exact_bound_on_small_steps() -> None:
    """Every keep/offload/recompute assignment of small random steps, simulated, stays
    under the integer program's optimum (on odd seeds with its ``tight`` rows), which
    stays under the LP bound; the program's own plan, simulated, stays under it too."""
    checked = 0
    for seed in range(30):
        rng = random.Random(seed)
        profile = random_step(rng, rng.randint(3, 10))
        for t in profile.tensors:  # above the planners' size floor
            t.bytes *= 100
        hw = _random_link(rng, seed, 2e9, 5e10)
        ctx = PlanContext(profile, hw,
                          int(rng.choice([0.3, 0.5, 0.7, 0.9]) * profile.keep_all_peak))
        names = [c.name for c in ctx.candidates]
        if not ctx.reachable or not 2 <= len(names) <= 6:
            continue
        best = best_assignment(ctx)
        exact = exact_optimum(ctx, tight=seed % 2 == 1)
        assert best <= exact.bound + 1e-9, seed
        assert exact.achieved <= exact.bound + 1e-9, seed
        assert exact.bound <= retention_bound(ctx) + 1e-6, seed
        checked += 1
    assert checked >= 9


def test_no_plan_with_checkpoints_beats_the_exact_bound() -> None:
    """Small block-shaped steps (``block_step``) whose rebuilds read tensors autograd never
    saved: every assignment, each such tensor kept, offloaded or left to be rebuilt,
    simulated, stays under the program's optimum (so do the program's own plans), and on
    some steps a plan that keeps or offloads checkpoints is the best one. Two steps in
    three have module segments, which the runtime watches whole; one in four checks
    memory as each backward op ends too (``op_ends``), and one in two has the program's
    tight timing rows (``tight``, with ``op_ends`` or without)."""
    checked = helped = 0
    for seed in range(1400):
        rng = random.Random(seed)
        profile = block_step(rng, rng.randint(1, 2))
        for t in profile.tensors:
            t.bytes *= 100
        if seed % 3:  # module segments: the runtime watches whole ones
            seg = random.Random(-seed)
            forward = sum(op.phase == "forward" for op in profile.ops)
            profile.module_events = sorted(seg.sample(range(1, forward + 1),
                                                      seg.randint(1, forward)))
        hw = _random_link(rng, seed)
        ctx = PlanContext(profile, hw,
                          int(rng.choice([0.3, 0.4, 0.5, 0.6, 0.7]) * profile.keep_all_peak))
        checkpoints = tuple(sorted(profile.checkpointable))
        if not ctx.reachable or not 2 <= len(ctx.candidates) + len(checkpoints) <= 7:
            continue
        exact = exact_optimum(ctx, op_ends=seed % 4 == 0, tight=seed % 4 in (0, 1))
        if exact.bound >= 1:
            continue
        best = best_assignment(ctx, checkpoints)
        assert best <= exact.bound + 1e-9, seed
        assert exact.achieved <= exact.bound + 1e-9, seed
        assert exact.bound <= retention_bound(ctx) + 1e-6, seed
        checked += 1
        helped += best > best_assignment(ctx) + 1e-9
    assert checked >= 20 and helped >= 3


def test_the_program_values_every_plan_at_least_at_its_simulated_retention() -> None:
    """``program_value`` bounds the plan it values, on small block-shaped steps with random
    plans at budgets between the working set and keep-all's peak, checkpoints kept or
    offloaded at random: among them ones no rebuild reads, which the simulator and the
    runtime neither hold nor copy (the program once held them all step, or copied
    them, and valued such plans under their simulated retention, or as not fitting)."""
    checked = 0
    for seed in range(80):
        rng = random.Random(seed)
        profile = block_step(rng, rng.randint(1, 2))
        for t in profile.tensors:
            t.bytes *= 100
        hw = _random_link(rng, seed)
        floor = profile.working_set[0]
        ctx = PlanContext(profile, hw, int(floor + rng.random() * (profile.keep_all_peak - floor)))
        moves = {c.name: ("keep", "offload", "recompute") if c.name in profile.recomputable
                 else ("keep", "offload") for c in ctx.candidates}
        for _ in range(8):
            decisions = {n: rng.choice(options) for n, options in moves.items()}
            decisions |= {c: rng.choice(("keep", "offload"))
                          for c in sorted(profile.checkpointable) if rng.random() < 0.7}
            plan = ctx.plan("x", decisions)
            result = ctx.simulate(plan)
            if result.feasible:
                value = program_value(ctx, plan, op_ends=seed % 4 == 0, tight=seed % 2 == 0)
                assert value >= result.retention - 1e-9, (seed, decisions)
                checked += 1
    assert checked >= 300


def test_the_program_follows_a_rebuild_read_through_a_run_of_rebuilds() -> None:
    """Lines of ops each saving its input (``chain_step``), one activation offloaded and
    every later one recomputed: the first rebuild in backward reads the offload through
    four links or more, so it must be back before then (NOTE [read depth]).
    ``program_value`` stays at or over the plan's simulated retention, and on some steps
    comes down to it where, following three links (as it did), it stayed over by points."""
    checked = tighter = 0
    for seed in range(40):
        rng = random.Random(seed)
        profile = chain_step(rng, rng.randint(6, 8))
        for t in profile.tensors:
            t.bytes *= 100
        hw = _random_link(rng, seed)
        wide = PlanContext(profile, hw, profile.keep_all_peak)
        names = [c.name for c in wide.candidates]  # in forward order
        start = rng.randrange(0, len(names) - 4)
        decisions = {names[start]: "offload"} | {n: "recompute" for n in names[start + 1:]}
        ctx = PlanContext(profile, hw, wide.simulate(wide.plan("x", decisions)).peak_bytes)
        plan = ctx.plan("x", decisions)
        simulated = ctx.simulate(plan).retention
        value = program_value(ctx, plan, op_ends=seed % 2 == 0)
        assert value >= simulated - 1e-9, seed
        cut = program_value(ctx, plan, op_ends=seed % 2 == 0, rebuild_depth=3)
        tighter += cut > value + 0.01
        checked += 1
    assert checked == 40 and tighter >= 3


@functools.cache
def small(name: str) -> StepProfile:
    base, layers = name.split("@")
    return cached_profile(with_layers(base, int(layers)), slackswap.load_hardware("a100-80gb"))


# (step, budget) where SlackSwap is more than half a point under the program's optimum as
# the gate solves it (8-31 s each). Measured (a100-80gb), SlackSwap / that optimum:
# bert-large-mlm@1 at 50% 82.9 / 84.7, 60% 88.4 / 89.6, 70% 92.7 / 93.3; llama-7b@1 at 70%
# 97.0 / 97.7 (95.6 before the chain-column covers, NOTE [chain columns]). The program at
# its tightest (``op_ends`` and ``tight``, minutes each: benchmarks/exact_gap.py --op-ends
# --tight --time-limit 500) settles all three bert-large-mlm@1 cases: at 50% its proven
# optimum is 83.0, so SlackSwap is within half a point there; at 60% (optimum 89.07, its
# own plan simulating at 88.94) and at 70% (93.28, reached by its own plan, so the best
# plan exactly) the planner is short by 0.7 and 0.6 points. At llama-7b@1 70% the planner
# is short too: the program's plan with ``op_ends`` (92 s) simulates at 97.4. The 70%
# plans the planner misses differ from SlackSwap's in several decisions at once, with no
# improving single move between (bert: the output dense's result kept as a checkpoint,
# with the output dropout and residual add recomputed, Q offloaded and V kept; any one
# or two of these three changes alone retains 87.7-92.4, all three 92.85; llama: eight
# decisions among the norms' casts, the attention adds and the block's sum). A randomized
# local search of some 40 000 plans from SlackSwap's found none better at 60 or 70%.
# Since the checkpoint kick (NOTE [starting points]) SlackSwap reaches 93.28 at
# bert-large-mlm@1 70%, and 83.02 at 50% (the proven optimum; 82.97 before the swaps
# tried the closest match in bytes first), and 97.43 at llama-7b@1 70% since the offload
# exchanges (the program's own plan with ``op_ends``, reached when the final norm's cast
# leaves the offload set and the cover is chosen again). These four are gated against
# the tightest program's proven optima, solved offline
# (``test_within_half_a_point_of_the_tightest_proven_optimum``); since the recompute
# trades after the kick (NOTE [starting points]) bert-large-mlm@1 at 60% retains 88.94,
# the program's own plan (optimum 89.07), and all four pass.
OPEN = {("bert-large-mlm@1", 0.5), ("bert-large-mlm@1", 0.6), ("bert-large-mlm@1", 0.7),
        ("llama-7b@1", 0.7)}
CASES = [(name, budget) for name in ("bert-large-mlm@1", "llama-7b@1", "gpt2-xl@2")
         for budget in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9) if (name, budget) not in OPEN] + [
    # two layers solve in 3-60 s (unproven at 40 and 50% within a minute), and the gate
    # takes the fast ones (50 and 60% are gated against stored bounds, below; 30 and 40%
    # are stored too, short: ``SHORT``). At 30% the program as solved here proves 81.9% in
    # 27 s, its plan retains 64.7%, SlackSwap's 78.3% (58.5 before the joint cover)
    ("bert-large-mlm@2", 0.7), ("bert-large-mlm@2", 0.8), ("bert-large-mlm@2", 0.9)]


# ``heavy`` too: the one-layer cases whose search or bound takes 7 to 16 s on two loaded
# cores (in the exact gate, the other families' and the stored bounds' alike); the default
# run keeps every model's and family's other budgets
ONE_LAYER_HEAVY = {("gpt2-xl@2", 0.9), ("bert-large-mlm@1", 0.8), ("bert-large-mlm@1", 0.9),
                   ("neox", 0.7), ("phi", 0.7), ("llama-7b@1", 0.7),
                   ("bert-large-mlm@1", 0.5), ("bert-large-mlm@1", 0.7)}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "budget"), [
    pytest.param(*c, marks=pytest.mark.heavy)
    if c[0] == "bert-large-mlm@2" or c in ONE_LAYER_HEAVY else c
    for c in CASES])
def test_within_half_a_point_of_the_exact_optimum(name: str, budget: float) -> None:
    """One or two full-size layers, every budget from 30%: SlackSwap retains within half a
    point of the program's optimum (so of the best plan), and no strategy exceeds it.
    Budgets no plan reaches are skipped."""
    profile = small(name)
    ctx = PlanContext(profile, slackswap.load_hardware("a100-80gb"),
                      int(budget * profile.keep_all_peak))
    if not ctx.reachable:
        pytest.skip("below the step's working set")
    exact = exact_optimum(ctx)
    for make in STRATEGIES.values():
        attempt = ctx.attempt(make)
        if attempt is not None and attempt[1].feasible:
            assert attempt[1].retention <= exact.bound + 1e-9
    ours = ctx.attempt(STRATEGIES["slackswap"])[1].retention
    assert ours >= exact.bound - 0.005


def _family_survey():  # benchmarks/family_survey.py: builds the families' models
    path = Path(__file__).parent.parent / "benchmarks" / "family_survey.py"
    spec = importlib.util.spec_from_file_location("family_survey", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize(("family", "budget"),
                         [pytest.param(*c, marks=pytest.mark.heavy)
                          if c in ONE_LAYER_HEAVY else c
                          for c in [("neox", 0.7), ("phi", 0.7), ("gemma", 0.9)]])
def test_within_half_a_point_of_the_exact_optimum_on_other_families(family: str,
                                                                    budget: float) -> None:
    """Two layers of families the planner was not built around (GPT-NeoX-6.9B's parallel
    residual, Gemma-7B's 256 000-word vocabulary), at full width: within half a point of
    the program's proven optimum, and no strategy over it. GPT-NeoX at 70% retained 96.23%
    (optimum 98.70) before the late window (NOTE [late slack]), 98.61 since; Phi-2 at 70%
    93.67 (optimum 94.63) before link room (NOTE [starting points]), 94.63 since."""
    survey = _family_survey()
    hw = slackswap.load_hardware("a100-80gb")
    profile = slackswap.profile(*survey.build(family, 2), hw)
    ctx = PlanContext(profile, hw, int(budget * profile.keep_all_peak))
    exact = exact_optimum(ctx)
    assert exact.proven
    for make in STRATEGIES.values():
        attempt = ctx.attempt(make)
        if attempt is not None and attempt[1].feasible:
            assert attempt[1].retention <= exact.bound + 1e-9
    assert ctx.attempt(STRATEGIES["slackswap"])[1].retention >= exact.bound - 0.005


@pytest.mark.heavy  # the program solved for a second preset (15 s on two loaded cores)
def test_the_program_values_a_plan_at_least_at_its_simulation_on_h100_sxm() -> None:
    """One bert-large-mlm layer at 70% on h100-sxm: HiGHS's presolve once cut off the
    program's better solution for SlackSwap's plan and valued it 0.011 points under its
    simulated retention (NOTE [value without presolve]); now at it or over it (by at most
    0.3 points, as on the stored cases)."""
    hw = slackswap.load_hardware("h100-sxm")
    profile = cached_profile(with_layers("bert-large-mlm", 1), hw)
    ctx = PlanContext(profile, hw, int(0.7 * profile.keep_all_peak))
    plan, result = ctx.attempt(STRATEGIES["slackswap"])
    assert result.retention - 1e-9 <= program_value(ctx, plan) <= result.retention + 0.003


STORED = Path(__file__).parent / "data" / "exact_optima.json"
# stored cases where the planner is known to fall short of the bound (the comment on
# OPEN): checked to be short still, so that closing a gap fails until the case is taken
# out of here. (Two bert-large-mlm layers at 60%, stored with the tightest program's
# proven optimum, 93.19% in 212 s, were short at 92.48 until the planner also ran with
# the host's forward watches priced: NOTE [watch columns]). Two bert-large-mlm layers at
# 30 and 40%: the tightest program stops at its 600 s limit with dual bounds of 80.28 and
# 86.29%; the best plans known retain 78.40 (the program's, an earlier incumbent's
# decisions with reloads as early as they fit) and 85.54% (a seeded search of 100 000
# plans from SlackSwap's, ``exact_gap.py --search``), SlackSwap's 78.29 and 85.32%: the
# bound is loose or the planner short, not known which.
SHORT: set[tuple[str, float]] = {("bert-large-mlm@2", 0.3), ("bert-large-mlm@2", 0.4)}
# two full-size bert-large-mlm layers: ``heavy`` (20-90 s each on two loaded cores; the
# stored cases and CASES' 70-90%); the default run gates one layer of each model
HEAVY_STEP = "bert-large-mlm@2"


def _solved_digest(profile: StepProfile) -> str:
    """The profile's digest as the bounds were solved for: without ``model_saves``, added
    since, which only the runtime reads (to find a step off its profiled path; NOTE [a
    step off the profiled path]): nothing planned or simulated depends on it."""
    return content_digest(profile.model_copy(update={"model_saves": None}))


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.heavy)
    if c["step"] == HEAVY_STEP or (c["step"], c["budget"]) in ONE_LAYER_HEAVY else c
    for c in json.loads(STORED.read_text())], ids=lambda c: f"{c['step']}-{c['budget']}")
def test_within_half_a_point_of_the_tightest_bound(case: dict) -> None:
    """The OPEN cases and two bert-large-mlm layers at 50 and 60%, against the program
    at its tightest (``op_ends`` and ``tight``): solved offline (minutes each:
    ``benchmarks/exact_gap.py --op-ends --tight --store tests/data/exact_optima.json``),
    its bound is stored with its plan and digests of the profile and hardware it was
    solved for. The bound is the proven optimum or, where the solver stopped at its time
    limit, its dual bound (``proven`` false): a retention no plan exceeds either way.
    Here: the same profile and hardware (or regenerate), the stored plan still simulates
    to what it did and under the bound, and SlackSwap retains within half a point of it
    (except in ``SHORT``).

    And ``program_value``, the program with the decisions of the better of the two plans
    pinned: never under its simulated retention (the program bounds every plan) and
    within 0.3 points of it (the program misses little of what these plans lose). At
    two bert-large-mlm layers at 30% it took the D2H queue's production times with the
    host's watches and the re-runs of rebuilds however deep (NOTE [tight timing]): the
    stored plan, simulated at 78.40%, was valued at 79.33%."""
    profile, hw = small(case["step"]), slackswap.load_hardware(case["hardware"])
    assert (_solved_digest(profile), content_digest(hw)) == (
        case["profile_digest"], case["hardware_digest"]), (
        "the profile or hardware changed since the bound was solved: regenerate "
        "tests/data/exact_optima.json as its test says (or install the transformers "
        "version pyproject.toml's test extra pins)")
    ctx = PlanContext(profile, hw, int(case["budget"] * profile.keep_all_peak))
    plan = ctx.plan("exact", case["plan"]["decisions"], case["plan"]["prefetch"])
    assert ctx.simulate(plan).retention == pytest.approx(case["plan_retention"], abs=1e-12)
    assert case["plan_retention"] <= case["bound"] + 1e-9
    attempt = ctx.attempt(STRATEGIES["slackswap"])
    ours = attempt[1].retention
    assert ours <= case["bound"] + 1e-9
    if (case["step"], case["budget"]) in SHORT:
        assert ours < case["bound"] - 0.005, "the gap is closed: take the case out of SHORT"
    else:
        assert ours >= case["bound"] - 0.005
    best, retention = max([attempt[0], ours], [plan, case["plan_retention"]],
                          key=lambda a: a[1])
    assert retention - 1e-9 <= program_value(ctx, best) <= retention + 0.003
