"""Where the runtime issues each offload's copy, for the runtime and the simulator alike.
Plain Python.

NOTE [offloads issued in groups]
    Each offload the runtime issues on its own costs the host a poll of the copies in
    flight, an event recorded on the compute stream and waited for on the copy stream,
    two stream switches and an event of its own: on an H200 about 40 us of device calls
    and as much again of the runtime's Python, beside the 15 us of the copy itself
    (``benchmarks/host_work.py``). A training step of gpt2-xl@12 at 50% offloads 82
    saved tensors, most of them a few ops apart. So an offloaded tensor's copy waits, held
    by the runtime, until the pack of the last offload of its group, and the group's
    copies are issued together: one poll, one event waited for, one stream switch, one
    event for all of them, a copy each. A group is a run of offloads (first packs of
    offloaded activations, in pack order) whose packs all come within ``OFFLOAD_WINDOW``
    ops, and ``OFFLOAD_DELAY_S`` of the profile's compute, of its first one: a copy
    starts at most that much later than alone. The
    simulator issues the copies where the runtime does (the copy stream starts one only
    once the compute stream has run the ops issued before the group's last pack, and the
    host pays the offloads there), so a plan sees what the delay costs it in memory and
    time. A write to a storage waiting in a group, the model's forward returning, and a
    refusal issue a group early; an offload with no profile to group it by is issued
    alone.
"""

from __future__ import annotations

from slackswap.core.profile import StepProfile

__all__ = ["OFFLOAD_DELAY_S", "OFFLOAD_WINDOW", "forward_packs", "offload_issues"]

OFFLOAD_WINDOW = 4  # ops: a module's few ops (gpt2's attention or MLP input side)
OFFLOAD_DELAY_S = 200e-6  # compute a group's first copy may wait for: under half of what
# copying one offloaded activation of gpt2-xl or llama-7b takes on the h200 link


def offload_issues(profile: StepProfile, offloaded: set[int], window: int = OFFLOAD_WINDOW,
                   delay_s: float = OFFLOAD_DELAY_S) -> dict[int, int]:
    """Offloaded tensor -> index (into :func:`forward_packs`) of the pack that issues its
    copy (NOTE [offloads issued in groups]). ``offloaded``: the tensors whose first pack
    offloads; a group's packs come within ``window`` ops and ``delay_s`` seconds of
    forward ops (the profile's) of its first."""
    packs = forward_packs(profile)
    if not offloaded:
        return {}
    ends = _op_ends(profile)  # ends[k]: the compute issued before op k runs that long
    issues: dict[int, int] = {}
    group: list[int] = []
    first = last = 0
    for j, (tid, before) in enumerate(packs):
        if tid not in offloaded or tid in issues or tid in group:
            continue
        if group and (before > first + window or ends[before] - ends[first] > delay_s):
            issues.update(dict.fromkeys(group, last))
            group = []
        if not group:
            first = before
        group.append(tid)
        last = j
    issues.update(dict.fromkeys(group, last))
    return issues


def _op_ends(profile: StepProfile) -> list[float]:
    """``ends[k]``: how long the ops before op ``k`` take run back to back (the compute a
    pack before op ``k`` comes after), for k up to the number of ops."""
    def make() -> list[float]:
        out, t = [0.0], 0.0
        for op in profile.ops:
            t += op.time_s
            out.append(t)
        return out
    return profile.derived("op-ends", make)


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
