"""Which forward ops the runtime watches to apply a plan (NOTE [watch only what the plan
rebuilds] in :mod:`slackswap.runtime.watch`), worked out from the profile alone.

Plain Python, below both the simulator and the planners (which price the host time the
watching costs) and the runtime (which watches them): each reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile

__all__ = ["MODE_SENSITIVE", "ForwardTables", "forward_segments", "forward_tables", "watched_ops",
           "watched_segments"]

# NOTE [ops a dispatch mode changes]
#     Some composite ops take another path while any ``TorchDispatchMode`` is on (ATen
#     treats every tensor as subclass-like then): ``ctc_loss`` converts its length
#     tensors to lists without one, and with one calls the ``Tensor`` overload, which
#     saves seven tensors for backward instead of five. A profile is traced under a mode,
#     so the runtime watches the segments that run these ops whatever the plan: the step
#     then saves what its profile says it saves (measured: wav2vec2's CTC loss, refused
#     half way through forward without this).
MODE_SENSITIVE = frozenset({"_ctc_loss"})


@dataclass(frozen=True)
class ForwardTables:
    """The forward pass's tables a watch is worked out from, whatever the plan."""

    ops: list  # forward ops, in order
    ids: dict[str, int]  # tensor id (name) -> index
    writers: dict[int, list[int]]  # tensor -> the forward ops that write it
    mutated: frozenset[int]  # tensors a forward op other than their producer writes
    inplace: list[int]  # forward in-place ops
    first_save: dict[int, int]  # tensor -> ops run before autograd first packs it
    starts: list[int]  # per segment: the profile's index of its first op
    ends: list[int]  # per segment: one past its last forward op
    segments_of: dict[int, list[int]]  # forward op -> the segments that hold it
    last_read: dict[int, int]  # saved activation -> the last backward op that reads it
    sensitive: list[int]  # forward ops of a ``MODE_SENSITIVE`` kind


def _forward(profile: StepProfile) -> ForwardTables:
    ops = [op for op in profile.ops if op.phase == "forward"]
    tensors = profile.tensors
    writers: dict[int, list[int]] = {}
    for op in ops:
        for t in op.outputs:
            if op.inplace or tensors[t].producer == op.index:
                writers.setdefault(t, []).append(op.index)
    first_save: dict[int, int] = {}
    for t, before in profile.saves:
        first_save.setdefault(t, before)
    starts = [0, *(min(e, len(ops)) for e in profile.module_events)]
    ends = [*starts[1:], len(ops)]
    segments_of: dict[int, list[int]] = {}
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        for i in range(start, end):
            segments_of.setdefault(i, []).append(k)
    last_read = {t.id: last for t in tensors
                 if t.saved and t.producer is not None
                 and (last := t.last_backward_read) is not None}
    return ForwardTables(
        ops=ops, ids={t.name: t.id for t in tensors if t.name is not None}, writers=writers,
        mutated=frozenset(t for op in ops if op.inplace for t in op.outputs
                          if tensors[t].producer != op.index),
        inplace=[op.index for op in ops if op.inplace], first_save=first_save,
        starts=starts, ends=ends, segments_of=segments_of, last_read=last_read,
        sensitive=[op.index for op in ops if op.kind in MODE_SENSITIVE])


def forward_tables(profile: StepProfile) -> ForwardTables:
    """The forward pass's tables (worked out once per profile)."""
    return profile.derived("watch", lambda: _forward(profile))


def forward_segments(profile: StepProfile) -> list[tuple[int, int]]:
    """Each segment of the forward pass as (index of its first op, one past its last)."""
    f = forward_tables(profile)
    return list(zip(f.starts, f.ends, strict=True))


def watched_segments(profile: StepProfile, plan: Plan) -> list[bool]:
    """Per segment of the forward pass (``StepProfile.module_events``), whether the
    runtime watches it for ``plan``: the ops a rebuild replays, and the in-place writes
    that matter, are in the segments watched."""
    f = forward_tables(profile)
    ops, tensors, ids = f.ops, profile.tensors, f.ids
    recompute = {ids[n] for n, d in plan.decisions.items() if d == Decision.RECOMPUTE and n in ids}
    moved = {ids[n] for n, d in plan.decisions.items() if d != Decision.KEEP and n in ids}
    checkpoints = {ids[n] for n, d in plan.decisions.items()
                   if d != Decision.RECOMPUTE and n in profile.checkpointable}

    # tensors a rebuild must make again, and the ops that write them; checkpoints too,
    # since a second backward through a retained graph rebuilds them once released. A
    # saved input is made again too where backward has unpacked it for the last time
    # before the rebuild (NOTE [gone tensors] in ``sim/schedule.py``): autograd holds it
    # no more (a checkpoint's rebuild time is not known: its saved inputs are read).
    latest: dict[int, int] = {}  # tensor -> the latest rebuild walked from it (-1: none)
    watched: set[int] = set()
    todo = [(t, tensors[t].first_backward_use) for t in recompute]
    todo += [(t, None) for t in checkpoints]
    while todo:
        t, at = todo.pop()
        when = -1 if at is None else at
        if latest.get(t, -2) >= when:  # walked already for a rebuild as late or later
            continue
        latest[t] = when
        for index in f.writers.get(t, ()):
            watched.add(index)
            for u in ops[index].inputs:
                if u == t or tensors[u].kind != "activation":
                    continue
                if (not tensors[u].saved or u in f.mutated  # (``gone_before``, tabled)
                        or at is not None and f.last_read.get(u, at) < at):
                    todo.append((u, at))
    # Writes that change a value after the plan has saved it to move, or after a watched
    # op read it (an op that writes a tensor from outside the step may not return it:
    # batch norm's running statistics); writes before then are part of the value.
    first_read: dict[int, int] = {}
    for index in sorted(watched):
        for u in ops[index].inputs:
            first_read.setdefault(u, index)
    for index in f.inplace:
        op = ops[index]
        if any((t in moved and index >= f.first_save.get(t, 0))
               or (t in first_read and index > first_read[t])
               for t in (*op.outputs, *op.inputs)):
            watched.add(index)

    watched.update(f.sensitive)
    starts, ends = f.starts, f.ends
    segments = [False] * len(starts)  # each segment that holds a watched op
    for i in watched:
        for k in f.segments_of.get(i, ()):
            segments[k] = True
    # a segment that runs no op keeps the mode as it was: it is switched only where
    # watching changes (an op the profile does not have there is then seen, and refused)
    for k in range(1, len(segments)):
        if starts[k] == ends[k]:
            segments[k] = segments[k - 1]
    return segments


def watched_ops(profile: StepProfile, plan: Plan) -> set[int]:
    """The forward ops in the segments watched for ``plan``."""
    f = forward_tables(profile)
    spans = zip(watched_segments(profile, plan), f.starts, f.ends, strict=True)
    return {i for on, start, end in spans if on for i in range(start, end)}
