"""The SlackSwap planner: offload within the transfer slack what is expensive to rebuild,
recompute the rest at least cost, refine against the simulator.

NOTE [slack]
    The D2H engine can move bytes while forward computes, the H2D engine while backward
    computes. An offload is *within slack* when, queued in production order behind the
    offloads already chosen, its copy lands before forward ends, and, queued in the order
    backward needs them from the start of backward, its reload lands before the op that
    needs it starts. Activations are considered most expensive to rebuild per byte first
    (attention and GEMM outputs), so the slack goes where recomputation would cost most.
    An offload lowers memory at a point of pressure only once its copy has landed there.
    What still exceeds the budget is covered by the least-cost recompute set
    (:mod:`slackswap.planners.recompute`), whose rebuild costs count the never-saved
    inputs a rebuild needs. The simulator then checks the plan: a shortfall raises the
    safety margin and the plan is rebuilt. A reload that lands just in time in the
    keep-all timeline can still stall once recomputation stretches backward, so the
    planner also tries spending part of the slack or none of it, and keeps the plan the
    simulator rates best. The reload start points of that plan become its prefetch points.
    On a whole workload (not ``PlanContext.short_step``) it stops at the first part
    whose plan rates below the best so far: on whole workloads retention falls with the
    slack spent once past its best (the five parts of bert-large at 30% on a100-80gb
    retain 85.90, 85.72, 84.94, 84.06 and 82.94%), and the parts left untried, covers
    that recompute nearly everything, took much of the solver's time where the host's
    watches are priced (llama-7b at 30% on h200: 2.7 s of HiGHS, 1.5 s without them;
    bert-large on h100-sxm 1.75 s, 0.43); on 126 sweep cases and eight cases of 12-24
    layers no plan changed.

NOTE [starting points]
    The baselines' plans are candidates too: whichever plan, its own or a baseline's,
    the simulator rates best is where a local search starts (from keep-all and the
    uniform plans as well, when none fits yet); while simulations of its budget are
    left, it starts again: from the bound's LP solution rounded (``relaxed_plan``), then
    from the next best of the others, recompute-only's plan among them (a short step's
    search often settles in a few passes; on bert-large-mlm@1 at 60 and 70% the search
    from recompute-only's plan ends 0.9 and 1.5 points above the one from the best
    start, on llama-7b@1 at 70% the one from the LP's 1.3 points). That search moves one
    activation at a time: a recompute to offload (the longest-waiting first), an offload
    to recompute, a moved one back to keep and, while the plan does not fit, a kept one
    moved; on a step of few candidates, pairs of moves too. A move is kept when the
    simulated plan fits where it did not, falls less short, or retains more. Moves of
    the tensors autograd never saved that rebuilds read come first and last: all of them
    offloaded or kept as checkpoints at once, then each alone. The search stops after a
    number of simulations fixed by the step's size (``SEARCH_SIMULATIONS``, more on a
    short step: ``SEARCH_OPS``), or, sooner, once ``SEARCH_PATIENCE`` simulations in a
    row (a third of that number, when more) found nothing better, so a plan depends on
    the profile and hardware alone, never on the machine's speed. Measured: bert-large
    at 30% on h200 gained 2.1 points in 24 simulations, better with nearly every one; on
    a100-80gb at 50% the searches of gpt2-xl and llama-7b found all they would in their
    first three (now 11 and 8 simulations, not 24); on small random steps the plans
    match the best of every keep/offload/recompute assignment
    (``test_the_best_assignment_on_small_steps``).

    On a short step (a search budget above ``SEARCH_SIMULATIONS``) one more search
    starts from the best plan of the covers with chain columns (``CHAIN_COVERS``: kept
    checkpoints, ops paid once, NOTE [chain columns]), with a budget of its own: added
    to the others' starts instead, those plans often rate best yet lead the one search
    a long step has into a worse basin (in a sweep of eight presets, three workloads
    and budgets 30-90%, 12 of 151 plans lost up to 1.6 points), and on bert-large-mlm@1
    at 60% a short step's too. Searched apart, llama-7b@1 at 70% gains 1.4 points
    (95.65 to 97.01%) and bert-large-mlm@1 at 70% 0.13; the best of both is kept.
    Then, on a step of at most ``SHORT_STEP_CANDIDATES`` candidates, one kick (``KICKS``):
    the checkpoint whose keeping saves rebuilds the most time is kept, every activation
    whose rebuild reads it recomputed, and a search from there
    also tries swaps (a moved activation kept, a kept one moved in its place) where
    single moves are stuck. On bert-large-mlm@1 at 70% (the output dense's result kept,
    the output dropout and residual add recomputed, then Q and V swapped) this reaches
    93.28%, the exact model's proven optimum, from 92.72; no single or pair of moves on
    the way improves (on bert-large's 24 layers, six presets at 30-90%, the kick ended
    no plan better, cost a fifth of plan time, and one plan is 0.4 points better
    without it). A pass of swaps tries the closest matches in bytes first and
    stops, as single moves do, after ``patience`` simulations without a better plan: on
    bert-large-mlm@1 at 50% it reaches the proven optimum, 83.02% (82.97 largest
    first), and a one-layer plan runs about a third fewer simulations.

    From the kick's plan, where the budget covers simulating each with no memory limit,
    recompute trades (``_recompute_trades``): one recomputed activation kept and another
    recomputed instead, ranked by the step time a trade saves per byte it leaves to
    free, the first ``TRADES`` each followed by offload moves alone, the recompute set as
    traded. A search that may also change recomputes undoes a trade before the offloads
    around it are re-chosen; any part of such a change alone is worse. On
    bert-large-mlm@1 at 60% the first trade (K's projection kept, the MLM head's GELU
    output recomputed) and its offload moves reach 88.94%, as the exact model's own
    plan does (88.38 before; its proven optimum 89.07); at 80%, 97.15 from 96.80.

    Last, where the budget covers a pass of them (``EXCHANGE_SIMULATIONS`` per
    candidate), offload exchanges: the best plan's offload set with one activation taken
    out or added (the largest first), the recompute cover chosen again for it, every
    cover kind; the first set whose cover rates better than the current set's is taken
    and searched from, until none does or the budget is spent. Single moves keep the
    recompute set and change one decision; an exchange lets the cover re-choose the
    whole recompute set around the new offload set. On llama-7b@1 at 70% taking the
    final norm's 64 MiB cast out of the offload set, covered again and searched, reaches
    97.43% from 97.01 (the exact model's own plan retains 97.43); two bert-large-mlm
    layers gain 0.25-1.0 points at 50-90% on a100-80gb. A full reference workload has
    hundreds of candidates and a budget of a few dozen simulations: none run there. They
    run in a step's first run only: in the runs with the fixed costs priced (below) every
    cover they ask for has watch columns and takes several times as long (wav2vec2 at 50%
    planned in 26 s, 11 s without them there); on 124 short steps (one- and two-layer
    steps of the reference models and of six other families on a100-80gb, h100-sxm and
    h200, and the runtime tests' 62 small models at 50 and 70%) no retention changed, nor
    any decision of the small models' plans, and plan time fell by a fifth to a half.

    Then a last search from the best plan, swaps included: on bert-large-mlm@2 at 50%
    (a100-80gb) it gains 0.40 points (88.62 to 89.02%; a search from the exact model's
    own plan reaches 89.71), on six presets' one- and two-layer steps up to 1.14 (h100-sxm,
    bert-large-mlm@2 at 90%); the full reference workloads' plans are unchanged. And one
    more whose moves come in groups (``groups``): a producer's recomputed outputs
    offloaded together, and the checkpoints no rebuild reads any more left out with the
    move that ends their last reader's recompute. On one bert-large-mlm layer at 50% on
    h100-sxm, where the host sets the pace, the embeddings' dropout output and mask
    offloaded and their layer norm's checkpoint left out retain 69.89% (67.78); each part
    alone is worse. Made the only search's moves, they moved two bert-large-mlm layers at
    60% off the proven optimum (93.19 to 92.75): last and apart, they only add.
    Then recompute releases (``_recompute_releases``): each recomputed activation kept,
    the most expensive rebuild first, and the memory it takes back freed by offloading
    one or two kept activations, those that free the shortfall at the least cost first
    (``RELEASE_TRIES``). Where the host sets the pace many offloads cost nothing alone,
    and no single move or swap passes through them: on two bert-large-mlm layers at 50%
    on h100-sxm, layer 1's query projection kept and a dropout mask and the MLM head's
    GELU output offloaded retain 75.94% (75.70; 76.02 before offloads were issued
    in groups), and the perturbed search from there
    76.43 (a seeded search of 30 000 plans from 75.70 found 76.43 too); the planner
    gains 0.91 points at 90% on h200 (83.81) and 0.43 at 60% on h100-pcie (89.00).
    Last, the perturbed search (NOTE [perturbed search] in
    :mod:`slackswap.planners.perturb`), with the step's search budget (these two only on
    steps of at most ``SHORT_STEP_CANDIDATES`` candidates: on bert-large's 24 layers they
    doubled plan time, to 7 s, for 0.3 points at 30%): one bert-large-mlm
    layer at 50% on h200 gains 1.8 points (63.41 to 65.21%), where the plan the other
    stages settle in is a local optimum of every single change.

    On a short step all of this (but the offload exchanges) runs twice, the second time
    with each operation's fixed costs priced, and the better plan is kept. The covers
    price the host's forward watches (NOTE [watch columns] in
    :mod:`slackswap.planners.recompute`): bert-large-mlm@2 at 60% reaches the exact
    model's proven optimum, 93.19% (92.48), bert-large at 50% gains 0.14 points. And the
    slack leaves out the copies the link's latency dominates
    (``latency_bound``: a layer norm's statistics, 32 KiB against 250 KiB that the
    link's 10 us would carry): each costs its latency twice whenever the link is busy,
    which the slack, fixed in the keep-all timeline, does not see once recomputation
    stretches backward. On bert-large-mlm@2 at 50% the first run's plan offloads eight of
    them; the second run's keeps them and reaches 89.68% (89.09; the best plan known,
    from a long randomized search, 89.71). Priced in the one run instead, the watches
    moved bert-large-mlm@1 at 70% off its optimum (93.28 to 92.59), and so did the
    latency (to 92.77): the kick's basin is another. Then, on any step whose first run's
    plan waits on the host for ``HOST_STALL_SHARE`` of its time or more (its packs and
    watches outrun the GPU in forward), all of it runs once more with the watches priced
    as the time the host runs behind the GPU, summed over the segments watched (NOTE
    [watch columns]), the best of the runs kept: 24 Mistral-7B layers at 30% on h100-sxm
    retain 92.41% (88.69: 19 ms of a 315 ms step waited on the host, 0.2 ms now), 24
    Qwen2-7B layers 89.22 (86.68), gpt2-xl at 50% on h100-sxm 87.25 (86.34). Priced so
    in the short step's second run instead, two bert-large-mlm layers at 50% on h200
    gained 1.09 points but one llama-7b layer at 70% there lost 0.63; as a run of its
    own it only adds. A plan that does not wait on the host (the reference workloads on
    a100-80gb) is made as before. On a short step this last run leaves out the chained
    covers: priced so, each takes HiGHS a third of a second even at its node limit
    (a two-layer GPT-2 in Hugging Face's Trainer: 7.1 s of a 15 s plan), and on 124 short
    steps (one and two reference layers on three presets, six other families' two
    layers, the runtime tests' 62 small models) no plan lost, one gained 0.03 points (the
    search took another path), and plan time fell by a tenth to a fifth. A whole
    workload keeps them: bert-large at 30% on h100-sxm would lose 0.31 points.

    Where no slack-first cover fits at all (every slack fraction, every margin), the
    joint covers (NOTE [joint cover] in :mod:`slackswap.planners.joint`) are searched
    apart, last: on bert-large-mlm@2 at 30% on a100-80gb every cover fell short (a
    rebuild at the loss re-ran the whole forward), the search settled from a baseline's
    plan at 58.5%, and from the depth-3 joint cover's plan (77.4) it reaches 77.5%. Last
    and apart, they never change a plan the other stages make: added to the starts
    instead, their plans rated best on h100-sxm, h100-pcie and h200 at 30% and led the
    search 0.2-1.8 points lower than the baselines' starts did. So, last, are the covers
    of the late window's offload sets (NOTE [late slack] in :mod:`slackswap.planners.slack`).

    And, on steps of at most ``SHORT_STEP_CANDIDATES`` candidates, link room
    (``_link_room``): the slack is a knapsack, and the greedy in rebuild-cost order can
    fill the link with small copies of tensors cheap to rebuild before a large costly one
    fits. Each recomputed activation is offloaded with the offloads cheaper to rebuild
    recomputed in its place, the cheapest per byte first, until they free its bytes; a
    search with swaps starts from the best of these. No single move or swap passes
    there: on two Phi-2 layers at 70% (a100-80gb, ``benchmarks/family_survey.py``) layer
    1's MLP input projection offloaded, three layer norms' outputs and layer 0's value
    projection recomputed, retain 94.63%, the exact model's proven optimum (93.67
    before); three OPT-1.3B layers at 80% on h100-sxm gain 1.06 points, two GPT-NeoX-6.9B
    layers at 70% on h100-sxm 0.40, and no case of the gated set moves.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

from slackswap.core.plan import MIN_PLANNED_BYTES, Decision, Plan
from slackswap.core.result import SimResult
from slackswap.errors import SlackSwapError
from slackswap.planners import baselines
from slackswap.planners.bound import relaxed_plan
from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.joint import JOINT_DEPTHS, choose_joint
from slackswap.planners.memory import pressure_points
from slackswap.planners.perturb import perturbed_search
from slackswap.planners.prefetch import with_prefetch_points
from slackswap.planners.recompute import chain_edges, chain_seconds, choose_cover, rebuild_cost
from slackswap.planners.search import Attempt, fit_margin, or_uniform, scores_better
from slackswap.planners.search import score as _score
from slackswap.planners.slack import eviction_credit, latency_bound, offload_within_slack

__all__ = ["slackswap", "SLACK_FRACTIONS", "SEARCH_SIMULATIONS"]

SLACK_FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.0)
# further recompute covers of each offload set, (checkpoints, shared): NOTE [chain
# columns] in :mod:`slackswap.planners.recompute`
CHAIN_COVERS = ((True, False), (True, True))
PAIR_SEARCH_CANDIDATES = 10  # steps this small also try pairs of moves
SEARCH_SIMULATIONS = 24  # the local search's budget: NOTE [starting points]
SEARCH_OPS = 40_000  # ... or this many simulated ops, when that is more simulations
# a search that finds nothing better in this many simulations in a row (or a third of its
# budget, when that is more) has settled: the planner's search ends there
SEARCH_PATIENCE = 8
KICKS = 1  # checkpoint kicks on a step of few candidates: NOTE [starting points]
TRADES = 2  # recompute trades repaired by offload moves after a kick: NOTE [starting points]
# offload exchanges run where the budget covers a pass of them, each about this many
# simulations (one cover of each kind): NOTE [starting points]
EXCHANGE_SIMULATIONS = 3
# a step whose first plan waits this share of its time on the host is planned once more,
# with the watches priced as the time the host runs behind (NOTE [starting points])
HOST_STALL_SHARE = 0.005
# recompute-only is a start too: its cover is this planner's with no slack spent, but
# where the host's costs are priced (h200: the watches, offload_s and reload_s of NOTE
# [copy costs]) the searches from the others ended below it (docs/baseline-sweep.txt:
# bert-large at 50 to 90% and gpt2-xl at 80 and 90% on h200, by 0.3 to 4.2 points)
STARTS = (baselines.recompute_only, baselines.capuchin, baselines.offload_only,
          baselines.checkpoint_blocks, baselines.checkpoint_offload,
          baselines.module_policy)


def slackswap(ctx: PlanContext) -> Attempt | None:
    """SlackSwap's plan for ``ctx`` and its simulated result (NOTE [slack], NOTE
    [starting points])."""
    best = _pipeline(ctx)
    priced = bool(ctx.profile.module_events) and ctx.hw.host.watch_s > 0
    again = []  # NOTE [starting points]: a short step once more, a host-bound one too
    if (priced or any(latency_bound(ctx, c) for c in ctx.candidates)) and (
            _search_budget(ctx) > SEARCH_SIMULATIONS):
        again.append("segments")
    if priced and _host_bound(best):
        again.append("behind")
    for watches in again:
        other = _pipeline(ctx, watches)
        if other is not None and (best is None or _score(other[1]) > _score(best[1])):
            best = other
    return best


def _host_bound(attempt: Attempt | None) -> bool:
    """The plan's step waits on the host for at least ``HOST_STALL_SHARE`` of its time."""
    if attempt is None or not attempt[1].feasible:
        return False
    result = attempt[1]
    return result.stall_s.get("host", 0.0) >= HOST_STALL_SHARE * result.step_time_s


