"""Choose what to recompute at least cost: a 0-1 covering program solved with HiGHS.

Minimize the summed rebuild time of the recomputed activations so that, at every point
where the keep-all step exceeds the budget, the recomputed bytes (with what offloads
already free there) cover the excess. PyTorch's ``activation_memory_budget`` knapsack,
extended to many memory points; solved through ``scipy.optimize.milp``.

NOTE [rebuild cost]
    A rebuild replays ops on both sides: the GPU runs each kernel, the host issues each
    (dispatch and the runtime's replay, NOTE [host model] in :mod:`slackswap.sim.host`).
    Back to back in backward, replayed ops go at the pace of the slower side, so each is
    priced at the longer of its kernel and its host time. With a cheap host that is the
    kernel time; when the host is the bottleneck, many small replays cost more than a few
    large ones, and the cover prefers fewer, larger recomputes. (Where the host is far
    ahead of the GPU this over-prices small replays; the simulator judges every plan.)
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slackswap.core.offloads import forward_packs as packs
from slackswap.core.plan import MIN_PLANNED_BYTES, Decision
from slackswap.core.profile import StepProfile
from slackswap.core.watched import forward_segments
from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import Pressure
from slackswap.planners.quiet import solver_output_off

__all__ = ["rebuild_cost", "kernel_cost", "chain_edges", "chain_seconds", "choose_recompute",
           "choose_cover", "CoverProgram", "solve_cover", "row_tie", "with_watches",
           "rebuild_ops"]


def rebuild_cost(ctx: PlanContext, c: Candidate) -> float:
    """Seconds to rebuild ``c``: its producer, plus any input that was never saved (those
    must be rebuilt too, whatever the plan), each op at the longer of its kernel and its
    host time (NOTE [rebuild cost])."""
    host = ctx.hw.host
    return chain_seconds(ctx.profile, c.producer, host.dispatch_s + host.replay_s)


def kernel_cost(ctx: PlanContext, c: Candidate) -> float:
    """GPU seconds of the kernels a rebuild of ``c`` replays (no host)."""
    return chain_seconds(ctx.profile, c.producer, 0.0)


def chain_seconds(p: StepProfile, producer: int, issue: float) -> float:
    """The rebuild chain's seconds, each op at least ``issue``; once per profile."""

    def make() -> float:
        seen: set[int] = set()

        def cost(op_index: int) -> float:
            if op_index in seen:
                return 0.0
            seen.add(op_index)
            op = p.ops[op_index]
            total = op.time_s if op.time_s >= issue else issue
            for tid in dict.fromkeys(op.inputs):
                if tid in p.never_saved:
                    total += cost(p.tensors[tid].producer)
            return total

        return cost(producer)

    return p.derived(f"rebuild cost {producer} {issue!r}", make)


_TIE = 1e-5
# Branch-and-bound nodes HiGHS may explore (the reference workloads' covers solve at
# the root). A node limit, unlike a time limit, stops at the same cover on any machine;
# past it the best cover found so far is used, and with none a greedy cover: a slow
# machine never turns a coverable budget into a refusal.
NODE_LIMIT = 1000
# ... and on a whole workload (not ``PlanContext.short_step``), where HiGHS finds its cover
# at the root and spends the nodes failing to prove it within the gap: gpt2-xl@24 at 50%
# took 1.15 s for a 273-column cover at 1000 nodes, 0.42 s at 100, the same cover; on
# the 126 sweep cases and eight of 12-24 layers no plan changed. At the root alone
# (chained covers too) no plan changed on the bert-large sweep (8 presets, 56 cases) nor
# on 23 cases of gpt2-xl, llama-7b and bert-large-mlm (3 presets each, 30-70%), and
# gpt2-xl@24 at 50% plans in 3.4 s, not 5.4
WHOLE_STEP_NODE_LIMIT = 1
# Covers within half a percent of the least rebuild time are taken: on the reference
# workloads at 50% the root's cover is the one 1000 nodes of branching keep (gpt2-xl:
# the same 207 activations, 43.10 ms; the search took 1.4 s of its plan time for it).
MIP_GAP = 5e-3
# ... and for the covers with chain columns (NOTE [chain columns]), which only seed a
# search: at 1000 nodes two of them took 9 s of gpt2-xl@24's 14 s plan at 50% (HiGHS
# stopped at the limit); at 100 the plan is 9 s, and the same in retention there and on
# bert-large-mlm@1 (50-70%), llama-7b@1 (70%), gpt2-xl@12 (50%), bert-large on gh200
# (30, 40%) and on h200 gpt2-xl@2 (90%) and llama-7b@1 (70%); a whole workload's
# limit, lower, holds for them too
CHAIN_NODE_LIMIT = 100
# ... and for the covers that price the host running behind (NOTE [watch columns]): one
# of llama-7b's at 30% on h200 took 5.4 s of a 9 s plan at 1000 nodes, two of
# bert-large's at 70% on h100-sxm 3.3 s each at 100, 2.4 and 2.0 s at 10, where the
# root's cover is the one kept. At the root alone no plan changed on the bert-large
# sweep (8 presets, 56 cases) and 62 runtime-test models, nor a retention on 32 short
# reference steps and 30 two-layer steps of six other families; bert-large at 30% on
# gh200 plans in 6.3 s, not 8.6
WATCH_NODE_LIMIT = 1
_KEEP_MS = 1e-6  # a checkpoint no rebuild needs is left out


