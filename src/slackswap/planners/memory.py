"""The memory side of planning: where the keep-all step exceeds the budget, and which
evictions are gone by then."""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.planners.context import Candidate, PlanContext

__all__ = ["Pressure", "pressure_points", "evicted_at"]


@dataclass(frozen=True, slots=True)
class Pressure:
    """An op (item index in the keep-all schedule) where keep-all memory exceeds the budget."""

    op: int
    excess: int  # bytes over the budget at that op, keep-all
    # (exact model) memory as the op ends, with what the links moved while it ran
    ends: bool = False


def pressure_points(ctx: PlanContext, margin: int = 0, every: bool = False) -> list[Pressure]:
    """Local maxima of the keep-all memory curve that exceed ``budget - margin``; with
    ``every``, each op where it does (a cover whose evictions differ between neighbouring
    ops, or bring tensors back early, needs them all: NOTE [joint cover])."""
    mem, limit = ctx.memory, ctx.budget - margin
    points = []
    for k, level in enumerate(mem):
        before = mem[k - 1] if k > 0 else -1
        after = mem[k + 1] if k + 1 < len(mem) else -1
        if level > limit and (every or level >= before and level >= after):
            points.append(Pressure(k, level - limit))
    return points


def evicted_at(c: Candidate, op: int, ctx: PlanContext, free_time: float | None = None) -> bool:
    """Whether evicting ``c`` lowers memory while op ``op`` runs.

    In forward it must be past its last forward use (and, when offloaded, its copy must
    have landed by ``free_time``); in backward it must not be needed yet.
    """
    if op < ctx.first_backward:
        if c.freed_op >= op:
            return False
        return free_time is None or free_time <= ctx.op_start[op]
    return c.first_use > op
