"""The exact model on small steps: the bound's program (:mod:`slackswap.planners.bound`)
with every decision an integer, at every op where memory can matter, and with reload
timing as decisions; its plan simulated.

NOTE [exact model]
    The integer program is the bound's relaxation of the simulator made as tight as a
    small step allows: each activation is kept, offloaded or recomputed (0 or 1, not a
    fraction), each offloaded one is off the device or back at every op of the step
    (its reload is issued as the last op it is away at starts), and memory is checked
    at every op where keep-all memory, with every never-saved tensor a rebuild may read,
    exceeds the budget, not only at a dozen peaks. Each op the rows time has its own
    lateness (``_BoundLP.lateness``), so what the step has lost by the op where a
    reload's window opens shortens that window, and the runtime watches whole module
    segments, each one's ops at the host's cost. The D2H engine copies in producer
    order, so an offload is away only once everything offloaded before it has crossed
    (``_BoundLP.queue_rows``); a never-saved tensor is rebuilt, kept or offloaded (one
    of them), and held wherever a rebuild after the op may read it through other
    never-saved tensors. Every row still holds for every plan's simulated step, so its
    optimum is a retention no plan exceeds; its solution is a plan, simulated as any
    other, whose retention no optimum falls below. The true optimum lies between the
    two: when they meet it is known exactly, and a planner within half a point of the
    program's optimum is within half a point of the best plan. Sizes: one or two
    full-size layers solve in seconds to half a minute at most budgets (at tight ones on
    two layers, a minute without a proof); whole workloads are the LP bound's job.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.core.plan import Decision, Plan
from slackswap.core.result import SimResult
from slackswap.planners.bound import REBUILD_DEPTH, _BoundLP
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import Pressure

__all__ = ["Optimum", "exact_optimum", "program_value"]

# NOTE [read depth]
#     A rebuild may read an offloaded activation through a run of rebuilt ones: the
#     MLM head's LayerNorm is rebuilt from its GELU, dense and the layer's LayerNorm, four
#     links from the offloaded residual sum they come from, so the sum must be back
#     before the first of those rebuilds. The rows follow such runs ``rebuild_depth``
#     links deep (and, with ``tight``, as deep for the producers a rebuild may re-run);
#     deeper ones are left out, which only loosens the program. At three, it valued
#     SlackSwap's plan for two bert-large layers at 70% on h200, simulated at 74.03%, at
#     77.03 (it let the sum come back after the rebuild); at four and at six, at 74.03.
#     Deeper rows cost solve time where the decisions are free: the tightest program's
#     optimum there fell from 77.33 (5 s) to 76.75 at four (37 s) and 76.31 at six (76
#     s), but on one bert-large-mlm layer at 50% on h200 six did not prove in 120 s (its
#     bound 67.53, against 66.25 proven at three). So ``exact_optimum`` follows three
#     links unless asked for more, and ``program_value``, whose decisions are pinned and
#     solve in a second, six.
VALUE_REBUILD_DEPTH = 6

# NOTE [value without presolve]
#     HiGHS's presolve can cut off the program's best solution. For SlackSwap's plan for
#     one bert-large-mlm layer at 70% on h100-sxm, simulated at 78.5337%, it gave 78.5229
#     (0.011 points under, so no bound), though pinning the one reload that solution
#     delayed gave 78.5337; without presolve, 78.5337 at once. Without presolve the
#     stored two-layer cases take five to eight times as long (a minute each), so
#     ``program_value`` solves again without it only when its value falls under the
#     plan's simulated retention, which no correct solve gives. ``exact_optimum`` keeps
#     presolve, so its optimum may be off by as little (its gate allows half a point).


@dataclass(frozen=True)
class Optimum:
    """What the integer program says of one budget."""

    bound: float  # retention no plan exceeds (0.0: no plan fits)
    proven: bool  # solved to optimality (else ``bound`` is the solver's proven bound)
    plan: Plan | None  # the program's plan, with its reload times as prefetch points
    result: SimResult | None  # that plan, simulated

    @property
    def achieved(self) -> float:
        """The simulated retention of the program's plan (0.0 when it does not fit)."""
        return self.result.retention if self.result is not None and self.result.feasible else 0.0