def choose_recompute(
    ctx: PlanContext,
    candidates: list[Candidate],
    points: list[Pressure],
    credit: dict[int, int] | None = None,
) -> set[str] | None:
    """Names to recompute; ``credit[op]`` is what other evictions already free at ``op``.

    None when even recomputing every candidate cannot cover the excess.
    """
    cover = choose_cover(ctx, candidates, points, credit)
    return None if cover is None else {n for n, d in cover.items() if d == Decision.RECOMPUTE}


def choose_cover(
    ctx: PlanContext,
    candidates: list[Candidate],
    points: list[Pressure],
    credit: dict[int, int] | None = None,
    checkpoints: bool = False,
    shared: bool = False,
    watches: str | None = None,
) -> dict[str, Decision] | None:
    """Activations to recompute and, with ``checkpoints``, never-saved tensors to keep as
    checkpoints; ``shared``, each op a rebuild re-runs is paid once (NOTE [chain
    columns]); ``watches``, the host's cost of watching forward segments counts, each
    segment against its own lead (``"segments"``) or as the time the host runs behind
    (``"behind"``, NOTE [watch columns]); ``credit[op]`` is what other evictions already
    free at ``op``.
    None when even recomputing every candidate cannot cover the excess."""
    credit = credit or {}
    candidates = [c for c in candidates if c.name in ctx.profile.recomputable]
    rows = [(pt, pt.excess - credit.get(pt.op, 0)) for pt in points]
    if not any(need > 0 for _, need in rows):
        return {}
    if not checkpoints:  # (a kept checkpoint can push a row with room over the budget)
        rows = _undominated([(pt, need) for pt, need in rows if need > 0], ctx.first_backward)
    if not candidates:
        return None
    # the same cover is asked for again and again (each offload fraction, margin and run
    # of a plan): a cover depends on nothing else, and HiGHS answers the same program
    # the same way, so the answer is kept (bart at 50%: 24 programs in 120 asks)
    key = (tuple(c.name for c in candidates), tuple((pt.op, need) for pt, need in rows),
           checkpoints, shared, watches)
    if key not in ctx.covers:
        ctx.covers[key] = _cover(ctx, candidates, rows, checkpoints, shared, watches)
    cover = ctx.covers[key]
    return None if cover is None else dict(cover)


def _cover(ctx: PlanContext, candidates: list[Candidate], rows: list[tuple[Pressure, int]],
           checkpoints: bool, shared: bool, watches: str | None
           ) -> dict[str, Decision] | None:
    """:func:`choose_cover` for rows that need room and candidates that can be rebuilt."""
    ops = np.array([pt.op for pt, _ in rows])
    need = np.array([need / 1e9 for _, need in rows])
    size = np.array([c.bytes / 1e9 for c in candidates])
    # which candidates a recompute takes off the device at each row (``evicted_at``)
    forward = ops < ctx.first_backward
    away = np.where(forward[:, None],
                    np.array([c.freed_op for c in candidates])[None, :] < ops[:, None],
                    np.array([c.first_use for c in candidates])[None, :] > ops[:, None])
    if np.any(away @ size < need):
        return None
    tie = row_tie(ctx, candidates)
    cost = np.array([rebuild_cost(ctx, c) for c in candidates]) * tie
    program = CoverProgram(cost=cost, size=size, away=away)
    node_limit = NODE_LIMIT if ctx.short_step else WHOLE_STEP_NODE_LIMIT
    if checkpoints or shared:
        program = _with_chains(ctx, candidates, ops, forward, tie, program, checkpoints,
                               shared)
        node_limit = min(node_limit, CHAIN_NODE_LIMIT)
    if watches:
        program = with_watches(ctx, candidates, program, behind=watches == "behind")
        if watches == "behind":
            node_limit = min(node_limit, WATCH_NODE_LIMIT)
    res = solve_cover(program, forward, need, node_limit)
    chosen = res if res is not None else _greedy_cover(away * size, need, cost)
    recomputed = [c for c, x in zip(candidates, chosen, strict=False) if x]
    kept = {name for name, x in zip(program.kept, chosen[len(size):], strict=False) if x}
    cover = {c.name: Decision.RECOMPUTE for c in recomputed}
    cover.update({name: Decision.KEEP for name in _read(ctx.profile, recomputed, kept)})
    return cover


