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

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slackswap.core.profile import StepProfile
from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import Pressure

__all__ = ["rebuild_cost", "kernel_cost", "choose_recompute"]


def rebuild_cost(ctx: PlanContext, c: Candidate) -> float:
    """Seconds to rebuild ``c``: its producer, plus any input that was never saved (those
    must be rebuilt too, whatever the plan), each op at the longer of its kernel and its
    host time (NOTE [rebuild cost])."""
    host = ctx.hw.host
    return _chain_cost(ctx.profile, c.producer, host.dispatch_s + host.replay_s)


def kernel_cost(ctx: PlanContext, c: Candidate) -> float:
    """GPU seconds of the kernels a rebuild of ``c`` replays (no host)."""
    return _chain_cost(ctx.profile, c.producer, 0.0)


def _chain_cost(p: StepProfile, producer: int, issue: float) -> float:
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
# Covers within half a percent of the least rebuild time are taken: on the reference
# workloads at 50% the root's cover is the one 1000 nodes of branching keep (gpt2-xl:
# the same 207 activations, 43.10 ms; the search took 1.4 s of its plan time for it).
MIP_GAP = 5e-3


def choose_recompute(
    ctx: PlanContext,
    candidates: list[Candidate],
    points: list[Pressure],
    credit: dict[int, int] | None = None,
) -> set[str] | None:
    """Names to recompute; ``credit[op]`` is what other evictions already free at ``op``.

    None when even recomputing every candidate cannot cover the excess.
    """
    credit = credit or {}
    candidates = [c for c in candidates if c.name in ctx.profile.recomputable]
    rows = [(pt, pt.excess - credit.get(pt.op, 0)) for pt in points]
    rows = _undominated([(pt, need) for pt, need in rows if need > 0], ctx.first_backward)
    if not rows:
        return set()
    if not candidates:
        return None
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
    # milliseconds; equal costs (activations of the same size and kind in different
    # blocks) are broken towards the earlier-made ones, rebuilt later in backward: which
    # of several equal sets HiGHS returns otherwise turns on the shape of the memory curve
    n = len(ctx.profile.ops)
    cost = np.array([rebuild_cost(ctx, c) * 1e3 * (1 + _TIE * c.producer / n)
                     for c in candidates])
    res = _solve_nested(cost, size, away, forward, need)
    chosen = res if res is not None else _greedy_cover(away * size, need, cost)
    return {c.name for c, x in zip(candidates, chosen, strict=True) if x}


def _solve_nested(cost: np.ndarray, size: np.ndarray, away: np.ndarray,
                  forward: np.ndarray, need: np.ndarray) -> np.ndarray | None:
    """The least-cost cover, by HiGHS; None when it stops with none.

    NOTE [nested rows]
        What a recompute frees at a forward row is every candidate past its last
        forward use, a set that only grows from row to row; at a backward row, every one
        not needed yet, a set that only shrinks. So row r's sum is row r-1's plus the
        candidates that join at r: one running-total variable per row, ``S_r = S_{r-1}
        + sum(joining b_i x_i)`` with ``S_r >= need_r``, the same covers as the dense
        rows with one entry per candidate instead of one per candidate and row. On
        llama-7b at 30% that is 2 000 entries instead of 169 000, and HiGHS solves it
        in 0.02 s instead of 1 s.
    """
    m, k = away.shape
    fwd, bwd = np.flatnonzero(forward), np.flatnonzero(~forward)[::-1]  # bwd: last first
    rows, cols, vals = [], [], []
    for chain in (fwd, bwd):  # each in the order its sets grow
        seen = np.zeros(k, dtype=bool)
        for i, r in enumerate(chain):
            joining = np.flatnonzero(away[r] & ~seen)
            seen |= away[r]
            rows += [r] * (len(joining) + 1 + (i > 0))
            cols += [*joining, k + r, *((k + chain[i - 1],) if i else ())]
            vals += [*(-size[joining]), 1.0, *((-1.0,) if i else ())]
    a = coo_matrix((vals, (rows, cols)), shape=(m, k + m)).tocsr()
    res = milp(np.concatenate([cost, np.zeros(m)]),
               constraints=LinearConstraint(a, 0.0, 0.0),
               integrality=np.concatenate([np.ones(k), np.zeros(m)]),
               bounds=Bounds(np.concatenate([np.zeros(k), need]),
                             np.concatenate([np.ones(k), np.full(m, np.inf)])),
               options={"node_limit": NODE_LIMIT, "mip_rel_gap": MIP_GAP})
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
