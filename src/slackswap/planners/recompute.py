"""Choose what to recompute at least cost: a 0-1 covering program solved with HiGHS.

Minimize the summed rebuild time of the recomputed activations so that, at every point
where the keep-all step exceeds the budget, the recomputed bytes (with what offloads
already free there) cover the excess. PyTorch's ``activation_memory_budget`` knapsack,
extended to many memory points; solved through ``scipy.optimize.milp``.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import Pressure, evicted_at

__all__ = ["rebuild_cost", "choose_recompute"]


def rebuild_cost(ctx: PlanContext, c: Candidate) -> float:
    """Seconds to rebuild ``c``: its producer, plus any input that was never saved (those
    must be rebuilt too, whatever the plan)."""
    p = ctx.profile
    seen: set[int] = set()

    def cost(op_index: int) -> float:
        if op_index in seen:
            return 0.0
        seen.add(op_index)
        op = p.ops[op_index]
        total = op.time_s
        for tid in dict.fromkeys(op.inputs):
            t = p.tensors[tid]
            if t.kind == "activation" and not t.saved and t.producer is not None:
                total += cost(t.producer)
        return total

    return cost(c.producer)


_TIE = 1e-5


def choose_recompute(
    ctx: PlanContext,
    candidates: list[Candidate],
    points: list[Pressure],
    credit: dict[int, int] | None = None,
    time_limit: float = 3.0,
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
               options={"time_limit": time_limit, "mip_rel_gap": 1e-4})
    if res.x is None:
        return None
    return {c.name for c, x in zip(candidates, res.x, strict=True) if x > 0.5}