def with_watches(ctx: PlanContext, candidates: list[Candidate], program: CoverProgram,
                 behind: bool = False) -> CoverProgram:
    """``program`` with a column per forward segment a recompute makes the runtime watch
    (NOTE [watch columns]); with ``behind``, and one for the time forward loses to the
    host.

    NOTE [watch columns]
        The runtime watches each forward module segment that holds an op a rebuild
        re-runs (``core/watched.py``), at ``watch_s`` of host time per op: a column per
        such segment, at least every column of a recompute whose rebuild re-runs an op
        in it, paid once however many rebuilds it serves. Where the GPU is well ahead of
        the host, watching hides; where the host is behind, a watch is the step's time.
        Two prices, each in a run of its own (NOTE [starting points] in
        :mod:`slackswap.planners.slackswap`), the simulator judging:
        - each segment alone: its watch beyond the GPU's lead at its first op (the op's
          keep-all start less the host's dispatches and packs by then). At the start of
          forward, where embedding lookups take microseconds: on two bert-large-mlm
          layers at 60%, recomputing the embeddings' dropout output costs 0.17 ms more
          host stall than the best plan pays. Leads consumed by earlier watches are not
          counted, so on a whole step, where the GPU's lead grows layer by layer, every
          later segment looks free;
        - ``behind``: the host issues forward op c once it has paid every dispatch,
          pack and watch before it, and the keep-all GPU starts c at its keep-all start;
          forward loses ``phi``, the most by which the first exceeds the second, and
          every op after it starts that much later. A running sum of the watched
          segments' time in forward order, and ``phi`` at a millisecond per millisecond,
          at least the sum less the GPU's lead at each segment's last op (and at the
          ops up to the next one). On 24 Mistral layers at 30% on h100-sxm the plan
          priced by segment watched 65 ms of a 90 ms forward and waited 19 ms on the
          host (88.69%); priced behind, 0.2 ms (92.41%).
    """
    p, host = ctx.profile, ctx.hw.host
    if not p.module_events or host.watch_s == 0:
        return program

    fb = ctx.first_backward
    lead, watchable = _watchable(ctx, candidates)
    cost, rows = list(program.cost), list(program.rows)
    upper = list(np.ones(len(cost)) if program.upper is None else program.upper)

    def column(ms: float, top: float) -> int:
        cost.append(ms)
        upper.append(top)
        return len(cost) - 1

    if not behind:
        for start, _, ms, held in watchable:
            excess = ms - max(float(lead[start]), 0.0)
            if excess > 0:
                seg = column(excess, 1.0)
                rows += [({seg: 1.0, i: -1.0}, 0.0, np.inf) for i in held]
        return dataclasses.replace(program, cost=np.array(cost), upper=np.array(upper),
                                   rows=rows)
    if not watchable or fb == 0:
        return program
    phi = column(1.0, np.inf)
    rows.append(({phi: 1.0}, max(0.0, -float(lead[:fb].min())), np.inf))  # packs alone
    running = None
    lasts = [min(end, fb) - 1 for _, end, _, _ in watchable]
    for k, ((_, _, ms, held), last) in enumerate(zip(watchable, lasts, strict=True)):
        seg = column(0.0, 1.0)
        rows += [({seg: 1.0, i: -1.0}, 0.0, np.inf) for i in held]
        total = column(0.0, np.inf)  # the running sum: at least the one before plus this
        row = {total: 1.0, seg: -ms}
        if running is not None:
            row[running] = -1.0
        rows.append((row, 0.0, np.inf))
        running = total
        upto = lasts[k + 1] if k + 1 < len(lasts) else fb
        rows.append(({phi: 1.0, total: -1.0}, -float(lead[last:max(upto, last + 1)].min()),
                     np.inf))
    return dataclasses.replace(program, cost=np.array(cost), upper=np.array(upper), rows=rows)


