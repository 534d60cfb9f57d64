"""Offload and recompute chosen together, where a rebuild pulls others back early: the
cover for budgets the slack-first covers cannot fit.

NOTE [joint cover]
    The slack-first covers (:mod:`slackswap.planners.slackswap`) fix the offloads first
    and price each recompute alone, as if the saved tensors its rebuild reads were
    resident. At a tight budget nearly every activation is moved, and a rebuild that
    reads a recomputed activation needed later rebuilds that one too, early, and that
    one's inputs in turn: on two bert-large-mlm layers at 30% of the keep-all peak, the
    MLM head's rebuild before the decoder's backward re-ran the whole forward at the
    loss, the step's tightest point, and no margin made those covers fit. Here each
    candidate may be recomputed (``x``) or offloaded (``o``), and a rebuild's pull is a
    memory term: a candidate ``j`` that candidate ``i``'s rebuild reads (directly or
    through never-saved tensors), first needed after ``i``, is back on the device from
    ``i``'s first use when ``i`` is recomputed and ``j`` recomputed or offloaded (a
    reload, too, must land before the rebuild reads it). A recomputed ``j`` pulls what
    its own rebuild reads, and so on for up to ``depth`` hops; a longer chain of
    recomputes is not allowed: one of them is kept or offloaded, the stopper its
    segment is rebuilt from. A tensor pulled by several rebuilds counts once, from the
    first (``_pulls``). Offloads cost nothing while their copies fit in forward (D2H) and
    backward (H2D) time, the excess at link speed; a copy frees memory in forward once
    it lands (queued alone) and is back at its first use, as a recompute is.

    Measured (a100-80gb), bert-large-mlm@2 at 30%: the depth-3 cover retains 77.4% and
    searched 77.5%, where the planner had 58.5% (the exact program's bound there is
    81.9%); depth 2 retains 72.6, depth 1 62.2. Elsewhere it rates below the slack-first
    plans (bert-large-mlm@1 at 60%: 82.1 against 88.9, searched 86.4), so it runs only
    where those fit nowhere. Its program grows fast with the step (llama-7b with 8
    layers 1.8 s, with 32 layers 95 s, nearly all in HiGHS's root), so it runs only on
    short steps (``PlanContext.short_step``).
"""

from __future__ import annotations

import numpy as np

from slackswap.core.plan import Decision
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import Pressure
from slackswap.planners.recompute import (
    CoverProgram,
    rebuild_cost,
    rebuild_ops,
    row_tie,
    solve_cover,
)

__all__ = ["choose_joint", "JOINT_DEPTHS"]

JOINT_DEPTHS = (2, 3)  # hops a rebuild may pull recomputed activations through
_OFFLOAD_TIE = 1e-3  # an offload's own cost, per millisecond of its copy: ties only

Path = tuple[int, ...]  # candidate indices: a recomputed root, then what it pulls