def _baseline(ctx: PlanContext, strategy: Callable[[PlanContext], Attempt | None]
              ) -> Attempt | None:
    """A baseline's plan as a start of the search (NOTE [starting points]), or None where
    that baseline cannot plan this step: it is one candidate among others, and SlackSwap
    plans without it (its plans are held to what the runtime can do by
    ``PlanContext.plan``, so this is a guard, not a filter)."""
    try:
        return ctx.attempt(strategy)
    except SlackSwapError:
        return None


def _pipeline(ctx: PlanContext, watches: str | None = None) -> Attempt | None:
    """Every stage of NOTE [starting points]; with ``watches``, the fixed costs of each
    operation priced: covers with the host's watches, priced as ``watches`` says (NOTE
    [watch columns] in :mod:`slackswap.planners.recompute`), and no copy in the slack
    that the link's latency dominates (``latency_bound``)."""
    cands = ctx.candidates
    cost = {c.name: rebuild_cost(ctx, c) for c in cands}
    # per byte of everything the producer saves: rebuilding one output rebuilds them all
    made = defaultdict(int)
    for c in cands:
        made[c.producer] += c.bytes
    order = sorted(cands, key=lambda c: (-cost[c.name] / made[c.producer], c.producer))
    eligible = [c for c in order if not (watches and latency_bound(ctx, c))]
    best: Attempt | None = None
    starts: list[Attempt] = []
    offloads: list[list[Candidate]] = []
    slack = offload_within_slack(ctx, eligible)
    for offload in _fractions(slack):
        offloads.append(offload)
        attempt = _hybrid(ctx, offload, watches=watches)
        if attempt is not None:
            starts.append(attempt)
        if attempt is not None and attempt[1].feasible and (
                best is None or attempt[1].retention > best[1].retention):
            best = attempt
        if best is not None and best[1].stall_s["reload"] == best[1].stall_s["memory"] == 0:
            break  # the copies hide entirely: spending less slack only adds recompute
        if (_stops_past_best(ctx) and best is not None and attempt is not None
                and attempt[1].feasible and attempt[1].retention < best[1].retention):
            break  # past the best, less slack only adds recompute (NOTE [slack])
    covered = best is not None  # a slack-first cover fits
    best = or_uniform(ctx, best, "slackswap", (Decision.OFFLOAD, Decision.RECOMPUTE))
    if best is not None:
        starts.append(best)
    for start in STARTS:  # NOTE [starting points]
        other = _baseline(ctx, start)
        if other is not None:
            starts.append((ctx.plan("slackswap", dict(other[0].decisions)), other[1]))
    if not any(a[1].feasible for a in starts):  # nothing fits yet: keep-all and each
        names = [c.name for c in ctx.candidates]  # uniform plan are starts too
        for d in (Decision.KEEP, Decision.OFFLOAD, Decision.RECOMPUTE):
            plan = ctx.plan("slackswap", {n: d for n in names})
            starts.append((plan, ctx.simulate(plan)))

    def more() -> tuple[list[Attempt], list[Attempt], list[Attempt]]:  # each searched
        # apart: NOTE [starting points], NOTE [joint cover], NOTE [late slack]
        chained = [] if watches == "behind" and ctx.short_step else [
            a for offload in offloads for cover in CHAIN_COVERS
            if (a := _hybrid(ctx, offload, *cover, watches)) is not None]
        late = (offload_within_slack(ctx, eligible, late=True)
                if ctx.short_step else slack)
        later = [] if {c.name for c in late} == {c.name for c in slack} else [
            a for offload in _fractions(late)
            if (a := _hybrid(ctx, offload, watches=watches, late=True)) is not None]
        joint = [a for depth in JOINT_DEPTHS  # (the same in both runs: made in the first)
                 if not (covered or watches) and ctx.short_step
                 and (a := _joint(ctx, depth)) is not None]
        return chained, joint, later

    best = _multi_start(ctx, starts, more, watches)
    return with_prefetch_points(ctx, best) if best[1].feasible else best