def _watchable(ctx: PlanContext, candidates: list[Candidate]
               ) -> tuple[np.ndarray, list[tuple[int, int, float, list[int]]]]:
    """Per op, the GPU's lead over the host in keep-all, in ms (negative: the host is
    behind), its dispatches and packs paid; and per forward segment a recompute would
    make the runtime watch: (first op, one past the last, its watch in ms, the
    candidates whose rebuild re-runs an op in it)."""
    p, host = ctx.profile, ctx.hw.host
    issue = np.full(len(p.ops), host.dispatch_s)
    for _, before in packs(p):
        issue[min(before, len(p.ops) - 1)] += host.pack_s
    lead = (np.array(ctx.op_start) - np.cumsum(issue)) * 1e3
    segments = forward_segments(p)
    starts = [start for start, _ in segments]
    readers: dict[int, list[int]] = defaultdict(list)  # segment -> candidates re-running in it
    for i, c in enumerate(candidates):
        held = {k for q in rebuild_ops(p, c.producer)
                if (k := bisect_right(starts, q) - 1) >= 0 and q < segments[k][1]}
        for k in held:
            readers[k].append(i)
    watchable = [(start, end, host.watch_s * 1e3 * (end - start), readers[k])
                 for k, (start, end) in enumerate(segments) if readers.get(k) and end > start]
    return lead, watchable


def row_tie(ctx: PlanContext, candidates: list[Candidate]) -> np.ndarray:
    """Per candidate, seconds to the covers' milliseconds, with equal costs (activations
    of the same size and kind in different blocks) broken towards the earlier-made ones,
    rebuilt later in backward: which of several equal sets HiGHS returns otherwise turns
    on the shape of the memory curve."""
    n = len(ctx.profile.ops)
    return np.array([1e3 * (1 + _TIE * c.producer / n) for c in candidates])


def _read(p: StepProfile, recomputed: list[Candidate], kept: set[str]) -> list[str]:
    """The checkpoints of ``kept`` the rebuilds of ``recomputed`` read (a solve within
    its gap may keep one that none reads, or one behind another kept)."""
    read, seen = [], set()
    stack = [c.producer for c in recomputed]
    while stack:
        for tid in p.ops[stack.pop()].inputs:
            name = p.tensors[tid].name
            if tid not in p.never_saved or tid in seen:
                continue
            seen.add(tid)
            if name in kept:
                read.append(name)
            else:
                stack.append(p.tensors[tid].producer)
    return read


@dataclass
class CoverProgram:
    """A cover's columns: cost (ms), bytes (GB) off the device at each row where
    ``away``, these columns 0-1; after them any other columns, continuous in [0,
    ``upper``] (1 unless given): op columns (NOTE [chain columns]), say. Checkpoint
    columns (``kept``) come right after the candidates, with negative bytes (held on
    the device). ``terms`` (row, column, GB) add to a row's bytes off the device from
    that row on in its nested order (NOTE [nested rows]); ``rows`` are further
    constraints, ``lo <= sum(coefficient * column) <= hi``."""

    cost: np.ndarray
    size: np.ndarray
    away: np.ndarray
    kept: list[str] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    terms: list[tuple[int, int, float]] = field(default_factory=list)
    upper: np.ndarray | None = None


