"""The families of rows of the bound's program (:class:`slackswap.planners.bound._BoundLP`,
NOTE [why this is a bound] in :mod:`slackswap.planners.bound`): each family a unit that
adds its rows and columns to one shared program. Plain Python.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slackswap.core.offloads import forward_packs as packs
from slackswap.core.watched import forward_segments
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import Pressure
from slackswap.planners.quiet import solver_output_off


class _Program:
    """A linear program built a row at a time: columns in [0, ``upper``] (``column``
    adds one), rows ``sum(coef * x) <= bound`` (``row``), in gigabytes and milliseconds,
    which keeps HiGHS's tolerances meaningful; the objective (milliseconds over the op
    times: each re-run producer once, idle time) and the solve.
    """

    GB = 1e-9

    def row(self, entries: list[tuple[int, float]], bound: float) -> None:
        """sum(coef * x) <= bound"""
        r = len(self.rhs)
        self.entries.extend((r, c, v) for c, v in entries)
        self.rhs.append(bound)

    def column(self) -> int:
        """A new column in [0, 1], no cost."""
        self.cols += 1
        self.upper = np.append(self.upper, 1.0)
        return self.cols - 1

    def objective(self) -> np.ndarray:
        """Milliseconds over the op times: each re-run producer once, idle time."""
        objective = np.zeros(self.cols)
        for k, op in enumerate(self.made_by):
            objective[self.Q + k] = self.p.ops[op].time_s * 1e3
        objective[self.SF] = objective[self.SB] = 1e3
        return objective

    def solve(self, integral: bool = False, time_limit_s: float | None = None,
              presolve: bool = True) -> float | None:
        """The least overhead in seconds over the op times (with ``integral``, every
        decision 0 or 1, and at the time limit the solver's proven lower bound); None
        when infeasible. The solution, when there is one, is left in ``self.x``. Without
        ``presolve``, HiGHS solves the program as built (NOTE [value without presolve]
        in ``planners/exact.py`` says where its presolve was wrong)."""
        # (one array of the triples: a million entries transpose in a second, not three)
        e = np.array(self.entries, dtype=float).reshape(-1, 3)
        a = coo_matrix((e[:, 2], (e[:, 0].astype(np.int64), e[:, 1].astype(np.int64))),
                       shape=(len(self.rhs), self.cols)).tocsr()
        # decisions are 0 or 1; what is unbounded (idle, rebuild time) is continuous
        integrality = (self.upper <= 1).astype(float) if integral else np.zeros(self.cols)
        options: dict = {} if time_limit_s is None else {"time_limit": time_limit_s}
        if not presolve:
            options["presolve"] = False
        with solver_output_off():  # NOTE [solver output] in planners/quiet.py
            res = milp(self.objective(),
                       constraints=LinearConstraint(a, -np.inf, np.array(self.rhs)),
                       bounds=Bounds(np.zeros(self.cols), self.upper),
                       integrality=integrality, options=options)
        self.x = res.x
        if res.status == 2:
            return None
        if res.status == 1 and integral:  # time limit: the best proven so far still bounds
            self.proven = False
            dual = getattr(res, "mip_dual_bound", None)
            if dual is None or not np.isfinite(dual):
                raise RuntimeError(f"bound program did not solve: {res.message}")
            return float(dual) / 1e3
        if res.status != 0:
            raise RuntimeError(f"bound program did not solve: {res.message}")
        self.proven = True
        return res.fun / 1e3

    def retention(self, overhead: float | None) -> float:
        """The retention of a step ``overhead`` seconds over the op times (0: infeasible)."""
        if overhead is None:
            return 0.0
        kernels = sum(op.time_s for op in self.p.ops)
        return self.ctx.ideal / max(kernels + overhead, self.ctx.ideal)


class _DecisionRows:
    """The decision rows: one decision per activation, each re-run producer once
    (q) and watched (v), and a rebuild's never-saved inputs back: rebuilt (z), kept (k)
    or offloaded (f) as checkpoints.
    """

    def choice_rows(self) -> None:
        """One decision per activation; a rebuild needs its never-saved inputs back."""
        R, OFF, Z, K = self.R, self.OFF, self.Z, self.K
        for i in range(self.n):
            self.row([(R + i, 1.0), (OFF + i, 1.0)], 1.0)
            for u in self.unsaved_inputs(self.acts[i].producer):  # r_i <= z_u + k_u + f_u
                col = self.chain[u]
                self.row([(R + i, 1.0), (Z + col, -1.0), (K + col, -1.0), (self.F + col, -1.0)],
                         0.0)
        for i, t in enumerate(self.acts):  # q_P >= r_i, v_P >= q_P
            self.row([(R + i, 1.0), (self.Q + self.q[t.producer], -1.0)], 0.0)
        for u, col in self.chain.items():  # q_P >= z_u, v_P >= k_u, v_P >= f_u
            k = self.q[self.unsaved[u].producer]
            if self.checkpoint_timing:  # one of: rebuilt, kept or offloaded
                self.row([(Z + col, 1.0), (K + col, 1.0), (self.F + col, 1.0)], 1.0)
            self.row([(Z + col, 1.0), (self.Q + k, -1.0)], 0.0)
            self.row([(K + col, 1.0), (self.V + k, -1.0)], 0.0)
            self.row([(self.F + col, 1.0), (self.V + k, -1.0)], 0.0)
        for k in range(len(self.made_by)):
            self.row([(self.Q + k, 1.0), (self.V + k, -1.0)], 0.0)
        for u, col in self.chain.items():  # z_u <= z_w + k_w: rebuilding u needs w too
            for w in (w for w in self.unsaved_inputs(self.unsaved[u].producer)
                      if w in self.chain):
                self.row([(Z + col, 1.0), (Z + self.chain[w], -1.0),
                          (K + self.chain[w], -1.0), (self.F + self.chain[w], -1.0)], 0.0)


class _MemoryRows:
    """The memory rows, at each pressure point: the evictions cover the excess
    over the budget, checkpoints held count against it, and what is off the device there
    went over the D2H link after its production and before the point (NOTE [why this is
    a bound]: memory, forward and backward, and D2H).
    """

    def memory_rows(self, thresholds: int) -> None:
        """At each point, the evictions cover the excess; what is off the device there
        went over the D2H link after its production and before the op started."""
        ctx, acts, gb = self.ctx, self.acts, self.GB
        R, D, kp = self.R, self.D, self.kp
        last_fwd_use = {u: max([self.unsaved[u].producer, *self.unsaved[u].forward_consumers])
                        for u in self.chain}
        for k, pt in enumerate(self.pts):
            backward = pt.op >= ctx.first_backward
            members = [i for i in range(self.n) if (
                acts[i].first_backward_use > pt.op if backward else self.freed[i] < pt.op)]
            if backward:
                kept, away, pooled = self._backward_holds(k, pt, members)
            else:
                kept, away, pooled = self._forward_holds(pt, last_fwd_use)
            self.away_checkpoints[k] = away
            t_k = self._until(pt)
            out = [(D + i * kp + k, self.produced[i], self.d2h[i]) for i in members]
            out += [(e, self.made[self.unsaved[u].producer], self.checkpoint_d2h(u))
                    for e, u in away]
            made = {o[1] for o in out} | {self.made[self.unsaved[u].producer] for u in pooled}
            taus = sorted(_picks(sorted(made), thresholds) | {0.0})
            if pooled:
                self.pool_away(pooled, kept, out, taus)
            self.row([(c, -acts[i].bytes * gb) for i in members
                      for c in (R + i, D + i * kp + k)] + kept, -pt.excess * gb)
            for i in members:
                self.row([(D + i * kp + k, 1.0), (self.OFF + i, -1.0)], 0.0)
            # the op starts no later than its keep-all time plus idle time (and, in
            # backward, the recomputation inserted before it)
            late = self.late(pt.op)
            for tau in taus:
                self.row([(c, t * 1e3) for c, made, t in out if made >= tau] + late,
                         (t_k - tau) * 1e3)

    def _backward_holds(self, k: int, pt: Pressure, members: list[int]
                        ) -> tuple[list[tuple[int, float]], list[tuple[int, int]], list[int]]:
        """Backward point ``k``: what must be resident there besides the activations not
        yet needed (``members``): (columns and gigabytes held, offloaded checkpoints that
        may be away, as (column, tensor), and none pooled). A checkpoint is held until the
        last rebuild that reads it, and an activation a rebuild for op j or before reads
        came back with it."""
        acts, gb = self.acts, self.GB
        R, D, W, kp, kb = self.R, self.D, self.W, self.kp, self.kb
        # a never-rebuilt u read by a rebuild after j is a checkpoint resident at
        # j: w_uj >= r_i - z_u for each reader i needed after j; one read by a
        # rebuild for j itself is resident, rebuilt or kept: w_uj >= r_i
        jb = k - len(self.fwd)
        kept, away, pooled = [], [], []
        for u, col in self.chain.items():
            w = W + col * kb + jb  # u resident at j
            later = [i for i in self.readers[u] if acts[i].first_backward_use > pt.op]
            # v made from u, rebuilt after j: no rebuild by j that may read v
            fed = [(self.Z + self.chain[v], [
                (R + i, -1.0) for i in self.reach[v]
                if acts[i].first_backward_use <= pt.op])
                for v in self.made_from[u] if self.checkpoint_timing]
            if later or fed:
                kept.append((w, self.unsaved[u].bytes * gb))
            # read by a rebuild after j, u is resident unless rebuilt or away (an
            # offloaded one whose copy out has landed: e <= f_u)
            e = self.F + col
            if (later or fed) and self.upper[self.F + col] and self.checkpoint_timing:
                e = self.column()
                self.row([(e, 1.0), (self.F + col, -1.0)], 0.0)
                away.append((e, u))
            unless = [(self.Z + col, -1.0), (e, -1.0), (w, -1.0)]
            for i in later:
                self.row([(R + i, 1.0), *unless], 0.0)
            for z, early in fed:
                self.row([(z, 1.0), *early, *unless], 0.0)
        # a rebuild for j or before that reads activation a (directly or through
        # rebuilt ones) brings a back for good: a neither rebuilt later
        # (y >= r_a + r_i + r_between - 1 - len(between)) nor away at j
        for a in members:
            early = [(i, between) for i, between, _ in self.read_by.get(a, ())
                     if acts[i].first_backward_use <= pt.op]
            if early:
                y = self.column()
                kept.append((y, acts[a].bytes * gb))
            for i, between in early:
                path = [(c, 1.0) for c in (R + i, *between)]
                self.row([(R + a, 1.0), (y, -1.0), *path], float(len(path)))
                self.row([(D + a * kp + k, 1.0), *path], float(len(path)))
        return kept, away, pooled

    def _forward_holds(self, pt: Pressure, last_fwd_use: dict[int, int]
                       ) -> tuple[list[tuple[int, float]], list[tuple[int, int]], list[int]]:
        """Forward point ``pt``: (columns and gigabytes held, offloaded checkpoints that
        may be away as (column, tensor), those the LP pools instead) of the never-saved
        tensors past their last forward use: a kept checkpoint occupies memory, an
        offloaded one until its copy out has landed."""
        K, gb = self.K, self.GB
        kept, away, pooled = [], [], []
        for u, col in self.chain.items():
            if last_fwd_use[u] < pt.op:
                size = self.unsaved[u].bytes * gb
                kept.append((K + col, size))
                if self.upper[self.F + col]:
                    kept.append((self.F + col, size))
                    if self.checkpoint_timing:  # (the LP pools them: pool_away)
                        e = self.column()
                        self.row([(e, 1.0), (self.F + col, -1.0)], 0.0)
                        kept.append((e, -size))
                        away.append((e, u))
                    else:
                        pooled.append(u)
        return kept, away, pooled

    def pool_away(self, away: list[int], kept: list[tuple[int, float]],
                  out: list[tuple[int, float, float]], taus: list[float]) -> None:
        """The LP's lighter form of the offloaded checkpoints ``away`` that may be off the
        device at a forward point: one column per span of production times between the
        D2H rows' ``taus``, the gigabytes of that span's offloaded checkpoints whose copies
        have landed (at most their sum), added to ``kept`` (memory) and ``out`` (D2H), in
        place of one column per checkpoint: every row a plan satisfies still holds."""
        link, gb = self.ctx.hw.host_link, self.GB
        for lo, hi in zip(taus, [*taus[1:], np.inf], strict=True):
            span = [u for u in away if lo <= self.made[self.unsaved[u].producer] < hi]
            if not span:
                continue
            landed = self.column()
            self.upper[landed] = np.inf
            self.row([(landed, 1.0)] + [(self.F + self.chain[u], -self.unsaved[u].bytes * gb)
                                        for u in span], 0.0)
            kept.append((landed, -1.0))
            out.append((landed, lo, 1 / (gb * link.d2h_bandwidth)))

    def _until(self, pt: Pressure) -> float:
        """The keep-all kernel time of a point: its op's start, or its end for a point
        that checks memory as the op ends (a copy landed, or a reload started, by then)."""
        return self.starts[pt.op] + (self.p.ops[pt.op].time_s if pt.ends else 0.0)


class _TimeRows:
    """The time rows on the links: reloads after the last forward point and
    before their first use, both copies of every offload between its production and its
    first use (each link alone, and both at once where they slow each other down), and
    an offloaded checkpoint's before the first rebuild that reads it (NOTE [why this is
    a bound]: H2D, both links).
    """

    def reload_rows(self, max_points: int) -> None:
        """What was off the device at the last forward point came back over the H2D link
        after it and before its first use."""
        if not self.fwd:
            return
        # ... and after forward: the runtime issues reloads from backward's unpacks
        last = len(self.fwd) - 1
        t_last = max(self.ctx.op_start[self.fwd[-1].op], self.ctx.forward_end)
        uses = sorted({t.first_backward_use for t in self.acts})
        for j in uses[:: max(len(uses) // max_points, 1)]:
            members = [i for i in range(self.n) if self.acts[i].first_backward_use <= j]
            self.row([(self.D + i * self.kp + last, self.h2d[i] * 1e3) for i in members]
                     + self.late(j),
                     (self.starts[j] - t_last) * 1e3)

    def transfer_rows(self, thresholds: int, max_points: int) -> None:
        """Every offload goes both ways, away or not at any point: what is made at or
        after tau and first needed by op j crosses each link between the two, and each
        tensor's reload starts after its copy out has landed. An offloaded checkpoint
        counts where a rebuild that reads it runs by j (g >= f_u + r_i - 1)."""
        checkpoints = self.offloaded_checkpoints()
        duplex = self.duplex_cost()
        uses = sorted({t.first_backward_use for t in self.acts})
        for j in uses[:: max(len(uses) // max_points, 1)]:
            # (column, made, D2H, H2D, bytes)
            moves = [(self.OFF + i, self.produced[i], self.d2h[i], self.h2d[i],
                      self.acts[i].bytes) for i in range(self.n)
                     if self.acts[i].first_backward_use <= j]
            for u, f, made, out, back in checkpoints:
                early = [terms for terms, use in self.checkpoint_reads(u) if use <= j]
                if early:
                    g = self.column()
                    for terms in early:  # g >= f_u + (the read) - len(terms)
                        self.row([(f, 1.0), *((c, 1.0) for c in terms), (g, -1.0)],
                                 float(len(terms)))
                    moves.append((g, made, out, back, self.unsaved[u].bytes))
            late = self.late(j)
            for tau in _picks(sorted({m[1] for m in moves}), thresholds):
                chosen = [m for m in moves if m[1] >= tau]
                for way in (2, 3):
                    self.row([(m[0], m[way] * 1e3) for m in chosen] + late,
                             (self.starts[j] - tau) * 1e3)
                if duplex:  # both ways in one window: the links slow each other down
                    self.row([(m[0], m[4] * duplex * 1e3) for m in chosen] + late,
                             (self.starts[j] - tau) * 1e3)
        for i, t in enumerate(self.acts):  # one tensor's two copies, one after the other
            self.row([(self.OFF + i, (self.d2h[i] + self.h2d[i]) * 1e3)]
                     + self.late(t.first_backward_use),
                     (self.starts[t.first_backward_use] - self.produced[i]) * 1e3)
        for u, f, made, out, back in checkpoints:  # (when a rebuild reads it)
            trip = (out + back) * 1e3
            for terms, use in self.checkpoint_reads(u):
                self.row([(f, trip), *((c, trip) for c in terms)] + self.late(use),
                         (self.starts[use] - made) * 1e3 + trip * len(terms))

    def checkpoint_reads(self, u: int) -> list[tuple[list[int], int]]:
        """When a rebuild reads never-saved u: (columns that are all 1 then, the op that
        needs the rebuilt activation). A reader i of u: r_i; a reader i of a never-saved
        v made from u (one link deeper, v read by activations only): z_v and r_i."""
        reads = [([self.R + i], self.acts[i].first_backward_use) for i in self.readers[u]]
        for v in self.fed[u] if self.checkpoint_timing else ():
            reads += [([self.Z + self.chain[v], self.R + i], self.acts[i].first_backward_use)
                      for i in self.readers[v]]
        return reads

    def offloaded_checkpoints(self) -> list[tuple[int, int, float, float, float]]:
        """(tensor, f column, made, D2H time, H2D time) of each never-saved tensor a plan
        may offload as a checkpoint; f_u is 1 only when a rebuild reads it, so copied."""
        link, out = self.ctx.hw.host_link, []
        for u, col in self.chain.items():
            if self.upper[self.F + col]:
                t = self.unsaved[u]
                out.append((u, self.F + col, self.made[t.producer],
                            self.checkpoint_d2h(u),
                            link.latency_s + t.bytes / link.h2d_bandwidth))
        return out

    def checkpoint_d2h(self, u: int) -> float:
        link = self.ctx.hw.host_link
        return link.latency_s + self.unsaved[u].bytes / link.d2h_bandwidth

    def duplex_cost(self) -> float:
        """Seconds per byte that goes both ways within one window, both links busy at
        their duplex rates part of the time: the steeper facet of the region of byte
        rates the two links reach together (solo, both at duplex rates, or idle).

        With T2 the time both move, T1 the time one moves alone, bytes one way
        Y = h T2 + H T1' and the other X = d T2 + D T1'' (h, d duplex, H, D solo rates):
        Y / H + X (1 - h / H) / d <= T2 + T1' + T1'' (D / d)(1 - h / H), at most the window
        when (D / d)(1 - h / H) <= 1; a tensor that goes both ways adds 1 to X and Y per
        byte. 0.0 when the links lose nothing in duplex (the solo rows are as tight)."""
        link = self.ctx.hw.host_link
        best = 0.0
        for solo, duplex, other_solo, other_duplex in (
                (link.h2d_bandwidth, link.duplex_h2d_bandwidth,
                 link.d2h_bandwidth, link.duplex_d2h_bandwidth),
                (link.d2h_bandwidth, link.duplex_d2h_bandwidth,
                 link.h2d_bandwidth, link.duplex_h2d_bandwidth)):
            slow = max(1 - duplex / solo, 0.0)
            if slow and other_solo / other_duplex * slow <= 1:
                best = max(best, 1 / solo + slow / other_duplex)
        return best if best > 1 / min(link.h2d_bandwidth, link.d2h_bandwidth) else 0.0


class _HostRows:
    """The host rows: the host issues each op no earlier than its costs so far
    allow (dispatch, packs, the runtime's watches, replays and unpacks), and the kernels
    from there on run after it (NOTE [bound and the host]).
    """

    def host_rows(self, max_points: int) -> None:
        """The host issues each item no earlier than its costs so far allow, and the
        kernels from there on run after it (NOTE [bound and the host])."""
        ctx, p, host = self.ctx, self.p, self.ctx.hw.host
        ops = p.ops
        kernels = sum(op.time_s for op in ops)
        forward_idle, _ = _least_host_chain(ctx)
        if forward_idle > 0:  # s_f >= the chain's idle time in forward
            self.row([(self.SF, -1e3)], -forward_idle * 1e3)
        rest = np.cumsum([op.time_s for op in reversed(ops)])[::-1]  # kernels from op j on
        cuts = range(len(ops)) if max_points >= len(ops) else sorted(
            {*np.linspace(0, len(ops) - 1, max_points).astype(int), ctx.first_backward})
        overhead = [(col, -v) for col, v in enumerate(self.objective()) if v]
        rebuild = host.dispatch_s + host.replay_s
        for j in cuts:
            terms = overhead + self.watched_by(j)
            if j < ctx.first_backward:  # every rebuild's kernels run after the cut
                terms += [(col, -v) for col, v in self.recompute]
            else:  # rebuilds and unpacks of what is needed by then
                by_producer: dict[int, list[int]] = {}
                for i, t in enumerate(self.acts):
                    if t.first_backward_use <= j:
                        by_producer.setdefault(t.producer, []).append(i)
                        terms += [(self.R + i, host.unpack_s * 1e3),
                                  (self.OFF + i, host.unpack_s * 1e3)]
                for readers in by_producer.values():  # h >= r_i: the producer re-ran
                    h = self.column()
                    terms.append((h, rebuild * 1e3))
                    for i in readers:
                        self.row([(self.R + i, 1.0), (h, -1.0)], 0.0)
            self.row(terms, -self.issued_ms[j] - (rest[j] - kernels) * 1e3)

    def watch_terms(self) -> list[tuple[int, int, int]]:
        """(column, first op, one past the last) of the forward ops the runtime watches:
        each producer a plan re-runs or keeps a checkpoint of (v_P); in the exact model
        every op of the segments that hold those producers, as ``core/watched.py``
        watches them (a column per segment, at least each of its producers' v_P)."""
        if hasattr(self, "_watch"):
            return self._watch
        if not self.rebuild_timing or not self.p.module_events:
            self._watch = [(self.V + k, op, op + 1) for k, op in enumerate(self.made_by)
                           if op < self.ctx.first_backward]
            return self._watch

        out = []
        for start, end in forward_segments(self.p):
            inside = [k for k, op in enumerate(self.made_by) if start <= op < end]
            if inside:
                seg = self.column()
                for k in inside:
                    self.row([(self.V + k, 1.0), (seg, -1.0)], 0.0)
                out.append((seg, start, end))
        self._watch = out
        return out

    def watched_by(self, j: int) -> list[tuple[int, float]]:
        """Terms of the host's watch time, in milliseconds, over forward ops up to ``j``."""
        watch_ms = self.ctx.hw.host.watch_s * 1e3
        return [(col, watch_ms * (min(end, j + 1) - start))
                for col, start, end in self.watch_terms() if start <= j]

    @functools.cached_property
    def issued_ms(self) -> np.ndarray:
        """Per op, when the host has issued it with its dispatch and the packs so far."""
        return np.cumsum(_packed_costs(self.ctx)) * 1e3

    def issue_of(self, c: int) -> tuple[float, list[tuple[int, float]]]:
        """When the host has issued forward op ``c``, in milliseconds: its costs and the
        packs so far (a constant) plus the watches so far (terms on the watch columns).
        The op's kernel starts no earlier."""
        return float(self.issued_ms[c]), self.watched_by(c)


class _RebuildTiming:
    """How late an op may start after its keep-all time: idle time, and in
    backward the rebuilds; with ``rebuild_timing`` only the rebuilds that can run before
    it, as a lateness column per op that never falls from one op to the next.
    """

    def late(self, j: int) -> list[tuple[int, float]]:
        """Terms of what op ``j`` can start after its keep-all time, in milliseconds: idle
        in forward; in backward idle too, and the rebuilds (each re-run producer once,
        s_b taking the rest). With ``rebuild_timing``, only the rebuilds that can run
        before j: a producer re-runs for the rebuild of an activation i at i's first
        backward use, and only if it made i or something i is made from, so
        rho_j <= sum q_P c_P and rho_j <= sum_{i first needed by j} r_i C_i, C_i the op
        times of the producers i is made from (itself included)."""
        if self.rebuild_timing:
            return [(self.lateness(j), -1.0)]
        return self._late_terms(j)

    def _late_terms(self, j: int) -> list[tuple[int, float]]:
        if j < self.ctx.first_backward:
            return [(self.SF, -1e3)]
        idle = [(self.SF, -1e3), (self.SB, -1e3)]
        if not self.rebuild_timing:
            return idle + self.recompute
        if j not in self._late:
            cost = self.rebuild_reach()
            early = [(self.R + i, -cost[t.producer] * 1e3) for i, t in enumerate(self.acts)
                     if t.first_backward_use <= j and self.upper[self.R + i]
                     and cost[t.producer]]
            if not early:
                self._late[j] = idle
            else:
                rho = self.column()
                self.upper[rho] = np.inf
                self.row([(rho, 1.0)] + self.recompute, 0.0)
                self.row([(rho, 1.0)] + early, 0.0)
                if self.tight:
                    self.row([(rho, 1.0)] + self._reruns_by(j), 0.0)
                self._late[j] = idle + [(rho, -1.0)]
        return self._late[j]

    def lateness(self, j: int) -> int:
        """In the exact model, the column lambda_j: milliseconds op ``j`` starts after its
        keep-all time t_j. At most ``late``'s terms, at least what the host's issue of
        the keep-all step makes it (``_packed_chain``), and never less than an earlier
        op's (``lateness_rows``): so the windows of copies that open at one op and close
        at another shrink by what the step has lost by the first."""
        if j not in self.lam:
            col = self.lam[j] = self.column()
            self.upper[col] = np.inf
            self.row([(col, 1.0)] + self._late_terms(j), 0.0)
            issued = self.issued_starts[j] - self.starts[j]
            if issued > 0:
                self.row([(col, -1.0)], -issued * 1e3)
        return self.lam[j]

    def lateness_rows(self) -> None:
        """lambda never falls from one op to a later one: each op starts after the one
        before it, which takes its keep-all time or more."""
        ops = sorted(self.lam)
        for a, b in zip(ops, ops[1:], strict=False):
            self.row([(self.lam[a], 1.0), (self.lam[b], -1.0)], 0.0)
        if self.tight:
            self.rebuilt_by_rows()

    def ancestors(self) -> dict[int, int]:
        """Per forward op, the bitset of the ops its outputs are made from, itself
        included, through any chain of forward tensors."""
        if not hasattr(self, "_ancestors"):
            ops, tensors = self.p.ops, self.p.tensors
            self._ancestors: dict[int, int] = {}
            for op in ops[: self.ctx.first_backward]:
                bits = 1 << op.index
                for u in op.inputs:
                    made = tensors[u].producer
                    if made is not None and made < op.index:
                        bits |= self._ancestors[made]
                self._ancestors[op.index] = bits
        return self._ancestors

    def rebuild_reach(self) -> dict[int, float]:
        """Per forward op, the op times of every re-runnable producer its outputs are
        made from, itself included (a rebuild re-runs no other): seconds."""
        if not hasattr(self, "_reach"):
            ops = self.p.ops
            self._reach = {k: sum(ops[q].time_s for q in self.made_by if bits >> q & 1)
                           for k, bits in self.ancestors().items()}
        return self._reach


class _ReloadTimingRows:
    """The exact model's reload timing (``planners/exact.py``), at every backward
    point: an activation once back stays back, copies out land in production order,
    and what is away at a point and first needed by op j comes back between the two;
    with ``tight``, an offload a rebuild reads through rebuilt tensors lands before the
    re-runs on the way (NOTE [tight timing] (1)).
    """

    def timing_rows(self) -> None:
        """Reload timing at every backward point: an activation once back stays back (it
        is reloaded once; its copy out may still land in backward), the copies out land
        in production order, and what is away at point q and first needed by op j came
        over the H2D link between the starts of q and j."""
        acts, base = self.acts, self.D + len(self.fwd)
        for i in range(self.n):  # back_k >= back_{k-1}, back_k >= d_{k-1} - d_k, d_k <= 1 - back_k
            if self.upper[self.OFF + i] == 0:
                continue
            back = None
            for k in range(1, len(self.bwd)):
                if acts[i].first_backward_use <= self.bwd[k].op:
                    break
                d, was = base + i * self.kp + k, base + i * self.kp + k - 1
                now = self.column()
                self.row([(was, 1.0), (d, -1.0), (now, -1.0)], 0.0)
                if back is not None:
                    self.row([(back, 1.0), (now, -1.0)], 0.0)
                self.row([(d, 1.0), (now, 1.0)], 1.0)
                back = now
        # the D2H engine copies in production order: an offload's copy lands after those
        # of everything offloaded between tau and its own production, then comes back
        checkpoints = self.offloaded_checkpoints()
        big = sum(self.d2h) + sum(self.h2d) + sum(c[3] for c in checkpoints)
        for i, t in enumerate(acts):
            if self.upper[self.OFF + i] == 0:
                continue
            for tau in sorted({self.produced[k] for k in range(self.n)
                               if self.produced[k] <= self.produced[i]}):
                ahead = [k for k in range(self.n) if tau <= self.produced[k] < self.produced[i]]
                self.row([(self.OFF + k, self.d2h[k] * 1e3) for k in ahead]
                         + [(f, out * 1e3) for _, f, made, out, _ in checkpoints
                            if tau <= made < self.produced[i]]
                         + [(self.OFF + i, (self.d2h[i] + self.h2d[i] + big) * 1e3)]
                         + self.late(t.first_backward_use),
                         (self.starts[t.first_backward_use] - tau + big) * 1e3)
        uses = sorted({t.first_backward_use for t in acts})
        for k, pt in enumerate(self.bwd):
            for j in (j for j in uses if j > pt.op):
                members = [i for i in range(self.n) if pt.op < acts[i].first_backward_use <= j]
                opens = [(self.lateness(pt.op), 1.0)] if self.rebuild_timing else []
                self.row([(base + i * self.kp + k, self.h2d[i] * 1e3) for i in members]
                         + self.late(j) + opens,
                         (self.starts[j] - self._until(pt)) * 1e3)
        if self.tight:
            self.early_read_rows()

    def early_read_rows(self) -> None:
        """An offloaded activation a that the rebuild for op j reads (directly or through
        rebuilt tensors between) is needed before j: it lands, then every producer on
        the way re-runs (C seconds), all before j starts. So, with e >= d_aq + r_i + the
        path's columns - their number, between the starts of point q and of j: a and
        those re-runs fit; with what is away at q and first needed by j, a fits; and
        with what is first needed before j, a fits and so does C or op j-1, the shorter
        (the re-runs may have run before j-1)."""
        acts, base, ops = self.acts, self.D + len(self.fwd), self.p.ops
        for a, paths in self.read_by.items():
            if self.upper[self.OFF + a] == 0:
                continue
            for i, between, made in paths:
                j = acts[i].first_backward_use
                if j >= acts[a].first_backward_use:
                    continue
                rerun = self._rerun_ms(made)
                path = [(c, 1.0) for c in (self.R + i, *between)]
                for k, pt in enumerate(self.bwd):
                    if pt.op >= j:
                        continue
                    e = self.column()
                    self.row([(base + a * self.kp + k, 1.0), *path, (e, -1.0)],
                             float(len(path)))
                    window = self.late(j) + [(self.lateness(pt.op), 1.0)]
                    until = (self.starts[j] - self._until(pt)) * 1e3
                    h2d = self.h2d[a] * 1e3
                    self.row([(e, h2d + rerun)] + window, until)
                    for last, extra in ((j, 0.0), (j - 1, min(rerun, ops[j - 1].time_s * 1e3))):
                        members = [m for m in range(self.n)
                                   if pt.op < acts[m].first_backward_use <= last]
                        if members:
                            self.row([(base + m * self.kp + k, self.h2d[m] * 1e3)
                                      for m in members] + [(e, h2d + extra)] + window, until)

    def _rerun_ms(self, made: tuple[int, ...]) -> float:
        """Milliseconds of the producers on a read's path (``read_by``), each once."""
        return sum(self.p.ops[o].time_s for o in set(made)) * 1e3


class _QueueRows:
    """The exact model's D2H queue: copies out in producer order, each once its
    tensor is made (and, with ``tight``, issued by a host that watches), away at a point
    only once landed, and reloaded only after (NOTE [tight timing] (1), (3)).
    """

    def queue_rows(self) -> None:
        """The D2H engine copies in producer order (``sim/schedule.py``), each copy once
        its tensor is made and packed, so an offload lands no earlier than everything
        offloaded before it has crossed: Q_g, when the copies of the tensors made by
        producers up to g have landed, is at least Q_{g-1} plus those of g's outputs,
        and at least their production plus them; one of g's lands at least its own
        copy after Q_{g-1}, and it is away at a point only once landed."""
        # (producer, made, D2H time, offload column)
        items = [(t.producer, self.produced[i], self.d2h[i], self.OFF + i)
                 for i, t in enumerate(self.acts) if self.upper[self.OFF + i]]
        checkpoints = self.offloaded_checkpoints()
        items += [(self.unsaved[u].producer, made, out, f)
                  for u, f, made, out, _ in checkpoints]
        if not items:
            return
        f_col = {u: f for u, f, _, _, _ in checkpoints}
        big = (max(m for _, m, _, _ in items) + sum(d for _, _, d, _ in items)) * 1e3
        landed: dict[int, int] = {}
        prev = None
        fb = self.ctx.first_backward  # (a bound on every watch term: all of forward)
        watch_big = self.ctx.hw.host.watch_s * 1e3 * fb
        for producer in sorted({it[0] for it in items}):
            group = [(made * 1e3, d * 1e3, col) for op, made, d, col in items if op == producer]
            after = [(prev, 1.0)] if prev is not None else []
            q = self.column()
            self.upper[q] = np.inf
            self.row(after + [(col, d) for _, d, col in group] + [(q, -1.0)], 0.0)
            issue = self.issue_of(producer) if self.tight and producer < fb else None
            for made, d, col in group:
                self.row([(col, made)] + [(c, v) for _, v, c in group] + [(q, -1.0)], 0.0)
                land = landed[col] = self.column()
                self.upper[land] = np.inf
                self.row(after + [(col, d), (land, -1.0)], 0.0)
                self.row([(col, made + d), (land, -1.0)], 0.0)
                if issue is not None:  # made once issued, watches and all: the same
                    # two rows with the producer's kernel end no earlier than that
                    ended = issue[0] + self.p.ops[producer].time_s * 1e3
                    self.row([(col, ended + watch_big)] + issue[1]
                             + [(c, v) for _, v, c in group] + [(q, -1.0)], watch_big)
                    self.row([(col, ended + d + watch_big)] + issue[1] + [(land, -1.0)],
                             watch_big)
            prev = q
        for k, pt in enumerate(self.pts):
            t_k = self._until(pt)
            late = self.late(pt.op)
            members = [i for i in range(self.n) if self.OFF + i in landed and (
                self.acts[i].first_backward_use > pt.op if pt.op >= self.ctx.first_backward
                else self.freed[i] < pt.op)]
            away = [(landed[self.OFF + i], self.D + i * self.kp + k) for i in members]
            away += [(landed[f_col[u]], e) for e, u in self.away_checkpoints.get(k, ())]
            for land, d in away:  # landed by then, or not away: L - big (1 - d) <= t_k + late
                self.row([(land, 1.0), (d, big)] + late, t_k * 1e3 + big)
        if self.tight:
            self.reload_after_landing(landed, big)

    def reload_after_landing(self, landed: dict[int, int], big: float) -> None:
        """An offload's reload starts once its copy out has landed and is back before the
        op that first needs it, or before the first rebuild that reads it (then the
        re-runs on the way follow, ``early_read_rows``): L + reload (+ C) - big (1 - g)
        <= t_j + lambda_j, with g the offload (and the read's path)."""
        acts = self.acts
        for a, t in enumerate(acts):
            if self.OFF + a not in landed:
                continue
            land, h2d = landed[self.OFF + a], self.h2d[a] * 1e3
            reads = [([self.OFF + a], t.first_backward_use, 0.0)]
            reads += [([self.OFF + a, self.R + i, *between], acts[i].first_backward_use,
                       self._rerun_ms(made))
                      for i, between, made in self.read_by.get(a, ())
                      if acts[i].first_backward_use < t.first_backward_use]
            for cols, j, rerun in reads:
                g = cols[0]
                if len(cols) > 1:
                    g = self.column()
                    self.row([*((c, 1.0) for c in cols), (g, -1.0)], float(len(cols) - 1))
                self.row([(land, 1.0), (g, h2d + rerun + big)] + self.late(j),
                         self.starts[j] * 1e3 + big)


class _RerunRows:
    """The exact model's lateness with ``tight`` (NOTE [tight timing] (2)): a
    backward op starts after what forward lost and every producer that must have re-run
    by then, and no later than idle time and the producers that may have re-run by then,
    each once.
    """

    def rebuilt_by_rows(self) -> None:
        """Backward op j starts after what forward lost (phi: at least the keep-all
        chain's, and for every forward op c the host's issue of c, its costs and watches
        so far, less c's keep-all start) and every producer re-run for an activation
        first needed by j or read by a rebuild for j or before (y_Pj, each producer
        once): lambda_j >= phi + sum c_P y_Pj."""
        fb = self.ctx.first_backward
        phi = self.column()
        self.upper[phi] = np.inf
        self.row([(phi, -1.0)], -max(self.issued_starts[fb] - self.starts[fb], 0.0) * 1e3)
        for c in range(fb):
            issued, watches = self.issue_of(c)
            self.row([(phi, -1.0)] + watches, -(issued - self.starts[c] * 1e3))
        for j in sorted(o for o in self.lam if o >= fb):
            self.row([(self.lam[j], -1.0), (phi, 1.0),
                      *((y, self.p.ops[op].time_s * 1e3) for op, y in self._rerun_by(j))],
                     0.0)

    def _rerun_by(self, j: int) -> list[tuple[int, int]]:
        """(producer, y_Pj) for each producer that must have re-run by backward op j,
        y_Pj 1 when it must: n_t, t rebuilt by j, is at least r_i for each activation i
        first needed by j, and for each input u of a rebuilt t's producer at least n_t +
        r_u - 1 (a recomputed activation) or n_t + z_u - 1 (a never-saved tensor not
        checkpointed): the replay reads every input, and these are on the device only
        when rebuilt. Any chain of rebuilds, however deep."""
        p, acts = self.p, self.acts
        index = {t.id: i for i, t in enumerate(acts) if self.upper[self.R + i]}

        def rebuilt(u: int) -> int | None:  # the column that is 1 when u is rebuilt
            if u in index:
                return self.R + index[u]
            return self.Z + self.chain[u] if u in self.chain else None

        needed: dict[int, int] = {}  # tensor -> n_t
        frontier = []
        for tid, i in index.items():
            if acts[i].first_backward_use <= j:
                needed[tid] = self.R + i  # n_i = r_i
                frontier.append(tid)
        while frontier:
            t = frontier.pop()
            made = p.tensors[t].producer
            for u in dict.fromkeys(p.ops[made].inputs):
                col, src = rebuilt(u), p.tensors[u].producer
                if col is None or src is None or src >= made:
                    continue
                if u not in needed:
                    needed[u] = self.column()
                    frontier.append(u)
                self.row([(needed[t], 1.0), (col, 1.0), (needed[u], -1.0)], 1.0)
        by_producer: dict[int, list[int]] = {}
        for t, n in needed.items():
            by_producer.setdefault(p.tensors[t].producer, []).append(n)
        out = []
        for op, cols in by_producer.items():
            if len(cols) == 1 and cols[0] < self.Z:  # r_i itself: 1 exactly when rebuilt
                out.append((op, cols[0]))
                continue
            y = self.column()
            for n in cols:
                self.row([(n, 1.0), (y, -1.0)], 0.0)
            out.append((op, y))
        return out

    def _reruns_by(self, j: int) -> list[tuple[int, float]]:
        """-c_P u_P for each producer that may re-run by op j, u_P at most the sum of
        the reasons it would (``rerun_reasons``) and at most 1: each producer once."""
        by_op: dict[int, list[int]] = {}
        for use, col, op in self.rerun_reasons():
            if use <= j:
                by_op.setdefault(op, []).append(col)
        terms = []
        for op, cols in by_op.items():
            u = self.column()
            self.row([(u, 1.0)] + [(c, -1.0) for c in dict.fromkeys(cols)], 0.0)
            terms.append((u, -self.p.ops[op].time_s * 1e3))
        return terms

    def rerun_reasons(self) -> list[tuple[int, int, int]]:
        """Why a producer may re-run before op j, as (j, column, producer): rebuilding
        activation i, first needed by j, re-runs its producer and, where what that
        reads is itself rebuilt (a recomputed activation, a never-saved tensor not
        checkpointed), that one's producer, and so on (the column is 1 only when every
        link is: w <= each). ``self.depth`` links down, every producer a chain reaches
        from there may re-run."""
        if hasattr(self, "_reasons"):
            return self._reasons
        p, acts = self.p, self.acts
        index = {t.id: i for i, t in enumerate(acts)}
        ancestors = self.ancestors()
        out: list[tuple[int, int, int]] = []

        def add(use: int, cols: tuple[int, ...], ops: list[int]) -> None:
            if not ops:
                return
            col = cols[0]
            if len(cols) > 1:
                col = self.column()
                for c in cols:
                    self.row([(col, 1.0), (c, -1.0)], 0.0)
            out.extend((use, col, op) for op in ops)

        for i, t in enumerate(acts):
            if not self.upper[self.R + i]:
                continue
            use = t.first_backward_use
            paths = [(t.producer, (self.R + i,))]
            for depth in range(self.depth + 1):
                deeper = []
                for op, cols in paths:
                    if depth == self.depth:  # every producer a chain from here reaches
                        add(use, cols, [q for q in self.made_by if ancestors[op] >> q & 1])
                        continue
                    add(use, cols, [op] if op in self.q else [])
                    for u in dict.fromkeys(p.ops[op].inputs):
                        made = p.tensors[u].producer
                        if made is None or made >= op:
                            continue
                        if u in index:  # rebuilt only when recomputed
                            if self.upper[self.R + index[u]]:
                                deeper.append((made, (*cols, self.R + index[u])))
                        elif u in self.unsaved:  # rebuilt unless checkpointed
                            link = (self.Z + self.chain[u],) if u in self.chain else ()
                            deeper.append((made, (*cols, *link)))
                paths = deeper
        self._reasons = out
        return out


def _picks(times: list[float], most: int) -> set[float]:
    """At most ``most`` of the sorted ``times``, evenly spread, first and last among them."""
    if not times:
        return set()
    return {times[int(q * (len(times) - 1) / max(most - 1, 1))] for q in range(most)}


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
    p = ctx.profile
    starts, ends = _packed_chain(ctx)
    forward = starts[ctx.first_backward] if ctx.first_backward < len(p.ops) else ends[-1]
    return forward - sum(op.time_s for op in p.ops[: ctx.first_backward]), ends[-1]


def _packed_costs(ctx: PlanContext) -> list[float]:
    """Host seconds per op of keep-all under a plan that moves something: its dispatch
    and the packs autograd makes before it."""
    p, host = ctx.profile, ctx.hw.host
    cost = [host.dispatch_s] * len(p.ops)
    for _, before in packs(p):
        cost[min(before, len(p.ops) - 1)] += host.pack_s
    return cost


def _pack_issued(ctx: PlanContext) -> dict[int, float]:
    """Per saved tensor, when the host of ``_packed_chain`` has issued every op before its
    first pack: a plan's pack hook, which issues the copy out, runs no earlier."""
    p = ctx.profile
    first: dict[int, int] = {}
    for tid, before in packs(p):
        first.setdefault(tid, before)
    issued = np.concatenate([[0.0], np.cumsum(_packed_costs(ctx))])
    return {tid: float(issued[min(before, len(p.ops))]) for tid, before in first.items()
            if tid >= 0}


def _packed_chain(ctx: PlanContext) -> tuple[list[float], list[float]]:
    """When each op of keep-all starts and ends, issued by a host that pays its dispatch
    and the packs before it: no earlier in any plan that moves something (so a copy
    out starts no earlier than its tensor's end here)."""
    issued = end = 0.0
    starts, ends = [], []
    for op, h in zip(ctx.profile.ops, _packed_costs(ctx), strict=True):
        issued += h
        starts.append(max(end, issued))
        end = starts[-1] + op.time_s
        ends.append(end)
    return starts, ends
