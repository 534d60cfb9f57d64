"""Where the runtime issues each offload's copy, for the runtime and the simulator alike.
Plain Python.

NOTE [offloads issued in groups]
    Each offload the runtime issues on its own costs the host a poll of the copies in
    flight, an event recorded on the compute stream and waited for on the copy stream,
    two stream switches and an event of its own: on an H200 about 20 us of device calls
    and as much again of the runtime's Python, beside the 15 us of the copy itself
    (``benchmarks/host_work.py``). Several saved tensors are often packed one after
    another, before the same op (an op saving its inputs, a module's outputs saved
    together). So an offloaded tensor's copy waits, held by the runtime, until the last
    offload packed before the same op, and that group's copies are issued together: one
    compute wait, one stream switch, one event for all of them, a copy each (and no poll
    of the copies in flight where each has a deadline: NOTE [offloads free where
    simulated] in ``slackswap.runtime.copies``). No
    compute is issued between the packs of a group, so its copies wait for the same
    compute each would alone: the simulator's copies start where they did, and only the
    host pays for the offloads at the group's last pack. A write to a storage waiting in
    a group, the model's forward returning, backward beginning and a refusal issue a group
    early; an offload with no profile to group it by is issued alone. (Groups spanning
    ops would save more host time, but their copies would start only once the ops
    between had run: a delay the simulator, and the exact program that bounds it, would
    have to model.)
"""

from __future__ import annotations

from slackswap.core.profile import StepProfile

__all__ = ["forward_packs", "offload_issues"]


def offload_issues(profile: StepProfile, offloaded: set[int]) -> dict[int, int]:
    """Offloaded tensor -> index (into :func:`forward_packs`) of the pack that issues its
    copy: the last first pack of an offloaded tensor before the same op (NOTE [offloads
    issued in groups]). ``offloaded``: the tensors whose first pack offloads."""
    issues: dict[int, int] = {}
    group: list[int] = []
    last = at = -1
    for j, (tid, before) in enumerate(forward_packs(profile)):
        if tid in offloaded and tid not in issues and tid not in group:
            if group and before != at:  # compute was issued since: a new group
                issues.update(dict.fromkeys(group, last))
                group = []
            group.append(tid)
            last, at = j, before
    issues.update(dict.fromkeys(group, last))
    return issues


def forward_packs(profile: StepProfile) -> list[tuple[int, int]]:
    """Forward packs as (tensor id or -1, op index the pack runs before).

    ``StepProfile.saves`` counts the ops run before each pack: a pack runs after those
    ops were issued and before the next one is, so it delays that op's issue. A profile
    without ``saves`` (schema 2, hand-built) gets one pack per saved tensor, before the
    op after the first forward op that makes or reads it.
    """
    return list(profile.derived("packs", lambda: _packs(profile)))


def _packs(profile: StepProfile) -> list[tuple[int, int]]:
    if profile.saves:
        return list(profile.saves)
    first_bwd = next((op.index for op in profile.ops if op.phase == "backward"),
                     len(profile.ops))
    out = []
    for t in profile.tensors:
        uses = [u for u in (t.producer, *t.forward_consumers) if u is not None and u < first_bwd]
        if t.saved and uses:
            out.append((t.id, min(uses) + 1))
    return sorted(out, key=lambda p: (p[1], p[0]))