def _with_chains(ctx: PlanContext, candidates: list[Candidate], ops: np.ndarray,
                 forward: np.ndarray, tie: np.ndarray, base: CoverProgram, checkpoints: bool,
                 shared: bool) -> CoverProgram:
    """``base`` with a column per op its rebuilds re-run, the candidates' columns
    costing nothing (NOTE [chain columns]).

    NOTE [chain columns]
        A rebuild re-runs its producer and every never-saved tensor's producer it reads,
        unless the plan keeps that tensor as a checkpoint (``checkpoints``: a column
        ``k_u`` for each that may be kept). Each op ``q`` of candidate ``i``'s chain has
        a column ``y_iq >= y_parent - k_u`` at ``q``'s cost (the parent is ``x_i`` or
        the op that reads ``u``, the tensor ``q`` makes), or, ``shared``, one column
        ``r_q`` per op, whichever rebuilds need it, as the simulator re-runs a producer
        once for the siblings it recomputes (a sibling is then rebuilt at the earliest
        first use, which the rows do not see: the simulator judges). A kept ``k_u``
        holds ``u``'s bytes at forward rows past its last forward use and at backward
        rows before the last first use of a candidate whose chain reads it. Kept, bert's
        output dense result makes the output dropout and residual add cheap to rebuild;
        on llama-7b@1 at 70% the search from these covers' plans reaches 97.0%, not 95.7%.
    """
    p = ctx.profile
    issue = ctx.hw.host.dispatch_s + ctx.hw.host.replay_s
    keepable = {t.id: t for t in p.checkpointable.values()
                if checkpoints and t.id in p.never_saved and t.bytes >= MIN_PLANNED_BYTES
                and t.id not in p.changed_in_place}
    k = len(candidates)
    chains = [chain_edges(p, c.producer) for c in candidates]
    kept: dict[int, int] = {}  # tensor -> column offset among the checkpoints
    release: dict[int, int] = {}
    for c, edges in zip(candidates, chains, strict=True):
        for _, u, _ in edges:
            if u in keepable:
                kept.setdefault(u, len(kept))
                release[u] = max(release.get(u, 0), c.first_use)
    held = np.zeros((len(ops), len(kept)), dtype=bool)
    for u, j in kept.items():
        t = keepable[u]
        last = max([t.producer, *(q for q in t.forward_consumers if q < ctx.first_backward)])
        held[:, j] = np.where(forward, ops > last, ops < release[u])
    cost: list[float] = [0.0] * k + [_KEEP_MS] * len(kept)
    rows: list[dict[int, float]] = []

    def column(q: int, i: int) -> int:
        cost.append(max(p.ops[q].time_s, issue) * tie[i])
        return len(cost) - 1

    shared_node: dict[int, int] = {}
    for i, (c, edges) in enumerate(zip(candidates, chains, strict=True)):
        node = shared_node if shared else {}
        for q in (c.producer, *(r for _, _, r in edges)):
            if q not in node:
                node[q] = column(q, i)
        rows.append({node[c.producer]: 1.0, i: -1.0})
        for parent, u, q in edges:
            row = {node[q]: 1.0, node[parent]: -1.0}
            if u in kept:
                row[k + kept[u]] = 1.0
            rows.append(row)
    sizes = np.array([keepable[u].bytes / 1e9 for u in kept])
    return CoverProgram(cost=np.array(cost), size=np.concatenate([base.size, -sizes]),
                        away=np.concatenate([base.away, held], axis=1),
                        kept=[keepable[u].name for u in kept], rows=[
                            (r, 0.0, np.inf)
                            for r in {tuple(sorted(r.items())): r for r in rows}.values()])


def rebuild_ops(p: StepProfile, producer: int) -> list[int]:
    """The ops a rebuild from ``producer`` re-runs: it, then each never-saved tensor's
    producer on its chain (``chain_edges``), each once, in that order."""
    return list(dict.fromkeys([producer, *(r for _, _, r in chain_edges(p, producer))]))


def chain_edges(p: StepProfile, producer: int) -> list[tuple[int, int, int]]:
    """The rebuild chain from ``producer``: (op, never-saved tensor it reads, that
    tensor's producer) for every op the chain reaches; once per profile."""

    def make() -> list[tuple[int, int, int]]:
        edges, seen, stack = [], {producer}, [producer]
        while stack:
            q = stack.pop()
            for tid in dict.fromkeys(p.ops[q].inputs):
                if tid in p.never_saved:
                    r = p.tensors[tid].producer
                    edges.append((q, tid, r))
                    if r not in seen:
                        seen.add(r)
                        stack.append(r)
        return edges

    return p.derived(f"rebuild chain {producer}", make)


