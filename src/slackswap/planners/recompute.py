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

from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import Pressure, evicted_at

__all__ = ["rebuild_cost", "kernel_cost", "choose_recompute"]


def rebuild_cost(ctx: PlanContext, c: Candidate) -> float:
    """Seconds to rebuild ``c``: its producer, plus any input that was never saved (those
    must be rebuilt too, whatever the plan), each op at the longer of its kernel and its
    host time (NOTE [rebuild cost]); once per context."""
    cached = ctx.rebuild_costs.get(c.name)
    if cached is None:
        host = ctx.hw.host
        issue = host.dispatch_s + host.replay_s
        cached = ctx.rebuild_costs[c.name] = _chain_cost(
            ctx, c, lambda t: t if t >= issue else issue)
    return cached


def kernel_cost(ctx: PlanContext, c: Candidate) -> float:
    """GPU seconds of the kernels a rebuild of ``c`` replays (no host)."""
    return _chain_cost(ctx, c, lambda t: t)


def _chain_cost(ctx: PlanContext, c: Candidate, price: Callable[[float], float]) -> float:
    p = ctx.profile
    seen: set[int] = set()

    def cost(op_index: int) -> float:
        if op_index in seen:
            return 0.0
        seen.add(op_index)
        op = p.ops[op_index]
        total = price(op.time_s)
        for tid in dict.fromkeys(op.inputs):
            if tid in p.never_saved:
                total += cost(p.tensors[tid].producer)
        return total

    return cost(c.producer)


_TIE = 1e-5
# Branch-and-bound nodes HiGHS may explore (the reference workloads' covers solve at
# the root). A node limit, unlike a time limit, stops at the same cover on any machine;
# past it the best cover found so far is used, and with none a greedy cover: a slow
# machine never turns a coverable budget into a refusal.
NODE_LIMIT = 1000


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
    rows = [(pt, need) for pt, need in rows if need > 0]
    if not rows:
        return set()
    entries = [(r, j, c.bytes / 1e9) for r, (pt, _) in enumerate(rows)
               for j, c in enumerate(candidates) if evicted_at(c, pt.op, ctx)]
    if not entries:
        return None
    r, col, v = zip(*entries, strict=True)
    a = coo_matrix((v, (r, col)), shape=(len(rows), len(candidates))).tocsr()
    need = np.array([need / 1e9 for _, need in rows])
    if np.any(np.asarray(a.sum(axis=1)).ravel() < need):
        return None
    # milliseconds; equal costs (activations of the same size and kind in different
    # blocks) are broken towards the earlier-made ones, rebuilt later in backward: which
    # of several equal sets HiGHS returns otherwise turns on the shape of the memory curve
    n = len(ctx.profile.ops)
    cost = np.array([rebuild_cost(ctx, c) * 1e3 * (1 + _TIE * c.producer / n)
                     for c in candidates])
    res = milp(cost, constraints=LinearConstraint(a, need, np.inf),
               integrality=np.ones(len(candidates)), bounds=Bounds(0, 1),
               options={"node_limit": NODE_LIMIT, "mip_rel_gap": 1e-4})
    chosen = np.asarray(res.x) > 0.5 if res.x is not None else _greedy_cover(a, need, cost)
    return {c.name for c, x in zip(candidates, chosen, strict=True) if x}


def _greedy_cover(a: Any, need: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """A cover of ``need`` by columns of ``a``: repeatedly the column that covers the most
    of what is still needed per unit of cost (the rows are known to be coverable)."""
    columns = a.tocsc().toarray()
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
