"""What a plan asks of the runtime, worked out from its profile before anything runs."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from slackswap.core.offloads import offload_issues
from slackswap.core.plan import MIN_PLANNED_BYTES, Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError
from slackswap.sim.schedule import build_schedule
from slackswap.sim.simulate import offload_frees, simulate

__all__ = ["Prepared", "prepare", "prepared", "offload_deadlines", "held_limit",
           "checkpoint_releases", "check_recomputable"]

T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """What the runtime needs from a plan's profile, worked out once per plan."""

    first_use: dict[str, int]  # saved activation -> the backward op that first needs it
    checkpoints: dict[str, int]  # unsaved tensor kept -> release position
    prefetch: list[tuple[str, int]]  # reloads in the order the simulator issues them
    offloaded_bytes: int  # what the plan offloads: the host-buffer pool keeps as much
    produced_at: dict[str, int]  # saved activation -> the forward op that made it
    # NOTE [offloads issued in groups]: offloaded activation -> the pack (by index) that
    # issues its group's copies
    issued_at: dict[str, int]
    # the plan's decisions other than keep that the runtime carries out: an offloaded
    # checkpoint no rebuild reads is not copied (the step has no use for it)
    moved: dict[str, Decision]


# id(plan) -> (plan, profile, its decisions and prefetch points, what was worked out), by
# weak reference: a training loop applies one plan step after step
_PREPARED: dict[int, tuple[Any, Any, tuple, Any]] = {}


def prepared(profile: StepProfile, plan: Plan, make: Callable[[], T]) -> T:
    """``make()``, worked out once for this plan and profile (as long as the plan's
    decisions and prefetch points stay as they were), keyed by what ``make`` is."""
    key = (id(plan), getattr(make, "__qualname__", id(make)))
    cached = _PREPARED.pop(key, None)
    if (cached is not None and cached[0]() is plan and cached[1]() is profile
            and cached[2][0] == plan.decisions and cached[2][1] == plan.prefetch):
        _PREPARED[key] = cached  # the most recently used last
        return cached[3]
    state = (dict(plan.decisions), dict(plan.prefetch))  # copies: compared next time
    value = make()
    if len(_PREPARED) >= 64:  # the least recently used goes (a dict keeps its order;
        # functools' caches key by the arguments, not by a weak reference to a plan)
        del _PREPARED[next(iter(_PREPARED))]
    _PREPARED[key] = (weakref.ref(plan), weakref.ref(profile), state, value)
    return value


def prepare(profile: StepProfile, plan: Plan) -> Prepared:
    """Check the plan against its profile (refusing what cannot run exactly) and work out
    the runtime's tables: once per plan, since a training loop applies it every step."""
    def make() -> Prepared:
        plan.check(profile)
        check_recomputable(profile, plan)
        schedule = build_schedule(profile, plan)
        issues = offload_issues(profile, {c.tensor for c in schedule.d2h})
        need = {profile.tensors[c.tensor].name: i
                for i, c in enumerate(schedule.h2d)}
        checkpoints = checkpoint_releases(profile, plan)
        order = sorted(plan.prefetch.items(),
                       key=lambda kv: (kv[1], need.get(kv[0], len(need)), kv[0]))
        return Prepared(
            first_use={n: t.first_backward_use for n, t in profile.by_name.items()
                       if t.first_backward_use is not None},
            checkpoints=checkpoints,
            prefetch=order,
            offloaded_bytes=sum(
                t.bytes for n, d in plan.decisions.items()
                if d == Decision.OFFLOAD and (t := (profile.by_name.get(n)
                                                    or profile.checkpointable.get(n)))
                is not None and t.bytes >= MIN_PLANNED_BYTES),
            produced_at={n: t.producer for n, t in profile.by_name.items()
                         if t.producer is not None},
            issued_at={profile.tensors[tid].name: j for tid, j in issues.items()},
            moved={n: d for n, d in plan.decisions.items() if d != Decision.KEEP and (
                n not in profile.checkpointable or n in checkpoints)},
        )
    return prepared(profile, plan, make)


def offload_deadlines(profile: StepProfile, plan: Plan) -> dict[str, int]:
    """Offloaded activation -> the op before which the simulated step freed its device
    memory (NOTE [offloads free where simulated]), on the link of the profile's hardware;
    once per plan. Empty where that hardware cannot be loaded here: offloads then free
    when their copies are seen done."""
    def make() -> dict[str, int]:
        try:
            return offload_frees(profile, plan)
        except InputError:
            return {}
    return prepared(profile, plan, make)


def held_limit(profile: StepProfile, plan: Plan) -> int | None:
    """The most device memory the simulated step holds under the plan (its peak), above
    which a step's saved activations are off the profiled path (NOTE [a longer path
    holds no more than the profiled step] in ``runtime/saved.py``); once per plan. None
    where the profile's hardware cannot be loaded here."""
    def make() -> int | None:
        try:
            return simulate(profile, plan).peak_bytes
        except InputError:
            return None
    return prepared(profile, plan, make)


def checkpoint_releases(profile: StepProfile, plan: Plan) -> dict[str, int]:
    """Unsaved tensors the plan keeps or offloads as checkpoints for rebuilds, and the
    backward op after whose rebuilds each may go: where the simulator's schedule frees
    it (or its reload). An offloaded one no rebuild reloads is left out: not copied."""
    kept = {profile.checkpointable[n].id: n for n, d in plan.decisions.items()
            if d != Decision.RECOMPUTE and n in profile.checkpointable}
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
        if decision != Decision.RECOMPUTE or name not in profile.by_name:
            continue
        if name not in profile.recomputable:
            t = profile.by_name[name]
            ops = ", ".join(sorted({op.kind for op in profile.ops
                                    if op.phase == "forward" and not op.replayable
                                    and t.id in op.outputs}))
            why = (f"its rebuild replays {ops}, not known to replay bit for bit" if ops else
                   "its rebuild reads an input that cannot itself be rebuilt bit for bit")
            raise InputError(
                f"cannot recompute '{name}': {why}; keep or offload it (plans from "
                "slackswap.plan never recompute it)"
            )


def shapes_differ(profile: StepProfile | None, given: list[tuple[list[int], str]]) -> str:
    """The sentence saying a batch is not the one a plan was made for: the shapes (and
    dtypes, where those alone differ) of the batch's tensors, ``(shape, dtype name)``
    each, and those the plan was made for when its profile is at hand."""
    shapes = [shape for shape, _ in given]
    if profile is None:
        return (f"plan was made for a batch of other shapes or dtypes than {shapes} (give "
                "apply the plan's profile= to see which)")
    # the batch's (named by its keys): not a tensor from outside the step the model read
    # (a constant a module-level cache holds)
    inputs = [t for t in profile.tensors if t.kind == "input" and t.name is not None]
    planned = [t.shape for t in inputs]
    if sorted(planned) != sorted(shapes):
        return f"plan was made for a batch of shapes {planned}, not {shapes}"
    return (f"plan was made for a batch of dtypes {[t.dtype for t in inputs]}, not "
            f"{[dtype for _, dtype in given]} (shapes {shapes})")