def solve_cover(program: CoverProgram, forward: np.ndarray, need: np.ndarray,
                node_limit: int = NODE_LIMIT) -> np.ndarray | None:
    """The least-cost cover, by HiGHS within ``node_limit`` branch-and-bound nodes: the
    0-1 columns chosen; None when it stops with none.

    NOTE [nested rows]
        What a recompute frees at a forward row is every candidate past its last
        forward use, a set that only grows from row to row; at a backward row, every one
        not needed yet, a set that only shrinks. So row r's sum is row r-1's plus the
        candidates that join at r: one running-total variable per row, ``S_r = S_{r-1}
        + sum(joining b_i x_i)`` with ``S_r >= need_r``, the same covers as the dense
        rows with one entry per candidate instead of one per candidate and row. On
        llama-7b at 30% that is 2 000 entries instead of 169 000, and HiGHS solves it
        in 0.02 s instead of 1 s. (A kept checkpoint's rows nest the same way.)
    """
    away, size = program.away, program.size
    m, k = away.shape
    total = len(program.cost)
    fwd, bwd = np.flatnonzero(forward), np.flatnonzero(~forward)[::-1]  # bwd: last first
    rows, cols, vals = [], [], []
    for chain in (fwd, bwd):  # each in the order its sets grow
        seen = np.zeros(k, dtype=bool)
        for i, r in enumerate(chain):
            joining = np.flatnonzero(away[r] & ~seen)
            seen |= away[r]
            rows += [r] * (len(joining) + 1 + (i > 0))
            cols += [*joining, total + r, *((total + chain[i - 1],) if i else ())]
            vals += [*(-size[joining]), 1.0, *((-1.0,) if i else ())]
    for r, col, gb in program.terms:
        rows.append(r)
        cols.append(col)
        vals.append(-gb)
    constraints = [LinearConstraint(
        coo_matrix((vals, (rows, cols)), shape=(m, total + m)).tocsr(), 0.0, 0.0)]
    if program.rows:
        r_, c_, v_ = zip(*[(r, col, v) for r, (row, _, _) in enumerate(program.rows)
                           for col, v in row.items()], strict=True)
        constraints.append(LinearConstraint(
            coo_matrix((v_, (r_, c_)), shape=(len(program.rows), total + m)).tocsr(),
            [lo for _, lo, _ in program.rows], [hi for _, _, hi in program.rows]))
    upper = np.ones(total) if program.upper is None else program.upper
    try:
        with solver_output_off():  # NOTE [solver output] in planners/quiet.py
            res = milp(np.concatenate([program.cost, np.zeros(m)]),
                       constraints=constraints,
                       integrality=np.concatenate([np.ones(k), np.zeros(total - k + m)]),
                       bounds=Bounds(np.concatenate([np.zeros(total), need]),
                                     np.concatenate([upper, np.full(m, np.inf)])),
                       options={"node_limit": node_limit, "mip_rel_gap": MIP_GAP})
    except ValueError:
        # HiGHS (SciPy 1.17) fails inside its branch and bound on some of these programs
        # ("vector::reserve": DeBERTa's traced step at 33%); not yet narrowed down. The
        # cover is one of the planner's moves: it goes on without it, as when HiGHS
        # stops with none.
        return None
    return None if res.x is None else np.asarray(res.x[:k]) > 0.5


def _undominated(rows: list[tuple[Pressure, int]], first_backward: int
                 ) -> list[tuple[Pressure, int]]:
    """The rows no other row implies. What can be evicted at a forward op only grows
    with the op (past its last forward use, its copy landed), and at a backward op only
    shrinks (not needed yet): a forward row is implied by an earlier one that needs as
    much, a backward row by a later one. Dropping them changes no cover."""
    kept, most = [], 0
    for pt, need in rows:  # forward: each new running maximum
        if pt.op < first_backward and need > most:
            kept.append((pt, need))
            most = need
    late, most = [], 0
    for pt, need in reversed(rows):  # backward: each new maximum from the end
        if pt.op >= first_backward and need > most:
            late.append((pt, need))
            most = need
    return kept + late[::-1]


def _greedy_cover(columns: np.ndarray, need: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """A cover of ``need`` by the columns of the dense ``columns``: repeatedly the column
    that covers the most of what is still needed per unit of cost (the rows are known to
    be coverable)."""
    left = need.astype(float).copy()
    chosen = np.zeros(columns.shape[1], dtype=bool)
    while np.any(left > 0):
        covered = np.minimum(columns, left.clip(min=0)[:, None]).sum(axis=0)
        covered[chosen] = 0.0
        j = int(np.argmax(covered / np.maximum(cost, 1e-12)))
        if covered[j] <= 0:
            break
        chosen[j] = True
        left -= columns[:, j]
    return chosen
