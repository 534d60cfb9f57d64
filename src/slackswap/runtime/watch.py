"""Which parts of a forward pass the runtime must watch to apply a plan, from its profile.

NOTE [watch only what the plan rebuilds]
    Watching an op (a ``TorchDispatchMode`` sees it) costs tens of microseconds of Python
    on the host; most ops of a step need none of it. Saved tensors are named when autograd
    packs them: the j-th pack of the step saves the tensor the profile's j-th pack saved
    (``StepProfile.saves``), so offloading and keeping watch nothing. Recompute needs
    recipes, so the ops a rebuild replays are watched, with the in-place ops that change a
    storage the plan moves or a rebuild reads (their versions keep values apart). Module
    hooks split the forward pass into segments (``StepProfile.module_events``), and the
    dispatch mode is on only in the segments that hold a watched op; inside one, the k-th
    op is the profile's op at the segment's start plus k, and must be the op it names.
    This module is plain Python: the runtime asks it once per plan, before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile
from slackswap.core.watched import (  # (the simulator and planners read them there)
    MODE_SENSITIVE,
    forward_tables,
    watched_ops,
    watched_segments,
)
from slackswap.runtime.checks import prepared

__all__ = ["Watch", "watch_for", "watched_ops", "watched_segments", "MODE_SENSITIVE"]


@dataclass(frozen=True)
class Watch:
    """What the runtime watches for one plan on one profile."""

    segments: list[bool]  # per segment: the dispatch mode is on in it
    starts: list[int]  # per segment: the profile's index of its first op
    ends: list[int]  # per segment: one past its last forward op
    pack_names: list[str | None]  # per pack of forward: the id of the tensor it saves
    op_names: dict[int, list[str | None]]  # watched op index -> ids of its outputs
    op_kinds: dict[int, str]  # watched op index -> its kind, checked as it runs
    bytes: dict[str, int]  # id -> storage bytes, checked as it is saved (NOTE [saves named
    # by their order] in ``runtime/saved.py``)
    dtypes: dict[str, str]  # id -> dtype name: a refusal says when the step's differs
    model_packs: int | None = None  # packs by the model's return (StepProfile.model_saves)
    # the places where the profiled step saved a tensor from outside it (NOTE [a longer
    # path holds no more than the profiled step] in ``runtime/saved.py``)
    outside: frozenset[str] = frozenset()

    @property
    def watched_ops(self) -> int:
        spans = zip(self.segments, self.starts, self.ends, strict=True)
        return sum(end - start for on, start, end in spans if on)


def can_watch(profile: StepProfile, device_type: str) -> bool:
    """The profile can guide the runtime on this device: it ran this step (traced or
    measured, not an analytic trace, whose ops can differ from a real step's), with the
    kernels this device runs, and has the tables. Otherwise the runtime watches every op
    and names tensors by the shared rule."""
    native = "cuda" if device_type == "cuda" else "native"
    return (profile.mode != "analytic" and bool(profile.module_events)
            and profile.kernels == native)


def watch_for(profile: StepProfile, plan: Plan) -> Watch:
    """The segments to watch so that every activation the plan recomputes has a recipe,
    every checkpoint it keeps is held, and every write that matters is seen (worked out
    once per plan)."""
    return prepared(profile, plan, lambda: _watch_for(profile, plan))


def _watch_for(profile: StepProfile, plan: Plan) -> Watch:
    f = forward_tables(profile)
    ops, tensors, ids = f.ops, profile.tensors, f.ids
    segments, starts, ends = watched_segments(profile, plan), f.starts, f.ends
    op_names = {i: [tensors[t].name for t in ops[i].outputs]
                for on, s, e in zip(segments, starts, ends, strict=True) if on for i in range(s, e)}
    return Watch(
        segments=segments, starts=list(starts), ends=list(ends),
        pack_names=[tensors[t].name if t >= 0 else None for t, _ in profile.saves],
        op_names=op_names,
        op_kinds={i: ops[i].kind for i in op_names},
        # activations a forward op made (a batch view's record has the view's bytes)
        bytes={n: tensors[t].bytes for n, t in ids.items() if tensors[t].producer is not None},
        dtypes={n: tensors[t].dtype for n, t in ids.items() if tensors[t].producer is not None},
        model_packs=profile.model_saves,
        outside=frozenset(tensors[t].name for t, _ in profile.saves
                          if t >= 0 and tensors[t].name is not None
                          and tensors[t].name.startswith(("external:", "input:"))),
    )
