"""An upper bound on the retention any plan can reach: a linear program on the same time
and memory model, solved with HiGHS (``scipy.optimize.milp``); with integer decisions and
every point, the exact model of :mod:`slackswap.planners.exact`.

NOTE [why this is a bound]
    Take any plan a planner makes and its simulated step. Let r_i, o_i be 1 when saved
    activation i is recomputed or offloaded (never for tensors under the size floor,
    and r_i never where no replay rebuilds i exactly, as ``PlanContext.plan`` keeps
    those), d_ik be 1 when the offloaded i is off the device while op k runs, q_P be 1
    when producer P is re-run in backward, and s_f, s_b the compute stream's idle time
    in forward and backward (s_b raised by what rebuilds take beyond sum q_P c_P).
    Then every constraint below holds for those values, so the optimum is at most the
    plan's overhead over the sum of op times T, and ideal / (T + optimum) is at least
    its retention (ideal: the eager keep-all step, NOTE [bound and the host]). Below,
    "late" is s_f + s_b + sum q_P c_P, what an op can start after its keep-all time t_k
    (in the exact model, s_f + s_b + rho_k in backward, rho_k no more than the rebuilds
    that can run before op k: ``_BoundLP.late``).

    - memory, forward op k (where keep-all exceeds the budget B): memory there is the
      keep-all memory less what evicted activations past their last forward use have
      freed, so  sum_{i in S_k} b_i (r_i + d_ik) >= M_k - B;
    - memory, backward op j: only activations not yet needed may be away, and one a
      rebuild for j or before reads (a saved input of a rebuilt producer, or of rebuilt
      activations it reads, up to REBUILD_DEPTH deep) came back with it, so
      sum_{first_use(i) > j} b_i (r_i + d_ij) - (those) >= M_j - B;
    - D2H: what is off the device at op k went over the link after its production
      and before op k started; production is at or after tau in the keep-all step
      issued by a host that pays dispatch and the runtime's packs (every moving plan
      packs), and, for a tensor autograd saves, after that host has reached its first
      pack (the pack hook issues the copy):
      sum_{i away at k, p_i >= tau} d_ik (latency + b_i / D2H) <= t_k + late - tau;
    - H2D: what was off the device at the last forward pressure point came back after
      it, and after forward (the runtime issues reloads from backward's unpacks; the
      simulator likewise starts none before backward), and before its first use j;
    - both links, away or not: every offload made at or after tau and first needed by
      op j crosses each link between the two (and, where the links slow each other
      down, both at once within the window: ``duplex_cost``), and each one's reload
      follows its copy;
    - chains: rebuilding i needs each never-saved input u of its producer back, either
      rebuilt (z_u >= r_i - k_u, recursively up the never-saved chain) or kept since
      forward as a checkpoint (k_u), which then occupies memory at every forward point
      past u's last forward use and at every backward point j before a rebuild that
      reads it, directly or through a never-saved tensor rebuilt after j, when u is
      never rebuilt (w_uj); or offloaded as a checkpoint (f_u), which then occupies
      memory the same way until its copy out lands (e_uk <= f_u, on the D2H rows; in the
      LP, forward points pool them by production time and backward ones count them
      away, ``checkpoint_timing``) and crosses both links before the first rebuild that
      reads it;
    - time: the step is at least the sum of op times, plus each re-run producer once
      (q_P >= r_i and q_P >= z_u for its outputs: one run makes them all), plus idle.

    Copy rates are the faster solo rates, and keep-all times are lower bounds on the
    plan's own times, so each relaxation only loosens the bound. Validity is checked
    against every assignment of small random steps, simulated (``tests/test_exact.py``).

NOTE [bound and the host]
    An op k of the plan starts no later than t_k + idle, with t_k the sum of the op times
    before it (the kernel-only keep-all time, as above), and no earlier than in the
    eager keep-all step (a plan's forward is the same ops, each costing the host at
    least its dispatch and waiting for more); so deadlines use t_k and production
    times the eager step's. A plan under budget moves something, so the runtime runs
    and packs every saved tensor. The host issues item k at the sum of the costs of the
    items up to it (``sim/host.py``) and the kernels from k on run after that, so for
    every cut op j the step lasts at least: dispatch and packs up to j, the watch of
    every re-run producer or kept checkpoint's producer up to j in forward (the runtime
    watches at least those), in backward a dispatch and a replay per producer re-run
    for an op up to j and an unpack per moved activation first needed by then; plus the
    op times from j on (and, for a forward cut, every rebuild's). Watching whole module
    segments, replays of never-saved chains and later unpacks are left out: they only
    add to a real plan's cost.

NOTE [tight timing]
    Rows the exact model adds with ``tight``, each true of every plan's simulated step.
    (1) A rebuild for op j that reads offloaded a through rebuilt never-saved tensors
    (the embeddings' LayerNorm output, rebuilt for the query projection's input) needs
    a back then: a is resident from j on, and it lands, then every producer on the way
    re-runs, before j starts (``early_read_rows``); its reload also follows its own copy
    out's landing in the D2H queue (``reload_after_landing``). (2) Op j's lateness
    lambda_j is at least what forward lost (phi: the keep-all chain's, or at any forward
    op the host's issue so far with the plan's watches, less the op's keep-all start)
    plus every producer re-run for what j or an earlier op needs (``rebuilt_by_rows``:
    what a rebuild by j reads is rebuilt too when it is recomputed or a never-saved
    tensor not checkpointed, through any number of links), and at most idle time plus
    the producers that may have re-run by j, each once: a producer re-runs only where a
    chain of rebuilt tensors leads to it from something needed by then
    (``rerun_reasons``). (3) A copy out starts once its producer's kernel has ended,
    which starts once the host has issued it, watches of the plan's watched segments
    included (``issue_of``; the queue's rows without them use the eager keep-all's
    production times). Measured on bert-large-mlm@2 at 30% with ``op_ends``, (2)'s
    chains and (3) value the plan of the best known decisions (simulated at 78.40) at
    78.61, not 79.33: the host's watches delay forward's copies out, and the memory
    they hold makes backward's first op wait. Measured on bert-large-mlm@1 with ``op_ends``
    (``benchmarks/exact_gap.py``): at 50% the optimum falls from 84.71 to 83.02 (the
    old optimum's plan, simulated at 77.04, is now valued at 81.6, not 84.7); at 60%
    from 89.57 to 89.07, its own plan simulating at 88.94; at 70% it stays 93.28, now
    reached by the program's own plan (92.59 before), so the best plan is known
    exactly. Off by default: minutes per case (50%: 489 s) where the gate's take
    seconds, and without ``op_ends`` the gate's optima do not move.
"""

