"""What a plan asks of the runtime, worked out from its profile before anything runs."""

from __future__ import annotations

from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError
from slackswap.sim.schedule import build_schedule

__all__ = ["checkpoint_releases", "check_recomputable"]


def checkpoint_releases(profile: StepProfile, plan: Plan) -> dict[str, int]:
    """Unsaved tensors the plan keeps as checkpoints for rebuilds, and the backward op
    after whose rebuilds each may go: where the simulator's schedule frees it."""
    kept = {profile.checkpointable[n].id: n for n, d in plan.decisions.items()
            if d == "keep" and n in profile.checkpointable}
    if not kept:
        return {}
    schedule = build_schedule(profile, plan)
    releases = {}
    for item in schedule.items:
        for rid in item.frees:
            name = kept.get(schedule.residencies[rid].tensor)
            if name is not None and item.position >= schedule.first_backward:
                releases[name] = item.position
    return releases


def check_recomputable(profile: StepProfile, plan: Plan) -> None:
    """Refuse, before anything runs, to recompute an activation that an in-place op
    changes after a forward op has read it: the values backward needs are gone."""
    for name, decision in plan.decisions.items():
        t = profile.by_name.get(name)
        if decision != "recompute" or t is None:
            continue
        reads = [c for c in t.forward_consumers if t.id not in profile.ops[c].outputs]
        if not reads:
            continue
        for op in profile.ops[min(reads) + 1:]:
            if op.phase == "forward" and op.inplace and t.id in op.outputs:
                raise InputError(
                    f"cannot recompute '{name}': {op.kind} (op {op.index}) changes it in "
                    f"place after op {min(reads)} read it; keep or offload it instead"
                )