def exact_optimum(ctx: PlanContext, time_limit_s: float = 120.0,
                  chain_depth: int = 4, op_ends: bool = False,
                  tight: bool = False, rebuild_depth: int = REBUILD_DEPTH) -> Optimum:
    """Solve the integer program of NOTE [exact model] for ``ctx`` (a small step). With
    ``op_ends``, memory is checked in backward as each op ends as well as when it starts,
    so a reload in flight during an op takes its room there: two to six times the solve
    time and the same optimum where measured, but a plan that reaches it more often
    (llama-7b@1 at 70%: 97.4 of 97.7, against 95.4 without). With ``tight`` as well
    (NOTE [tight timing]), the program's value of a plan comes closer to its simulated
    step: two to four times the solve time again. ``rebuild_depth``: how many links of
    rebuilt tensors the rows follow from a rebuild to what it reads (NOTE [read
    depth])."""
    if not ctx.reachable:
        return Optimum(0.0, True, None, None)
    lp = _program(ctx, op_ends, tight, chain_depth, rebuild_depth)
    if lp is None:
        return Optimum(1.0, True, None, None)
    overhead = lp.solve(integral=True, time_limit_s=time_limit_s)
    bound = lp.retention(overhead)
    if overhead is None or lp.x is None:
        return Optimum(bound, lp.proven if overhead is not None else True, None, None)
    timed = _plan_of(ctx, lp)
    untimed = timed.model_copy(update={"prefetch": {}})  # reloads as early as they fit
    plan, result = max(((p, ctx.simulate(p)) for p in (timed, untimed)),
                       key=lambda a: (a[1].feasible, a[1].retention))
    return Optimum(bound, lp.proven, plan, result)


def program_value(ctx: PlanContext, plan: Plan, time_limit_s: float = 120.0,
                  op_ends: bool = True, tight: bool = True,
                  rebuild_depth: int = VALUE_REBUILD_DEPTH) -> float:
    """What the program says ``plan``'s decisions retain at best (its reload timing left
    to the program): never under the plan's simulated retention, and as far over it as
    the model is loose for those decisions, so the place to look for what it misses.
    A checkpoint under the size floor, which the simulator keeps, counts as kept."""
    if not ctx.reachable:
        return 0.0
    lp = _program(ctx, op_ends, tight, chain_depth=4, rebuild_depth=rebuild_depth)
    if lp is None:
        return 1.0
    decisions = {name: Decision(d) for name, d in plan.decisions.items()}
    pins: list[tuple[int, bool]] = []  # (column, 1 or 0)
    for i, t in enumerate(lp.acts):
        d = decisions.get(t.name, Decision.KEEP)
        pins += [(lp.R + i, d == Decision.RECOMPUTE), (lp.OFF + i, d == Decision.OFFLOAD)]
    recomputed = [i for i, t in enumerate(lp.acts)
                  if decisions.get(t.name) == Decision.RECOMPUTE]
    held = {u for u in lp.chain if ctx.profile.tensors[u].name in decisions}
    read = _read_by_rebuilds(lp, recomputed, held)
    for u, col in lp.chain.items():
        d = decisions.get(ctx.profile.tensors[u].name)
        if d is None:  # left to the program: rebuilt, unless no rebuild reads it
            continue
        if u not in read:  # neither held nor copied, as simulated and run
            pins += [(lp.K + col, False), (lp.F + col, False)]
            continue
        if d == Decision.OFFLOAD and lp.upper[lp.F + col] == 0:
            d = Decision.KEEP
        pins += [(lp.K + col, d == Decision.KEEP), (lp.F + col, d == Decision.OFFLOAD)]
    for col, on in pins:
        if on:
            lp.row([(col, -1.0)], -1.0)
        else:
            lp.upper[col] = 0.0
    value = lp.retention(lp.solve(integral=True, time_limit_s=time_limit_s))
    simulated = ctx.simulate(plan)
    # under the plan's own simulation, which no correct solve gives: NOTE [value without
    # presolve]
    if simulated.feasible and value < simulated.retention - 1e-9:
        value = lp.retention(lp.solve(integral=True, time_limit_s=time_limit_s,
                                      presolve=False))
    return value