from __future__ import annotations

import numpy as np

from slackswap.core.plan import MIN_PLANNED_BYTES, Decision
from slackswap.planners.bound_rows import (
    _DecisionRows,
    _HostRows,
    _kernel_starts,
    _MemoryRows,
    _pack_issued,
    _packed_chain,
    _Program,
    _QueueRows,
    _RebuildTiming,
    _ReloadTimingRows,
    _RerunRows,
    _TimeRows,
)
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import Pressure, pressure_points

__all__ = ["retention_bound"]

REBUILD_DEPTH = 3  # rebuilt activations a rebuild may read through, and one more


def retention_bound(ctx: PlanContext, thresholds: int = 4, max_points: int = 12,
                    chain_depth: int = 2) -> float:
    """The largest retention any plan could reach under the budget (1.0 if keep-all fits)."""
    if not ctx.reachable:
        return 0.0
    points = pressure_points(ctx)
    if not points:
        return 1.0
    # (the exact model's checkpoint and rebuild timing: a point or more lower on whole
    # bert-large and gpt2-xl, 0.5-3 s more to solve, about 10 s on llama-7b)
    lp = _BoundLP(ctx, _strongest(ctx, points, max_points), chain_depth,
                  checkpoint_timing=True, rebuild_timing=True)
    lp.build(thresholds, max_points)
    return lp.retention(lp.solve())


def relaxed_plan(ctx: PlanContext, thresholds: int = 4, max_points: int = 12,
                 chain_depth: int = 2) -> dict[str, Decision] | None:
    """The bound's LP solution rounded to a plan's decisions: each activation recomputed
    or offloaded where the relaxation does so at least half (recompute on a tie), kept
    otherwise; None when the LP has nothing to decide. A starting point for a search,
    not a plan that fits."""
    points = pressure_points(ctx) if ctx.reachable else []
    if not points:
        return None
    lp = _BoundLP(ctx, _strongest(ctx, points, max_points), chain_depth)
    lp.build(thresholds, max_points)
    try:
        if lp.solve() is None or lp.x is None:
            return None
    except RuntimeError:  # the solver gave up: no starting point from it
        return None
    x, decisions = lp.x, {}
    for i, t in enumerate(lp.acts):
        r, o = x[lp.R + i], x[lp.OFF + i]
        if r >= 0.5 and r >= o:
            decisions[t.name] = Decision.RECOMPUTE
        elif o >= 0.5:
            decisions[t.name] = Decision.OFFLOAD
    return decisions


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