def _multi_start(ctx: PlanContext, starts: list[Attempt],
                 more: Callable[[], tuple[list[Attempt], list[Attempt], list[Attempt]]],
                 watches: str | None = None) -> Attempt:
    """The local search from the best start, then from the next best while simulations
    of its budget are left (NOTE [starting points]), recompute-only's plan joining the
    starts, with the bound's LP solution rounded (``relaxed_plan``), once a search has
    settled with budget left (a short step: their own simulations and the LP are cheap
    there); the best plan found."""
    # where nothing fits yet, one search's budget for each of the four kinds of start
    budget = _search_budget(ctx)
    left = budget * (1 if any(a[1].feasible for a in starts) else 4)
    patience = max(SEARCH_PATIENCE, budget // 3)
    pending = sorted(starts, key=lambda a: _score(a[1]), reverse=True)
    seen: set[tuple] = set()
    best: Attempt | None = None
    joined = False
    while pending and (best is None or left > 0):
        start = pending.pop(0)
        key = tuple(sorted(start[0].decisions.items()))
        if key in seen:
            continue
        seen.add(key)
        found, left = _local_search(ctx, start, left, patience)
        if best is None or _score(found[1]) > _score(best[1]):
            best = found
        if left > 0 and not joined:
            joined = True
            other = _baseline(ctx, baselines.recompute_only)
            if other is not None:
                pending.append((ctx.plan("slackswap", dict(other[0].decisions)), other[1]))
            pending.sort(key=lambda a: _score(a[1]), reverse=True)
            if (relaxed := ctx.attempt(relaxed_plan)) is not None:  # first: it often
                # does not fit (worked out once: the second run of a short step reuses it)
                plan = ctx.plan("slackswap", relaxed)  # as rounded, yet starts a search
                pending.insert(0, (plan, ctx.simulate(plan)))  # in another basin
                left -= 1
    assert best is not None
    if budget > SEARCH_SIMULATIONS:  # a short step: NOTE [starting points]
        chained, joint, later = more()
        best = _searched_apart(ctx, best, chained, budget, patience)
        polish = ctx.short_step  # (the grouped and perturbed searches double a whole
        # workload's plan time)
        if polish:
            best = _checkpoint_kicks(ctx, best, budget, patience)
        if watches is None and EXCHANGE_SIMULATIONS * len(ctx.candidates) <= budget:
            best = _offload_exchanges(ctx, best, budget, patience)
        best, _ = _local_search(ctx, best, budget, patience, swaps=True)
        if polish:
            best, _ = _local_search(ctx, best, budget, patience, swaps=True, groups=True)
            best = _recompute_releases(ctx, best, budget)
            best = perturbed_search(ctx, best, budget)  # NOTE [perturbed search]
        best = _searched_apart(ctx, best, joint, budget, patience)
        best = _searched_apart(ctx, best, later, budget, patience)
        if polish:
            best = _link_room(ctx, best, budget, patience)
    return best


def _stops_past_best(ctx: PlanContext) -> bool:
    """Whether the slack fractions stop at the first plan past the best (NOTE [slack]):
    on a whole workload."""
    return not ctx.short_step


def _fractions(slack: list[Candidate]) -> list[list[Candidate]]:
    """The offload sets that spend each of ``SLACK_FRACTIONS`` of ``slack``'s bytes, the
    most expensive to rebuild first (``slack``'s order)."""
    total, sets = sum(c.bytes for c in slack), []
    for fraction in SLACK_FRACTIONS:
        offload, spent = [], 0
        for c in slack:
            if spent + c.bytes <= fraction * total:
                offload.append(c)
                spent += c.bytes
        sets.append(offload)
    return sets


def _searched_apart(ctx: PlanContext, best: Attempt, starts: list[Attempt], budget: int,
                    patience: int, swaps: bool = False) -> Attempt:
    """The better of ``best`` and a local search of its own from the best of ``starts``
    (NOTE [starting points])."""
    if not starts:
        return best
    found, _ = _local_search(ctx, max(starts, key=lambda a: _score(a[1])), budget, patience,
                             swaps)
    return found if _score(found[1]) > _score(best[1]) else best


def _search_budget(ctx: PlanContext) -> int:
    """Simulations the local search may run: ``SEARCH_SIMULATIONS``, or ``SEARCH_OPS``
    simulated ops when that is more, and on a step of few candidates enough for several
    passes of single and pair moves."""
    n = len(ctx.candidates)
    return max(SEARCH_SIMULATIONS, SEARCH_OPS // len(ctx.profile.ops)) + (
        400 if n <= PAIR_SEARCH_CANDIDATES else 8 * n if n <= 16 else 0)


def _decisions_of(plan: Plan) -> Callable[[Candidate], str]:
    return lambda c: plan.decisions.get(c.name, Decision.KEEP)


def _local_search(ctx: PlanContext, best: Attempt, left: int,
                  patience: int | None = None, swaps: bool = False,
                  groups: bool = False) -> tuple[Attempt, int]:
    """Passes of single-activation moves within ``left`` simulations (NOTE [starting
    points]): each recomputed activation offloaded instead, the longest wait from
    production to backward use first (its copy has the most compute to hide under);
    each offloaded one recomputed instead, largest first; each moved one kept, smallest
    first; and, while the plan does not fit, each kept one moved. A move is kept when
    the simulated plan scores better (``_score``). After ``patience`` simulations in a
    row that found nothing better the search has settled, and none are left. With
    ``groups``, a producer's recomputed outputs are offloaded together too, and a move
    that ends a recompute leaves out the checkpoints no rebuild reads any more
    (``_with_siblings``, ``_orphans_left_out``). The best attempt, and the simulations
    left."""
    n = len(ctx.candidates)
    stale = 0
    recomputable = ctx.profile.recomputable
    improved = True
    while improved and left > 0:
        improved = False
        now = _decisions_of(best[0])
        moves = sorted(((c, Decision.OFFLOAD) for c in ctx.candidates
                        if now(c) == Decision.RECOMPUTE),
                       key=lambda m: (m[0].produced_at - m[0].needed_at, m[0].producer))
        moves += [(c, Decision.RECOMPUTE) for c in sorted(ctx.candidates,
                                                   key=lambda c: (-c.bytes, c.producer))
                  if now(c) == Decision.OFFLOAD and c.name in recomputable]
        moves += [(c, Decision.KEEP) for c in sorted(ctx.candidates,
                                              key=lambda c: (c.bytes, c.producer))
                  if now(c) != Decision.KEEP]
        if not best[1].feasible:
            moves += [(c, d) for c in sorted(ctx.candidates,
                                             key=lambda c: (-c.bytes, c.producer))
                      if now(c) == Decision.KEEP for d in (Decision.OFFLOAD, Decision.RECOMPUTE)
                      if d == Decision.OFFLOAD or c.name in recomputable]
        together, alone = _checkpoint_moves(ctx, best[0])
        single = [{c.name: d} for c, d in moves] if not groups else [
            _orphans_left_out(ctx, best[0].decisions, change)
            for change in _with_siblings(ctx, now, moves)]
        for change in together + single + alone:
            if left == 0:
                break
            left -= 1
            decisions = {**best[0].decisions, **change}
            for name in [n for n, d in change.items() if d is None]:
                del decisions[name]  # a checkpoint left to be rebuilt
            plan = ctx.plan("slackswap", decisions)
            result = ctx.simulate(plan)
            if _improves(result, best[1]):
                best, improved, stale = (plan, result), True, 0
            else:
                stale += 1
                if patience is not None and stale >= patience:
                    return best, 0
        if not improved and n <= PAIR_SEARCH_CANDIDATES:
            best, improved, left = _pair_moves(ctx, best, left)
        elif not improved and swaps:
            best, improved, left = _swap_moves(ctx, best, left, patience or left)
    return best, left


def _improves(result: SimResult, best: SimResult) -> bool:
    """A move's test: it scores better, and where ``best`` fits, by more than
    rounding."""
    return scores_better(_score(result), _score(best))


def _swap_moves(ctx: PlanContext, best: Attempt, left: int,
                patience: int) -> tuple[Attempt, bool, int]:
    """Where single moves are stuck: the first swap that scores better, a moved
    activation kept and a kept one offloaded or recomputed in its place, within ``left``
    simulations and at most ``patience`` of them; the attempt, whether it improved, the
    simulations left. The swaps that move at least the bytes they keep come first, the
    closest match first: on bert-large-mlm@1 at 50% the one to the exact model's proven
    optimum (a 32 MiB offload kept, a 32 MiB kept tensor offloaded) is the 13th tried;
    with the largest kept tensor first, the search's best swap there was the 279th."""
    now = _decisions_of(best[0])
    recomputable = ctx.profile.recomputable
    moved = [c for c in ctx.candidates if now(c) != Decision.KEEP]
    kept = [c for c in ctx.candidates if now(c) == Decision.KEEP]
    pairs = sorted(((a, b) for a in moved for b in kept), key=_closest_match)
    tries = min(left, patience)
    for a, b in pairs:
        for d in (Decision.OFFLOAD, Decision.RECOMPUTE):
            if d == Decision.RECOMPUTE and b.name not in recomputable:
                continue
            if tries == 0:
                return best, False, left
            left, tries = left - 1, tries - 1
            plan = ctx.plan("slackswap", {**best[0].decisions, a.name: Decision.KEEP,
                                          b.name: d})
            result = ctx.simulate(plan)
            if _improves(result, best[1]):
                return (plan, result), True, left
    return best, False, left


def _closest_match(pair: tuple[Candidate, Candidate]) -> tuple:
    """Order of swaps (``a`` kept, ``b`` moved): those that move at least the bytes they
    keep first, the closest match in bytes first."""
    a, b = pair
    return b.bytes < a.bytes, abs(b.bytes - a.bytes), a.producer, b.producer


def _checkpoint_kicks(ctx: PlanContext, best: Attempt, budget: int,
                      patience: int) -> Attempt:
    """From ``best``: the checkpoints that save rebuilds the most time (``KICKS``), each
    kept with every activation whose rebuild reads it recomputed, then searched with swap
    moves too (NOTE [starting points]); the best plan found."""
    p = ctx.profile
    issue = ctx.hw.host.dispatch_s + ctx.hw.host.replay_s
    groups: dict[str, dict[str, str]] = {}
    saves: dict[str, float] = defaultdict(float)
    for c in ctx.candidates:
        if c.name not in p.recomputable:
            continue
        for _, u, q in chain_edges(p, c.producer):
            t = p.tensors[u]
            if t.name in p.checkpointable and t.bytes >= MIN_PLANNED_BYTES:
                groups.setdefault(t.name, {t.name: Decision.KEEP})[c.name] = Decision.RECOMPUTE
                saves[t.name] += chain_seconds(p, q, issue)
    for name in sorted(groups, key=lambda n: (-saves[n], n))[:KICKS]:
        plan = ctx.plan("slackswap", {**best[0].decisions, **groups[name]})
        start = (plan, ctx.simulate(plan))
        found, _ = _local_search(ctx, start, budget, patience, swaps=True)
        found = _recompute_trades(ctx, found, budget, patience)
        if _score(found[1]) > _score(best[1]):
            best = found
    return best


def _recompute_trades(ctx: PlanContext, start: Attempt, budget: int,
                      patience: int) -> Attempt:
    """From ``start`` (NOTE [starting points]): one recomputed activation kept and one
    other recomputed instead, where the budget covers simulating every such trade with no
    memory limit; ranked by the step time a trade saves per byte it leaves to free, the
    first ``TRADES`` each followed by offload moves alone (``_offload_search``), all
    within ``budget`` simulations. The best of ``start`` and those."""
    now = _decisions_of(start[0])
    recomputable = ctx.profile.recomputable
    recomputed = [c for c in ctx.candidates if now(c) == Decision.RECOMPUTE]
    others = [c for c in ctx.candidates
              if now(c) != Decision.RECOMPUTE and c.name in recomputable]
    if not recomputed or len(recomputed) * len(others) > budget:
        return start
    spent = ctx.simulations
    base = ctx.simulate_unlimited(start[0]).step_time_s
    trades = []
    for a in recomputed:
        for b in others:
            if b.bytes >= a.bytes:
                continue  # frees no more than it keeps: nothing for offloads to cover
            plan = ctx.plan("slackswap", {**start[0].decisions, a.name: Decision.KEEP,
                                          b.name: Decision.RECOMPUTE})
            saved = base - ctx.simulate_unlimited(plan).step_time_s
            if saved > 0:
                trades.append((-saved / (a.bytes - b.bytes), a.producer, b.producer, plan))
    best = start
    for *_, plan in sorted(trades, key=lambda t: t[:3])[:TRADES]:
        left = budget - (ctx.simulations - spent)
        if left <= 0:
            break
        found = _offload_search(ctx, (plan, ctx.simulate(plan)), left, patience)
        if _score(found[1]) > _score(best[1]):
            best = found
    return best


RELEASE_TRIES = (4, 16)  # offloads of one, and of two, tried per recompute released


def _recompute_releases(ctx: PlanContext, start: Attempt, budget: int) -> Attempt:
    """From ``start`` (NOTE [starting points]): each recomputed activation kept, the most
    expensive rebuild first, the memory it takes back freed by one or two kept
    activations offloaded, those that free at least the shortfall at the least cost
    first (a cost: the retention an offload alone takes from ``start``). The best of
    ``start`` and those, within ``budget`` simulations."""
    now = _decisions_of(start[0])
    recomputed = sorted((c for c in ctx.candidates if now(c) == Decision.RECOMPUTE),
                        key=lambda c: (-rebuild_cost(ctx, c), c.producer))
    kept = [c for c in ctx.candidates if now(c) == Decision.KEEP and not latency_bound(ctx, c)]
    tries = 1 + sum(RELEASE_TRIES)
    if not recomputed or not start[1].feasible or len(kept) + tries * len(recomputed) > budget:
        return start
    cost: dict[str, float] = {}
    for c in kept:
        alone = ctx.simulate(ctx.plan("slackswap", {**start[0].decisions,
                                                    c.name: Decision.OFFLOAD}))
        cost[c.name] = (start[1].retention - alone.retention if alone.feasible
                        else float("inf"))
    best = start
    for a in recomputed:
        released = {**start[0].decisions, a.name: Decision.KEEP}
        plan = ctx.plan("slackswap", released)
        result = ctx.simulate(plan)
        if result.feasible:  # (the memory was there: nothing to offload)
            best = (plan, result) if _improves(result, best[1]) else best
            continue
        short = result.shortfall_bytes
        ones = sorted((c for c in kept if c.bytes >= short),
                      key=lambda c: (cost[c.name], c.bytes, c.producer))[:RELEASE_TRIES[0]]
        twos = sorted(((b, c) for i, b in enumerate(kept) for c in kept[i + 1:]
                       if b.bytes + c.bytes >= short),
                      key=lambda bc: (cost[bc[0].name] + cost[bc[1].name],
                                      bc[0].bytes + bc[1].bytes, bc[0].producer,
                                      bc[1].producer))[:RELEASE_TRIES[1]]
        for group in [(c,) for c in ones] + twos:
            plan = ctx.plan("slackswap", {**released,
                                          **{c.name: Decision.OFFLOAD for c in group}})
            result = ctx.simulate(plan)
            if _improves(result, best[1]):
                best = (plan, result)
    return best


def _link_room(ctx: PlanContext, start: Attempt, budget: int, patience: int) -> Attempt:
    """From ``start``: each recomputed activation offloaded, link time made for its copy by
    recomputing offloaded activations cheaper to rebuild (the cheapest per byte first,
    until they free its bytes), and a local search with swaps from the best of these;
    the better of ``start`` and that (NOTE [starting points])."""
    now = _decisions_of(start[0])
    recomputable = ctx.profile.recomputable
    cost = {c.name: rebuild_cost(ctx, c) for c in ctx.candidates}
    offloaded = sorted((o for o in ctx.candidates
                        if now(o) == Decision.OFFLOAD and o.name in recomputable),
                       key=lambda o: (cost[o.name] / o.bytes, o.producer))
    moves = []
    for c in ctx.candidates:
        if now(c) != Decision.RECOMPUTE:
            continue
        change, freed = {c.name: Decision.OFFLOAD}, 0
        for o in (o for o in offloaded if cost[o.name] < cost[c.name]):
            if freed >= c.bytes:
                break
            change[o.name] = Decision.RECOMPUTE
            freed += o.bytes
        if len(change) == 1:
            continue  # a single move: the local search's
        plan = ctx.plan("slackswap", {**start[0].decisions, **change})
        moves.append((plan, ctx.simulate(plan)))
    return _searched_apart(ctx, start, moves, budget, patience, swaps=True)


def _offload_search(ctx: PlanContext, best: Attempt, left: int, patience: int) -> Attempt:
    """Passes of offload moves alone, the recomputed activations and checkpoints as they
    are: each offloaded one kept (smallest first), each kept one offloaded (largest
    first), then swaps of an offloaded one kept for a kept one offloaded (the closest
    match in bytes first, as ``_swap_moves``); a move is kept when the plan scores better,
    and the search ends after ``patience`` simulations in a row without one, or ``left``."""
    stale, improved = 0, True
    while improved and left > 0:
        improved = False
        now = _decisions_of(best[0])
        off = [c for c in ctx.candidates if now(c) == Decision.OFFLOAD]
        kept = [c for c in ctx.candidates if now(c) == Decision.KEEP]
        changes = [{c.name: Decision.KEEP}
                   for c in sorted(off, key=lambda c: (c.bytes, c.producer))]
        changes += [{c.name: Decision.OFFLOAD}
                    for c in sorted(kept, key=lambda c: (-c.bytes, c.producer))]
        changes += [{a.name: Decision.KEEP, b.name: Decision.OFFLOAD}
                    for a, b in sorted(((a, b) for a in off for b in kept),
                                       key=_closest_match)]
        for change in changes:
            if left == 0:
                break
            left -= 1
            plan = ctx.plan("slackswap", {**best[0].decisions, **change})
            result = ctx.simulate(plan)
            if _improves(result, best[1]):
                best, improved, stale = (plan, result), True, 0
                break  # the lists are made again from the new plan
            stale += 1
            if stale >= patience:
                return best
    return best


def _offload_exchanges(ctx: PlanContext, best: Attempt, budget: int,
                       patience: int) -> Attempt:
    """From ``best``'s offload set: each set one activation away (one taken out, then
    one added, the largest first), covered again (``_hybrid``, every cover kind); the
    first whose cover rates better than the current set's is taken, with a local search
    from it, until none is or ``budget`` simulations are spent. The best plan found."""
    cands = ctx.candidates
    largest = sorted(cands, key=lambda c: (-c.bytes, c.producer))
    spent = ctx.simulations

    @functools.cache  # a move can return to a set already covered
    def cover(offload: frozenset[str]) -> Attempt | None:
        chosen = [c for c in cands if c.name in offload]
        found = [a for kind in ((False, False), *CHAIN_COVERS)
                 if (a := _hybrid(ctx, chosen, *kind)) is not None]
        return max(found, key=lambda a: _score(a[1]), default=None)

    offload = frozenset(c.name for c in cands
                        if best[0].decisions.get(c.name) == Decision.OFFLOAD)
    current = cover(offload)
    improved = current is not None
    while improved:
        improved = False
        moves = [offload - {c.name} for c in largest if c.name in offload]
        moves += [offload | {c.name} for c in largest if c.name not in offload]
        for other in moves:
            if ctx.simulations - spent >= budget:
                return best
            found = cover(other)
            if found is not None and _improves(found[1], current[1]):
                offload, current, improved = other, found, True
                searched, _ = _local_search(ctx, found, budget - (ctx.simulations - spent),
                                            patience)
                if _score(searched[1]) > _score(best[1]):
                    best = searched
                break
    return best


Change = dict[str, Decision | None]  # new decisions; None: a checkpoint left to be rebuilt


def _checkpoint_moves(ctx: PlanContext, plan: Plan) -> tuple[list[Change], list[Change]]:
    """Moves of the tensors autograd never saved that a rebuild of ``plan`` reads (directly
    or through another such tensor): all of them offloaded, or kept, as checkpoints at
    once (as torchtune offloads every block input), and each one offloaded, kept or left
    to be rebuilt; and each checkpoint no rebuild reads any more left out."""
    checkpointable = ctx.profile.checkpointable
    offloadable = ctx.profile.offloadable_checkpoints
    read = _read_checkpoints(ctx, plan.decisions)

    together: list[Change] = []
    for d in (Decision.OFFLOAD, Decision.KEEP):
        # one forward changes in place is kept, as ``PlanContext.plan`` would have it
        change: Change = {n: Decision.KEEP if n not in offloadable else d for n in read}
        if change not in together and any(plan.decisions.get(n) != c
                                          for n, c in change.items()):
            together.append(change)
    alone: list[Change] = [{n: d} for n in read for d in (Decision.OFFLOAD, Decision.KEEP, None)
                           if d != plan.decisions.get(n)
                           and (d != Decision.OFFLOAD or n in offloadable)]
    alone += [{n: None} for n in plan.decisions if n in checkpointable and n not in read]
    return together, alone


def _read_checkpoints(ctx: PlanContext, decisions: dict[str, str]) -> dict[str, None]:
    """The checkpointable tensors a rebuild under ``decisions`` reads, directly or through
    another never-saved tensor, in the order rebuilds reach them."""
    p = ctx.profile
    checkpointable, unsaved = p.checkpointable, p.never_saved
    read: dict[str, None] = {}
    frontier = [u for c in ctx.candidates if decisions.get(c.name) == Decision.RECOMPUTE
                for u in p.ops[c.producer].inputs if u in unsaved]
    for _ in range(2):
        deeper = []
        for u in dict.fromkeys(frontier):
            t = p.tensors[u]
            if t.name in checkpointable:
                read[t.name] = None
            deeper += [w for w in p.ops[t.producer].inputs if w in unsaved]
        frontier = deeper
    return read


def _with_siblings(ctx: PlanContext, now: Callable[[Candidate], str],
                   moves: list[tuple[Candidate, str]]) -> list[Change]:
    """Each move, and before a recompute's first move to offload, the same move of every
    recomputed output of its producer at once: while one of them is recomputed, the
    producer re-runs for all (a dropout's output and its mask)."""
    recomputed: dict[int, list[Candidate]] = defaultdict(list)
    for c in ctx.candidates:
        if now(c) == Decision.RECOMPUTE:
            recomputed[c.producer].append(c)
    changes: list[Change] = []
    for c, d in moves:
        group = recomputed.pop(c.producer, []) if d == Decision.OFFLOAD else []
        if len(group) > 1:
            changes.append({s.name: d for s in group})
        changes.append({c.name: d})
    return changes


def _orphans_left_out(ctx: PlanContext, decisions: dict[str, str], change: Change
                      ) -> Change:
    """``change`` to ``decisions`` and, where it ends a recompute, the checkpoints no
    rebuild reads any more left out with it: kept, one holds memory for nothing,
    offloaded, link time. As a move of its own each such pair is two steps, and the first
    alone is worse (one bert-large-mlm layer at 50% on h100-sxm: the embeddings' dropout
    output and mask offloaded instead of recomputed, their layer norm's checkpoint left
    out, 67.78 to 69.89%; either half alone, lower)."""
    after = {**decisions, **change}
    checkpointable = ctx.profile.checkpointable
    held = [n for n, d in after.items() if n in checkpointable and d is not None]
    if not held or not any(decisions.get(n) == Decision.RECOMPUTE for n in change):
        return change
    read = _read_checkpoints(ctx, after)
    return {**change, **{n: None for n in held if n not in read}}


def _pair_moves(ctx: PlanContext, best: Attempt, left: int) -> tuple[Attempt, bool, int]:
    """On a step of few candidates, where single moves are stuck: the first pair of
    moves, taken together, that scores better (two activations traded at once), within
    ``left`` simulations; the attempt, whether it improved, and the simulations left."""
    now = _decisions_of(best[0])
    recomputable = ctx.profile.recomputable
    options = [(c, d) for c in ctx.candidates for d in Decision
               if d != now(c) and (d != Decision.RECOMPUTE or c.name in recomputable)]
    for i, (a, da) in enumerate(options):
        for b, db in options[i + 1:]:
            if a.name == b.name:
                continue
            if left == 0:
                return best, False, 0
            left -= 1
            plan = ctx.plan("slackswap", {**best[0].decisions, a.name: da, b.name: db})
            result = ctx.simulate(plan)
            if _improves(result, best[1]):
                return (plan, result), True, left
    return best, False, left


def _hybrid(ctx: PlanContext, offload: list[Candidate], checkpoints: bool = False,
            shared: bool = False, watches: str | None = None, late: bool = False
            ) -> Attempt | None:
    offloaded = {c.name for c in offload}
    rest = [c for c in ctx.candidates if c.name not in offloaded]

    def make(margin: int):
        points = pressure_points(ctx, margin)
        credit = eviction_credit(ctx, offload, [pt.op for pt in points], late)
        cover = choose_cover(ctx, rest, points, credit, checkpoints, shared, watches)
        if cover is None:
            return None
        decisions: dict[str, str] = {c.name: Decision.OFFLOAD for c in offload}
        decisions.update(cover)
        return ctx.plan("slackswap", decisions)

    return fit_margin(ctx, make)


def _joint(ctx: PlanContext, depth: int) -> Attempt | None:
    """The joint cover's plan (NOTE [joint cover] in :mod:`slackswap.planners.joint`),
    fitted by margin as the others are."""

    def make(margin: int) -> Plan | None:
        decisions = choose_joint(ctx, pressure_points(ctx, margin, every=True), depth)
        return None if decisions is None else ctx.plan("slackswap", decisions)

    return fit_margin(ctx, make)
