"""An upper bound on the retention any plan can reach: a linear program on the same time
and memory model, solved with HiGHS (``scipy.optimize.linprog``).

NOTE [why this is a bound]
    Take any plan and its simulated step. Let r_i, o_i be 1 when saved activation i is
    recomputed or offloaded, d_ik be 1 when the offloaded i is off the device while op k
    runs, and s_f, s_b the compute stream's idle time in forward and
    backward. Then every constraint below holds for those values, so the LP optimum is
    at most the plan's overhead over the sum of op times T, and ideal / (T + optimum)
    is at least its retention (ideal: the eager keep-all step, NOTE [bound and the host]):

    - memory, forward op k (where keep-all exceeds the budget B): memory there is the
      keep-all memory less what evicted activations past their last forward use have
      freed, so  sum_{i in S_k} b_i (r_i + d_ik) >= M_k - B;
    - memory, backward op j: only activations not yet needed may be away, so
      sum_{first_use(i) > j} b_i (r_i + d_ij) >= M_j - B;
    - D2H: what is off the device at op k went over the link after its production
      (at or after p_i in keep-all time) and before op k started (at most t_k + s_f in
      forward; in backward also + s_b + sum r_i c_i):
      sum_{i away at k, p_i >= tau} d_ik (latency + b_i / D2H) <= t_k + s_f - tau;
    - H2D: what was off the device at the last forward pressure point L came back after
      it and before its first use j (at most t_j + s_f + s_b + sum r_i c_i);
    - chains: rebuilding i needs each never-saved input u of its producer back, either
      rebuilt (z_u >= r_i - k_u, recursively up the never-saved chain) or kept since
      forward as a checkpoint (k_u), which then occupies memory at every forward point
      past u's last forward use, and at every backward point j before a rebuild that
      reads it when u is never rebuilt (w_uj >= r_i - z_u for readers i needed after j);
    - time: the step is at least the sum of op times, plus each recomputed activation's
      producer once and each rebuilt never-saved tensor's producer once, plus idle time.

    Copy rates are the faster solo rates, and keep-all times are lower bounds on the
    plan's own times, so each relaxation only loosens the bound.

NOTE [bound and the host]
    An op k of the plan starts no later than t_k + idle, with t_k the sum of the op times
    before it (the kernel-only keep-all time, as above), and no earlier than in the
    eager keep-all step (a plan's forward is the same ops, each costing the host at
    least its dispatch and waiting for more); so deadlines use t_k and production
    times the eager step's. A plan under budget moves something, so the runtime runs
    and packs every saved tensor: the ops with at least dispatch and those packs on the
    host (watching, replays and unpacks left out) form a chain no plan beats, since
    more host cost, inserted rebuilds or waits only delay it. Hence s_f is at least
    that chain's idle time in forward, and the overhead at least its end less T (the
    plan's point, with s_b raised by what its rebuilds take beyond sum r_i c_i, meets
    every row, as s_b only loosens the others, at the plan's overhead). The host cost
    of replays is not added to rebuilds: the host may issue them while the GPU is busy,
    so only their kernel time is sure to lengthen the step.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from slackswap.planners.context import PlanContext
from slackswap.planners.memory import Pressure, pressure_points
from slackswap.sim.host import packs

__all__ = ["retention_bound"]


def retention_bound(ctx: PlanContext, thresholds: int = 4, max_points: int = 12,
                    chain_depth: int = 2) -> float:
    """The largest retention any plan could reach under the budget (1.0 if keep-all fits)."""
    if not ctx.reachable:
        return 0.0
    points = pressure_points(ctx)
    if not points:
        return 1.0
    lp = _BoundLP(ctx, _strongest(ctx, points, max_points), chain_depth)
    lp.choice_rows()
    lp.memory_rows(thresholds)
    lp.reload_rows(max_points)
    lp.host_rows()
    overhead = lp.solve()
    if overhead is None:  # infeasible: no plan fits this budget
        return 0.0
    kernels = sum(op.time_s for op in ctx.profile.ops)
    return ctx.ideal / max(kernels + overhead, ctx.ideal)


def _strongest(ctx: PlanContext, points: list[Pressure], most: int
               ) -> tuple[list[Pressure], list[Pressure]]:
    """The forward and backward memory points the LP keeps, at most ``most`` of each, the
    largest excesses (and the last forward one): any subset of the rows still bounds."""
    fwd = [pt for pt in points if pt.op < ctx.first_backward]
    bwd = [pt for pt in points if pt.op >= ctx.first_backward]
    if len(fwd) > most:
        strongest = sorted(fwd, key=lambda pt: -pt.excess)[: most - 1]
        fwd = sorted({*strongest, fwd[-1]}, key=lambda pt: pt.op)
    if len(bwd) > most:
        bwd = sorted(sorted(bwd, key=lambda pt: -pt.excess)[:most], key=lambda pt: pt.op)
    return fwd, bwd


class _BoundLP:
    """The rows and columns of NOTE [why this is a bound], built a family at a time.

    Columns: r (n), o (n), d (n * kp: offloaded i is off the device at point k), s_f,
    s_b, z (m), k (m), w (m * kb: checkpoint u still waits for a rebuild at backward
    point j). Rows are ``sum(coef * x) <= bound``, in gigabytes and milliseconds, which
    keeps HiGHS's tolerances meaningful.
    """

    GB = 1e-9

    def __init__(self, ctx: PlanContext, points: tuple[list[Pressure], list[Pressure]],
                 chain_depth: int) -> None:
        p, link = ctx.profile, ctx.hw.host_link
        self.ctx, self.p = ctx, p
        self.fwd, self.bwd = points
        self.pts = self.fwd + self.bwd
        self.acts = [t for t in p.saved_activations
                     if t.producer is not None and t.first_backward_use is not None]
        acts = self.acts
        self.freed = [max([t.producer, *(c for c in t.forward_consumers
                                          if c < ctx.first_backward)]) for t in acts]
        self.produced = [ctx.op_end[t.producer] for t in acts]  # eager keep-all: none earlier
        self.starts = _kernel_starts(ctx)  # deadlines: none later, but for its idle time
        self.cost = [p.ops[t.producer].time_s for t in acts]
        self.d2h = [link.latency_s + t.bytes / link.d2h_bandwidth for t in acts]
        self.h2d = [link.latency_s + t.bytes / link.h2d_bandwidth for t in acts]
        # Tensors autograd never saved: rebuilding an activation made from one needs it
        # back, rebuilt (z_u) or kept since forward as a checkpoint (k_u).
        self.unsaved = {u: p.tensors[u] for u in p.never_saved}
        self.chain: dict[int, int] = {}  # unsaved tensor -> its column offset
        frontier = [u for t in acts for u in self.unsaved_inputs(t.producer)]
        for _ in range(chain_depth):  # deeper links are dropped: the bound only loosens
            deeper = []
            for u in frontier:
                if u not in self.chain:
                    self.chain[u] = len(self.chain)
                    deeper.extend(self.unsaved_inputs(self.unsaved[u].producer))
            frontier = deeper
        n, m, kp, kb = len(acts), len(self.chain), len(self.pts), len(self.bwd)
        self.n, self.kp, self.kb = n, kp, kb
        self.R, self.OFF, self.D = 0, n, 2 * n
        self.SF = 2 * n + n * kp
        self.SB = self.SF + 1
        self.Z = self.SB + 1
        self.K = self.Z + m
        self.W = self.K + m
        self.cols = self.W + m * kb
        self.readers: dict[int, list[int]] = {u: [] for u in self.chain}  # rebuilt from u
        for i, t in enumerate(acts):
            for u in self.unsaved_inputs(t.producer):
                self.readers[u].append(i)
        # time inserted in backward by the recomputed activations
        self.recompute = [(self.R + i, -self.cost[i] * 1e3) for i in range(n)]
        self.entries: list[tuple[int, int, float]] = []
        self.rhs: list[float] = []

    def unsaved_inputs(self, op_index: int) -> list[int]:
        return [u for u in dict.fromkeys(self.p.ops[op_index].inputs) if u in self.unsaved]

    def row(self, entries: list[tuple[int, float]], bound: float) -> None:
        """sum(coef * x) <= bound"""
        r = len(self.rhs)
        self.entries.extend((r, c, v) for c, v in entries)
        self.rhs.append(bound)

    def choice_rows(self) -> None:
        """One decision per activation; a rebuild needs its never-saved inputs back."""
        R, OFF, Z, K = self.R, self.OFF, self.Z, self.K
        for i in range(self.n):
            self.row([(R + i, 1.0), (OFF + i, 1.0)], 1.0)
            for u in self.unsaved_inputs(self.acts[i].producer):  # r_i <= z_u + k_u
                self.row([(R + i, 1.0), (Z + self.chain[u], -1.0), (K + self.chain[u], -1.0)],
                         0.0)
        for u, col in self.chain.items():  # z_u <= z_w + k_w: rebuilding u needs w too
            for w in (w for w in self.unsaved_inputs(self.unsaved[u].producer)
                      if w in self.chain):
                self.row([(Z + col, 1.0), (Z + self.chain[w], -1.0),
                          (K + self.chain[w], -1.0)], 0.0)

    def memory_rows(self, thresholds: int) -> None:
        """At each point, the evictions cover the excess; what is off the device there
        went over the D2H link after its production and before the op started."""
        ctx, acts, gb = self.ctx, self.acts, self.GB
        R, D, K, W, kp, kb = self.R, self.D, self.K, self.W, self.kp, self.kb
        last_fwd_use = {u: max([self.unsaved[u].producer, *self.unsaved[u].forward_consumers])
                        for u in self.chain}
        for k, pt in enumerate(self.pts):
            backward = pt.op >= ctx.first_backward
            members = [i for i in range(self.n) if (
                acts[i].first_backward_use > pt.op if backward else self.freed[i] < pt.op)]
            if backward:
                # a never-rebuilt u read by a rebuild after j is a checkpoint resident at
                # j: w_uj >= r_i - z_u for each reader i needed after j
                jb = k - len(self.fwd)
                kept = []
                for u, col in self.chain.items():
                    later = [i for i in self.readers[u] if acts[i].first_backward_use > pt.op]
                    if later:
                        kept.append((W + col * kb + jb, self.unsaved[u].bytes * gb))
                        for i in later:
                            self.row([(R + i, 1.0), (self.Z + col, -1.0),
                                      (W + col * kb + jb, -1.0)], 0.0)
            else:
                kept = [(K + col, self.unsaved[u].bytes * gb)
                        for u, col in self.chain.items() if last_fwd_use[u] < pt.op]
            self.row([(c, -acts[i].bytes * gb) for i in members
                      for c in (R + i, D + i * kp + k)] + kept, -pt.excess * gb)
            for i in members:
                self.row([(D + i * kp + k, 1.0), (self.OFF + i, -1.0)], 0.0)
            # the op starts no later than its keep-all time plus idle time (and, in
            # backward, the recomputation inserted before it)
            late = [(self.SF, -1e3)] + ([(self.SB, -1e3)] + self.recompute if backward else [])
            t_k = self.starts[pt.op]
            releases = sorted({self.produced[i] for i in members})
            picks = {releases[int(q * (len(releases) - 1) / max(thresholds - 1, 1))]
                     for q in range(thresholds)} if releases else set()
            for tau in sorted(picks | {0.0}):
                self.row([(D + i * kp + k, self.d2h[i] * 1e3) for i in members
                          if self.produced[i] >= tau] + late, (t_k - tau) * 1e3)

    def reload_rows(self, max_points: int) -> None:
        """What was off the device at the last forward point came back over the H2D link
        after it and before its first use."""
        if not self.fwd:
            return
        last, t_last = len(self.fwd) - 1, self.ctx.op_start[self.fwd[-1].op]
        uses = sorted({t.first_backward_use for t in self.acts})
        for j in uses[:: max(len(uses) // max_points, 1)]:
            members = [i for i in range(self.n) if self.acts[i].first_backward_use <= j]
            self.row([(self.D + i * self.kp + last, self.h2d[i] * 1e3) for i in members]
                     + [(self.SF, -1e3), (self.SB, -1e3)] + self.recompute,
                     (self.starts[j] - t_last) * 1e3)

    def objective(self) -> np.ndarray:
        """Milliseconds over the op times: recompute, rebuilt chains, idle time."""
        objective = np.zeros(self.cols)
        objective[self.R:self.R + self.n] = np.array(self.cost) * 1e3
        objective[self.SF] = objective[self.SB] = 1e3
        for u, col in self.chain.items():
            objective[self.Z + col] = self.p.ops[self.unsaved[u].producer].time_s * 1e3
        return objective

    def host_rows(self) -> None:
        """The least host chain's idle time and end (NOTE [bound and the host])."""
        kernels = sum(op.time_s for op in self.p.ops)
        forward_idle, step = _least_host_chain(self.ctx)
        if forward_idle > 0:  # s_f >= the chain's idle time in forward
            self.row([(self.SF, -1e3)], -forward_idle * 1e3)
        if step > kernels:  # the overhead >= the chain's end less the op times
            self.row([(col, -v) for col, v in enumerate(self.objective()) if v],
                     -(step - kernels) * 1e3)

    def solve(self) -> float | None:
        """The least overhead in seconds over the op times; None when infeasible."""
        r, c, v = zip(*self.entries, strict=True)
        a = coo_matrix((v, (r, c)), shape=(len(self.rhs), self.cols)).tocsr()
        bounds: list[tuple[float, float | None]] = [(0.0, 1.0)] * self.cols
        bounds[self.SF] = bounds[self.SB] = (0.0, None)  # idle time is unbounded
        res = linprog(self.objective(), A_ub=a, b_ub=np.array(self.rhs), bounds=bounds,
                      method="highs")
        if res.status == 2:
            return None
        if res.status != 0:
            raise RuntimeError(f"bound LP did not solve: {res.message}")
        return res.fun / 1e3


def _kernel_starts(ctx: PlanContext) -> list[float]:
    """When each op starts in keep-all with no host: the sum of the op times before it."""
    out, t = [], 0.0
    for op in ctx.profile.ops:
        out.append(t)
        t += op.time_s
    return out


def _least_host_chain(ctx: PlanContext) -> tuple[float, float]:
    """Idle time in forward and end of keep-all's ops, each issued by a host that pays
    its dispatch and the packs before it (NOTE [bound and the host])."""
    p, host = ctx.profile, ctx.hw.host
    cost = [host.dispatch_s] * len(p.ops)
    for _, before in packs(p):
        cost[min(before, len(p.ops) - 1)] += host.pack_s
    issued = end = forward = 0.0
    for op, h in zip(p.ops, cost, strict=True):
        issued += h
        if op.index == ctx.first_backward:
            forward = max(end, issued)  # when backward starts
        end = max(end, issued) + op.time_s
    if ctx.first_backward >= len(p.ops):
        forward = end
    return forward - sum(op.time_s for op in p.ops[: ctx.first_backward]), end