def choose_joint(ctx: PlanContext, points: list[Pressure], depth: int
                 ) -> dict[str, Decision] | None:
    """Decisions covering every point's excess (NOTE [joint cover]): the recomputed and
    the offloaded candidates; None when no cover exists within ``depth`` hops."""
    rows = [pt for pt in points if pt.excess > 0]
    cands = ctx.candidates
    if not rows:
        return {}
    if not cands:  # nothing to move (every activation under MIN_PLANNED_BYTES): no cover
        return None
    k = len(cands)
    ops = np.array([pt.op for pt in rows])
    forward = ops < ctx.first_backward
    size = np.array([c.bytes / 1e9 for c in cands])
    first_use = np.array([c.first_use for c in cands])
    freed = np.array([c.freed_op for c in cands])
    away_x = np.where(forward[:, None], freed[None, :] < ops[:, None],
                      first_use[None, :] > ops[:, None])  # as ``evicted_at``
    away_o = np.where(forward[:, None],
                      np.maximum(_landed(ctx), freed)[None, :] < ops[:, None], away_x)
    recomputable = np.array([c.name in ctx.profile.recomputable for c in cands], dtype=bool)
    link = ctx.hw.host_link
    d2h = np.array([1e3 * (link.latency_s + c.bytes / link.d2h_bandwidth) for c in cands])
    h2d = np.array([1e3 * (link.latency_s + c.bytes / link.h2d_bandwidth) for c in cands])
    tie = row_tie(ctx, cands)
    pulls, chains = _pulls(ctx, ops[~forward], depth)
    # columns: x (k), o (k), then one per pull segment, then the D2H and H2D excess (ms)
    e0 = 2 * k
    zd, zh = e0 + len(pulls), e0 + len(pulls) + 1
    cost = np.concatenate([
        np.array([rebuild_cost(ctx, c) for c in cands]) * tie,
        _OFFLOAD_TIE * h2d * tie / 1e3, np.zeros(len(pulls)), [1.0, 1.0]])
    upper = np.concatenate([recomputable.astype(float), np.ones(k + len(pulls)),
                            [np.inf, np.inf]])
    constraints: list[tuple[dict[int, float], float, float]] = [
        ({i: 1.0, k + i: 1.0}, -np.inf, 1.0) for i in range(k)]  # one way out each
    constraints += [({i: 1.0 for i in chain}, -np.inf, len(chain) - 1.0)
                    for chain in chains]  # a stopper on every longer chain
    terms = []
    bwd = np.flatnonzero(~forward)[::-1]  # backward rows, last op first (NOTE [nested rows])
    for col, (lo, hi, j, paths) in enumerate(pulls, e0):
        # the pull: back on [lo, hi) where any of its paths is taken
        constraints += [({col: 1.0, **{i: -1.0 for i in path[:-1]}, j: -1.0, k + j: -1.0},
                         1.0 - len(path), np.inf) for path in paths]
        inside = [r for r in bwd if lo <= ops[r] < hi]
        after = [r for r in bwd if ops[r] < lo]
        terms += [(inside[0], col, -size[j])] + ([(after[0], col, size[j])] if after else [])
    ms_fwd = 1e3 * ctx.forward_end
    ms_bwd = 1e3 * (max(ctx.op_end) - ctx.forward_end)
    constraints += [({**{k + j: -d2h[j] for j in range(k)}, zd: 1.0}, -ms_fwd, np.inf),
                    ({**{k + j: -h2d[j] for j in range(k)}, zh: 1.0}, -ms_bwd, np.inf)]
    program = CoverProgram(
        cost=cost, size=np.concatenate([size, size]),
        away=np.concatenate([away_x & recomputable, away_o], axis=1),
        rows=constraints, terms=terms, upper=upper)
    need = np.array([pt.excess / 1e9 for pt in rows])
    chosen = solve_cover(program, forward, need)
    if chosen is None:
        return None
    decisions = {c.name: Decision.RECOMPUTE
                 for c, x in zip(cands, chosen[:k], strict=True) if x}
    decisions.update({c.name: Decision.OFFLOAD
                      for c, o in zip(cands, chosen[k:], strict=True) if o})
    return decisions


def _landed(ctx: PlanContext) -> np.ndarray:
    """Per candidate, the first forward op that starts after its copy would land, the
    copy started as it is made with the link to itself."""
    link, out = ctx.hw.host_link, []
    for c in ctx.candidates:
        t = c.produced_at + link.latency_s + c.bytes / link.d2h_bandwidth
        out.append(next((q for q in range(c.producer, ctx.first_backward)
                         if ctx.op_start[q] >= t), ctx.first_backward))
    return np.array(out)


def _pulls(ctx: PlanContext, backward_rows: np.ndarray, depth: int
           ) -> tuple[list[tuple[int, int, int, list[Path]]], list[Path]]:
    """What rebuilds pull back early (NOTE [joint cover]): per pulled candidate ``j``,
    segments ``[lo, hi)`` between the first uses of the rebuilds that pull it (the last
    ending at ``j``'s own), each with every path from a root first used by ``lo``, where
    a backward row lies inside; and the chains of ``depth + 1`` recomputes that are not
    allowed."""
    p, cands = ctx.profile, ctx.candidates
    index = {c.tensor: j for j, c in enumerate(cands)}
    reads: list[list[int]] = []
    for i, c in enumerate(cands):
        reads.append(list(dict.fromkeys(
            j for q in rebuild_ops(p, c.producer) for tid in p.ops[q].inputs
            if (j := index.get(tid)) is not None and j != i)))
    recomputable = p.recomputable
    found: dict[int, list[tuple[int, Path]]] = {}
    too_long: list[Path] = []
    for i, c in enumerate(cands):
        if c.name not in recomputable:
            continue
        stack: list[Path] = [(i,)]
        while stack:
            path = stack.pop()
            for j in reads[path[-1]]:
                if cands[j].first_use <= c.first_use or j in path:
                    continue  # back already (or made) by then: no pull
                longer = (*path, j)
                if len(longer) > depth + 1:
                    too_long.append(longer)
                    continue
                found.setdefault(j, []).append((c.first_use, longer))
                if cands[j].name in recomputable:
                    stack.append(longer)
    pulls = []
    for j in sorted(found):
        starts = sorted({lo for lo, _ in found[j]})
        for t, lo in enumerate(starts):
            hi = starts[t + 1] if t + 1 < len(starts) else cands[j].first_use
            if np.any((backward_rows >= lo) & (backward_rows < hi)):
                pulls.append((lo, hi, j, [path for at, path in found[j] if at <= lo]))
    return pulls, too_long