def _program(ctx: PlanContext, op_ends: bool, tight: bool, chain_depth: int,
             rebuild_depth: int) -> _BoundLP | None:
    """The integer program's rows for ``ctx``; None when no point needs a decision."""
    lp = _BoundLP(ctx, _every_point(ctx, op_ends), chain_depth, checkpoint_timing=True,
                  rebuild_timing=True, tight=tight, rebuild_depth=rebuild_depth)
    if not lp.pts:
        return None
    lp.build(thresholds=len(lp.acts) + 1, max_points=len(ctx.profile.ops))
    lp.timing_rows()
    lp.queue_rows()
    lp.lateness_rows()
    return lp


def _every_point(ctx: PlanContext, op_ends: bool = False
                 ) -> tuple[list[Pressure], list[Pressure]]:
    """Every op where memory can exceed the budget: keep-all memory over it, or, in
    backward, within reach of it once the never-saved tensors rebuilds read are back
    (there, with ``op_ends``, as the op starts and as it ends)."""
    p = ctx.profile
    extra = sum(p.tensors[u].bytes for u in p.never_saved)
    fwd, bwd = [], []
    for k, level in enumerate(ctx.memory):
        if k < ctx.first_backward and level > ctx.budget:
            fwd.append(Pressure(k, level - ctx.budget))
        elif k >= ctx.first_backward and level + extra > ctx.budget:
            bwd.append(Pressure(k, level - ctx.budget))
            if op_ends:
                bwd.append(Pressure(k, level - ctx.budget, ends=True))
    return fwd, bwd


def _plan_of(ctx: PlanContext, lp: _BoundLP) -> Plan:
    """The program's decisions, each offloaded activation reloaded as the last backward
    point it is away at starts (or, a point at an op's end, as the next op starts; or at
    the start of backward), and the never-saved tensors it keeps or offloads as
    checkpoints where a rebuild reads them."""
    x, decisions, prefetch = lp.x, {}, {}
    for i, t in enumerate(lp.acts):
        if x[lp.R + i] > 0.5:
            decisions[t.name] = Decision.RECOMPUTE
        elif x[lp.OFF + i] > 0.5:
            decisions[t.name] = Decision.OFFLOAD
            away = [pt.op + pt.ends for k, pt in enumerate(lp.bwd)
                    if pt.op < t.first_backward_use
                    and x[lp.D + i * lp.kp + len(lp.fwd) + k] > 0.5]
            if away:  # (issued as that op starts, after what it allocates; or after it)
                prefetch[t.name] = max(away)
        else:
            decisions[t.name] = Decision.KEEP
    # never-saved tensors kept or offloaded since forward, where a rebuild reads them (one
    # no rebuild reads is neither held nor copied in the simulated or the real step)
    p, checkpointable = ctx.profile, ctx.profile.checkpointable
    held = {u for u, col in lp.chain.items() if p.tensors[u].name in checkpointable
            and (x[lp.K + col] > 0.5 or x[lp.F + col] > 0.5)}
    read = _read_by_rebuilds(lp, [i for i in range(len(lp.acts)) if x[lp.R + i] > 0.5], held)
    for u in held & read:
        col = lp.chain[u]
        decisions[p.tensors[u].name] = (Decision.KEEP if x[lp.K + col] > 0.5
                                        else Decision.OFFLOAD)
    return ctx.plan("exact", decisions, prefetch)


def _read_by_rebuilds(lp: _BoundLP, recomputed: list[int], held: set[int]) -> set[int]:
    """The never-saved tensors the rebuilds of activations ``recomputed`` (indices into
    ``lp.acts``) read: their inputs, and the inputs of each one not ``held`` (rebuilt from
    its own inputs in turn)."""
    tensors = lp.p.tensors
    frontier = [u for i in recomputed for u in lp.unsaved_inputs(lp.acts[i].producer)]
    read: set[int] = set()
    while frontier:
        u = frontier.pop()
        if u in read:
            continue
        read.add(u)
        if u not in held:
            frontier += lp.unsaved_inputs(tensors[u].producer)
    return read