class _BoundLP(_DecisionRows, _MemoryRows, _TimeRows, _HostRows, _RebuildTiming,
               _ReloadTimingRows, _QueueRows, _RerunRows, _Program):
    """The rows and columns of NOTE [why this is a bound], built a family at a time (each
    family a class of :mod:`slackswap.planners.bound_rows`).

    Columns: r (n), o (n), d (n * kp: offloaded i is off the device at point k), s_f,
    s_b, z (m), k (m), w (m * kb: checkpoint u still waits for a rebuild at backward
    point j), q and v (per producer a rebuild may re-run: re-run, watched), f (m: u
    offloaded as a checkpoint), then helper columns in [0, 1] the row families add
    (``column``). Rows are ``sum(coef * x) <= bound``, in gigabytes and milliseconds,
    which keeps HiGHS's tolerances meaningful.
    """

    def __init__(self, ctx: PlanContext, points: tuple[list[Pressure], list[Pressure]],
                 chain_depth: int, checkpoint_timing: bool = False,
                 rebuild_timing: bool = False, tight: bool = False,
                 rebuild_depth: int = REBUILD_DEPTH) -> None:
        self.ctx, self.p = ctx, ctx.profile
        # when offloaded checkpoints leave memory (their copies out timed at each point)
        # and what a checkpoint read through a rebuilt never-saved tensor holds: rows the
        # exact model has, which make a whole workload's LP several times slower to solve
        self.checkpoint_timing = checkpoint_timing
        # a backward op is late by the rebuilds that can run before it, not by all of
        # them (``late``): a row per deadline, as many as the exact model has points
        self.rebuild_timing = rebuild_timing
        # the exact model's tightest timing (``exact_optimum``'s ``tight``): reads of
        # offloads through rebuilt never-saved tensors, and lateness bounded from below
        # by what forward and the rebuilds so far lost and from above by the rebuilds
        # that can have run; several times the solve time on one or two layers
        self.tight = tight
        # links of rebuilt tensors the rows follow from a rebuild to what it reads (and,
        # with ``tight``, to the producers it may re-run); deeper ones are left out
        self.depth = rebuild_depth
        self._late: dict[int, list[tuple[int, float]]] = {}
        # point -> (column, tensor) of each offloaded checkpoint that may be away there
        self.away_checkpoints: dict[int, list[tuple[int, int]]] = {}
        self.lam: dict[int, int] = {}  # op -> its lateness column (``lateness``)
        self.fwd, self.bwd = points
        self.pts = self.fwd + self.bwd
        self._activations()
        self._never_saved(chain_depth)
        self._columns()
        self._rebuild_links()
        self._read_paths()
        self.entries: list[tuple[int, int, float]] = []
        self.rhs: list[float] = []
        self._upper_bounds()

    def _activations(self) -> None:
        """The saved activations a plan decides on, and when each can go and come back:
        freed after its last forward use, made (and packed) in the host-issued keep-all
        step, its copies' times on the link, the kernel-only deadlines."""
        ctx, link = self.ctx, self.ctx.hw.host_link
        p = self.p
        self.acts = [t for t in p.saved_activations
                     if t.producer is not None and t.first_backward_use is not None]
        acts = self.acts
        self.freed = [max([t.producer, *(c for c in t.forward_consumers
                                          if c < ctx.first_backward)]) for t in acts]
        # a copy out starts no earlier than its tensor is made with the runtime's packs
        self.issued_starts, self.made = _packed_chain(ctx)
        # ... and, for what autograd saves, no earlier than its first pack issues it
        ready = _pack_issued(ctx)
        self.produced = [max(self.made[t.producer], ready.get(t.id, 0.0)) for t in acts]
        self.starts = _kernel_starts(ctx)  # deadlines: none later, but for its idle time
        self.d2h = [link.latency_s + t.bytes / link.d2h_bandwidth for t in acts]
        self.h2d = [link.latency_s + t.bytes / link.h2d_bandwidth for t in acts]

    def _never_saved(self, chain_depth: int) -> None:
        """The never-saved tensors rebuilds read, ``chain_depth`` links up, each a column
        offset of z, k, w and f."""
        p, acts = self.p, self.acts
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

    def _columns(self) -> None:
        """Where each family of columns starts (the class docstring), and the time a
        rebuild inserts in backward: each re-run producer once."""
        p, acts = self.p, self.acts
        n, m, kp, kb = len(acts), len(self.chain), len(self.pts), len(self.bwd)
        self.n, self.kp, self.kb = n, kp, kb
        self.R, self.OFF, self.D = 0, n, 2 * n
        self.SF = 2 * n + n * kp
        self.SB = self.SF + 1
        self.Z = self.SB + 1
        self.K = self.Z + m
        self.W = self.K + m
        # one column per producer op a rebuild may re-run: it runs at least once when any
        # of its outputs is rebuilt, and is watched in forward then, or when it made a
        # checkpoint; an op that makes several rebuilt outputs costs one run, not one each
        self.made_by = sorted({t.producer for t in acts}
                              | {self.unsaved[u].producer for u in self.chain})
        self.Q = self.W + m * kb
        self.V = self.Q + len(self.made_by)
        self.F = self.V + len(self.made_by)  # f_u: u offloaded as a checkpoint
        self.cols = self.F + m
        self.q = {op: k for k, op in enumerate(self.made_by)}
        # time inserted in backward by the rebuilds: each re-run producer once
        self.recompute = [(self.Q + k, -p.ops[op].time_s * 1e3)
                          for k, op in enumerate(self.made_by)]

    def _rebuild_links(self) -> None:
        """Which rebuilds read each never-saved tensor, directly or through others."""
        acts = self.acts
        self.readers: dict[int, list[int]] = {u: [] for u in self.chain}  # rebuilt from u
        for i, t in enumerate(acts):
            for u in self.unsaved_inputs(t.producer):
                self.readers[u].append(i)
        # every never-saved v made from u, and the activations whose rebuild may read v,
        # directly or through other never-saved tensors (``memory_rows``)
        self.made_from: dict[int, list[int]] = {u: [] for u in self.chain}
        for v in self.chain:
            for u in self.unsaved_inputs(self.unsaved[v].producer):
                if u in self.chain:
                    self.made_from[u].append(v)
        # never-saved tensors a rebuild of another never-saved tensor may read, and those
        # made from u that only activations read
        self.feeds_chain = {u for u, made in self.made_from.items() if made}
        self.fed = {u: [v for v in made if v not in self.feeds_chain]
                    for u, made in self.made_from.items()}
        self.reach: dict[int, set[int]] = {}
        for v in sorted(self.chain, key=lambda v: -self.unsaved[v].producer):
            self.reach[v] = set(self.readers[v]).union(
                *(self.reach.get(w, ()) for w in self.made_from[v]))

    def _read_paths(self) -> None:
        """``read_by``: the rebuilds that read each activation, and what lies between."""
        p, acts, tight = self.p, self.acts, self.tight
        # rebuilds that read activation a, directly or through rebuilt activations (and,
        # with ``tight``, rebuilt never-saved tensors) between: (i, the columns
        # of those between, all 1 when the read happens, the producers re-run from a's
        # read to i's rebuild); a comes back with i's rebuild
        index = {t.id: i for i, t in enumerate(acts)}
        self.read_by: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
        for i, t in enumerate(acts):
            paths = [(u, (), (t.producer,)) for u in dict.fromkeys(p.ops[t.producer].inputs)]
            for _ in range(self.depth):  # deeper ones are left out: the bound only loosens
                deeper = []
                for u, cols, ops in paths:
                    if u in index and index[u] != i and self.R + index[u] not in cols:
                        a = index[u]
                        self.read_by.setdefault(a, []).append((i, cols, ops))
                        col = self.R + a
                    elif u in self.chain and tight and self.Z + self.chain[u] not in cols:
                        col = self.Z + self.chain[u]
                    else:
                        continue
                    made = p.tensors[u].producer
                    deeper += [(w, (*cols, col), (*ops, made))
                               for w in dict.fromkeys(p.ops[made].inputs)]
                paths = deeper

    def _upper_bounds(self) -> None:
        """Column bounds: what no planner's plan does is fixed at 0, idle time unbounded."""
        p, acts = self.p, self.acts
        # what no planner's plan does: move a tensor under the size floor (the simulator
        # keeps it) or recompute one no replay rebuilds exactly (``PlanContext.plan``)
        self.upper = np.ones(self.cols)
        self.upper[self.SF] = self.upper[self.SB] = np.inf  # idle time is unbounded
        offloadable = {p.checkpointable[n].id for n in p.offloadable_checkpoints
                       if p.checkpointable[n].bytes >= MIN_PLANNED_BYTES
                       and n not in p.unmovable}
        for u, col in self.chain.items():
            if u not in offloadable:
                self.upper[self.F + col] = 0.0
        recomputable, held = p.recomputable, p.unmovable
        for i, t in enumerate(acts):
            if t.bytes < MIN_PLANNED_BYTES or t.written_after_save or t.name in held:
                self.upper[[self.R + i, self.OFF + i]] = 0.0
            elif t.name not in recomputable:
                self.upper[self.R + i] = 0.0

    def build(self, thresholds: int, max_points: int) -> None:
        """Every row family."""
        self.choice_rows()
        self.memory_rows(thresholds)
        self.reload_rows(max_points)
        self.transfer_rows(thresholds, max_points)
        self.host_rows(max_points)

    def unsaved_inputs(self, op_index: int) -> list[int]:
        return [u for u in dict.fromkeys(self.p.ops[op_index].inputs) if u in self.unsaved]
