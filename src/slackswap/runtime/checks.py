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
    """Refuse, before anything runs, to recompute an activation whose rebuild would replay
    an op not known to replay bit for bit (NOTE [replayable ops])."""
    for name, decision in plan.decisions.items():
        if decision != "recompute" or name not in profile.by_name:
            continue
        if name not in profile.recomputable:
            t = profile.by_name[name]
            ops = ", ".join(sorted({op.kind for op in profile.ops
                                    if op.phase == "forward" and not op.replayable
                                    and t.id in op.outputs}))
            raise InputError(
                f"cannot recompute '{name}': its rebuild replays "
                f"{ops or 'an input that cannot be rebuilt'}, not known to replay bit for "
                "bit; keep or offload it (plans from slackswap.plan never recompute it)"
            )
