"""From a profile and a plan to the work of one step: compute items, residencies, copies.

The schedule is static: it fixes which kernels run in what order (recompute inserted
before the backward op that needs it), which memory each kernel or reload allocates and
after which kernel it is freed. The engine (:mod:`slackswap.sim.engine`) then times it.

NOTE [recompute semantics]
    Before backward op ``j`` every activation it needs is made resident. A kept tensor is
    resident already; an offloaded one waits for its reload; a recomputed one (or a tensor
    that was never saved but is needed to rebuild one) is rebuilt by re-running its
    producer, inputs first, recursively. Rebuilt *saved* activations stay until their last
    backward use; rebuilt intermediates are freed after the group that needed them and
    rebuilt again if a later group needs them. A kept or reloaded tensor that a rebuild
    reads stays resident until that rebuild, unless backward has already unpacked it for
    the last time: then autograd holds it no more, it is gone, and a rebuild that reads it
    makes it again (NOTE [gone tensors]). A re-run op makes all its outputs: a copy of
    an output still resident lasts as long as the re-run; one of an output that is gone is
    held with the group.

NOTE [gone tensors]
    A saved tensor is gone after the last backward op that reads it (``end``): kept,
    reloaded or rebuilt, no copy of it outlives that op but in the runtime's rebuild group.

NOTE [rebuild groups] (as in the runtime, ``slackswap.runtime.saved``)
    The runtime holds what rebuilds make for one backward op, and the reloaded or rebuilt
    saved tensors backward unpacks for the last time, until backward unpacks a tensor
    whose first backward use is another op. The schedule holds them as long
    (:meth:`_Builder._group_resets`), past their last use when a later op reads a
    tensor first needed by the same op. A tensor joins the group at the op where backward
    unpacks it for the last time (its last read, or the op that first needs it), not
    where autograd lets go of it (``released_after``, NOTE [held until let go]): the
    group then holds it until the next group begins even when autograd let go before
    (Perceiver's cross-attention query, unpacked by ``BmmBackward`` for its first matmul
    and let go after its second, was held by the runtime four ops more than simulated).
    A checkpoint a rebuild reads (kept since forward, or reloaded) is held the same way:
    the runtime lets go of it when a group after the last rebuild that reads it begins
    (``checkpoint_releases`` in ``slackswap.runtime.checks``, from this schedule), not
    after that rebuild (Longformer's layer input, read by the rebuild of a key for the
    first matmul of a batched matmul's backward, stayed through the second).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

from slackswap.core.plan import MIN_PLANNED_BYTES, Decision, Plan
from slackswap.core.profile import StepProfile, TensorRecord
from slackswap.core.watched import forward_tables, watched_ops

__all__ = ["Item", "Residency", "Copy", "Schedule", "build_schedule", "min_working_set",
           "on_compute_stream"]


@dataclass(slots=True)
class Item:
    """One kernel on the compute stream."""

    op: int  # profile op index
    position: int  # profile op index it runs at (recompute runs at the op that needs it)
    duration: float
    recompute: bool
    allocs: list[int] = field(default_factory=list)  # residencies allocated at start
    frees: list[int] = field(default_factory=list)  # residencies whose last use this is
    needs: list[int] = field(default_factory=list)  # reloads (index into h2d) to wait for
    reads: list[int] = field(default_factory=list)  # residencies read (for invariant checks)


@dataclass(slots=True)
class Residency:
    """One stay of a tensor in device memory."""

    tensor: int
    bytes: int
    source: Literal["compute", "reload"]
    holds: int = 1  # releases before it is freed: last-use item end (+ D2H completion)


@dataclass(slots=True)
class Copy:
    """A host-link transfer of one tensor."""

    tensor: int
    bytes: int
    residency: int  # D2H: released when done; H2D: allocated at start
    after_item: int = -1  # D2H: starts after this item (the producer) ends
    issue_position: int = 0  # H2D: may start once the compute stream reaches this op
    need_item: int = 0  # H2D: first item that waits for it
    d2h: int = -1  # H2D: the offload that must finish first


@dataclass(slots=True)
class Schedule:
    items: list[Item]
    residencies: list[Residency]
    d2h: list[Copy]
    h2d: list[Copy]
    ideal_time: float  # keep-all with no limit and no host: the sum of op times
    first_backward: int  # op index where backward starts


def _is_activation(t: TensorRecord) -> bool:
    return t.kind == "activation"


def build_schedule(profile: StepProfile, plan: Plan) -> Schedule:
    """Lay out the step's compute items, device residencies and copies under ``plan``."""
    return _Builder(profile, plan).build()


@dataclass(frozen=True, slots=True)
class _Step:
    """What the schedule takes from the profile whatever the plan: worked out once."""

    first_backward: int  # op index where backward starts
    named: dict[str, TensorRecord]  # saved activations and checkpointable tensors by id
    planned: dict[str, TensorRecord]  # ... those a plan's decision applies to
    kept: dict[int, Decision]  # every saved activation a plan may decide on, kept
    end: dict[int, int]  # saved tensor -> the last backward op that reads it
    # saved tensor -> the last backward op that reads or first needs it: backward has
    # unpacked it for the last time by then, though autograd may hold it longer
    # (``released_after``: NOTE [rebuild groups])
    unpacked: dict[int, int]
    # backward op -> activations the step lets go of after it, past their last read
    # (NOTE [held until let go] in ``slackswap.profiling.recorder``)
    released: dict[int, list[int]]
    mutators: dict[int, list[int]]  # tensor -> forward in-place ops on it
    resets: list[int]  # backward ops before which the rebuild group goes
    forward: _Forward
    # backward op -> (op, seconds, activations it reads or first needs, those of them
    # backward unpacks there for the last time, (activation, bytes) it makes)
    backward: list[tuple[int, float, list[int], list[int], list[tuple[int, int]]]]
    ideal_time: float  # the sum of op times
    # (forward op, the ops that write it, small activation it reads): NOTE [small unseen
    # tensors held by recipes]
    small_reads: list[tuple[int, list[int], int]]
    # tensor -> its residency, for those resident when forward ends that stay then with
    # every saved activation kept (NOTE [leaving after forward])
    stays: dict[int, int]


@dataclass(frozen=True, slots=True)
class _Forward:
    """Forward's items and residencies, the same under every plan: each activation
    forward makes stays resident until forward ends (a plan acts only from there)."""

    items: list[tuple[int, float, list[int], list[int]]]  # op, seconds, allocs, reads
    residencies: list[tuple[int, int]]  # tensor, bytes
    uses: list[list[int]]  # residency -> forward items reading it
    live: dict[int, int]  # tensor -> its residency when forward ends


def _lay_out_forward(profile: StepProfile, first_backward: int) -> _Forward:
    tensors = profile.tensors
    items: list[tuple[int, float, list[int], list[int]]] = []
    residencies: list[tuple[int, int]] = []
    uses: list[list[int]] = []
    live: dict[int, int] = {}
    released: dict[int, list[int]] = {}  # NOTE [held until let go], within forward
    real = profile.mode in ("measured", "traced")
    for t in tensors:
        if t.released_after is not None and t.released_after < first_backward:
            released.setdefault(t.released_after, []).append(t.id)
        # NOTE [dropped by the program]: a saved activation the program still holds is
        # resident, moved or not, until the program lets go of it (in a real step's
        # profile; the end of forward when that was not in forward)
        if real and t.saved and t.producer is not None and first_backward > 0:
            dropped = first_backward - 1 if t.dropped_after is None else t.dropped_after
            released.setdefault(min(dropped, first_backward - 1), []).append(t.id)
    for op in profile.ops[:first_backward]:
        k, allocs, reads = op.index, [], []
        for tid in dict.fromkeys(op.inputs):
            if (rid := live.get(tid)) is not None:
                uses[rid].append(k)
                reads.append(rid)
        for tid in op.outputs:
            t = tensors[tid]
            if t.producer == op.index and _is_activation(t) and tid not in live:
                live[tid] = rid = len(residencies)
                residencies.append((tid, t.bytes))
                uses.append([k])
                allocs.append(rid)
        for tid in op.outputs:  # an input changed in place is read by the op too
            rid = live.get(tid)
            if rid is not None and k not in uses[rid]:
                uses[rid].append(k)
                reads.append(rid)
        for tid in released.get(k, ()):  # held, not read, until the step lets go of it
            rid = live.get(tid)
            if rid is not None and k not in uses[rid]:
                uses[rid].append(k)
        items.append((op.index, op.time_s, allocs, reads))
    return _Forward(items, residencies, uses, live)


def _step(profile: StepProfile) -> _Step:
    ops, tensors = profile.ops, profile.tensors
    first_backward = next((op.index for op in ops if op.phase == "backward"), len(ops))
    end: dict[int, int] = {}  # NOTE [gone tensors]
    unpacked: dict[int, int] = {}
    released: dict[int, list[int]] = {}
    needed_at: dict[int, list[int]] = {}
    for t in profile.saved_activations:
        last = t.last_backward_read
        if t.producer is not None and last is not None:
            end[t.id] = last
            unpacked[t.id] = max([*t.backward_consumers, *(
                () if t.first_backward_use is None else (t.first_backward_use,))],
                default=last)
    for t in tensors:  # NOTE [held until let go]
        if t.released_after is not None and t.released_after >= first_backward \
                and _is_activation(t):
            released.setdefault(t.released_after, []).append(t.id)
        if t.first_backward_use is not None:
            needed_at.setdefault(t.first_backward_use, []).append(t.id)
    mutators: dict[int, list[int]] = {}
    for op in ops[:first_backward]:
        for tid in op.outputs:
            if tensors[tid].producer != op.index and op.inplace:
                mutators.setdefault(tid, []).append(op.index)
    named = profile.by_name | profile.checkpointable
    planned = {n: t for n, t in named.items()
               if t.producer is not None or n in profile.checkpointable}
    kept = {t.id: Decision.KEEP for t in profile.saved_activations
            if t.producer is not None and t.name is not None}
    backward = []
    for op in ops[first_backward:]:
        wanted = [tid for tid in dict.fromkeys([*op.inputs, *needed_at.get(op.index, [])])
                  if _is_activation(tensors[tid])]
        makes = [(tid, tensors[tid].bytes) for tid in op.outputs
                 if tensors[tid].producer == op.index and _is_activation(tensors[tid])]
        last = [tid for tid in wanted if unpacked.get(tid) == op.index]
        backward.append((op.index, op.time_s, wanted, last, makes))
    forward = _lay_out_forward(profile, first_backward)
    stays = {tid: rid for tid, rid in forward.live.items()
             if _keeps(tensors[tid], kept, first_backward)}
    return _Step(first_backward, named, planned, kept, end, unpacked, released, mutators,
                 _group_resets(profile), forward, backward,
                 sum(op.time_s for op in ops), _small_reads(profile), stays)


def _keeps(t: TensorRecord, decision: dict[int, Decision], first_backward: int) -> bool:
    """Stays on the device from production to its last use, or until the step lets go
    of it in backward (NOTE [held until let go]: one no backward op reads, held by a
    module-level cache, as Mask2Former's sine position embedding)."""
    d = decision.get(t.id)
    return d == Decision.KEEP or (d is None and (bool(t.backward_consumers) or (
        t.released_after is not None and t.released_after >= first_backward)))


def _small_reads(profile: StepProfile) -> list[tuple[int, list[int], int]]:
    """NOTE [small unseen tensors held by recipes]
        The runtime records the ops of the forward segments it watches for a plan (NOTE
        [watch only what the plan rebuilds] in ``runtime/watch.py``). A watched op that
        reads an activation under ``MIN_PLANNED_BYTES`` that no watched op wrote (made in
        a segment nobody watched) holds it in its recipe, as a tensor from outside the
        step (NOTE [small unseen tensors] in ``runtime/recording.py``), until the step's
        recipes go: to the end of the step. Each is a few hundred bytes, and many only in
        small models, but Llama in bf16 (its attention's inputs cast to fp32, the bf16
        projections unsaved) measured 2% over its recompute-only plans' budgets when the
        schedule let them go where forward did. So every forward op's reads of such an
        activation are listed here with the ops that write it, and a plan whose watched
        ops read one that none of its writers is among holds it to the step's end."""
    if profile.mode == "analytic" or not profile.module_events:
        return []  # the runtime watches every op of such a step (``can_watch``)
    writers, tensors = forward_tables(profile).writers, profile.tensors
    reads = []
    for op in profile.ops:
        if op.phase != "forward":
            break
        for u in dict.fromkeys(op.inputs):
            t = tensors[u]
            if (t.kind == "activation" and t.producer is not None and u not in op.outputs
                    and t.bytes < MIN_PLANNED_BYTES
                    and op.index not in (w := writers.get(u, [t.producer]))):
                reads.append((op.index, w, u))
    return reads


def _group_resets(profile: StepProfile) -> list[int]:
    """The backward ops before which the runtime lets its rebuild group go (NOTE [rebuild
    groups]): those that unpack a planned tensor first needed by another op than the last
    unpack's. An op that reads a tensor first needed by the same op as the last unpack's
    (an in-place ReLU's output, read by max pooling's backward and then by the ReLU's)
    keeps the group open."""
    positions: dict[int, set[int]] = {}
    for t in profile.saved_activations:
        if (t.producer is None or t.name is None or t.bytes < MIN_PLANNED_BYTES
                or t.first_backward_use is None):
            continue
        for j in {t.first_backward_use, *t.backward_consumers}:
            positions.setdefault(j, set()).add(t.first_backward_use)
    resets, current = [], None
    for j in sorted(positions):
        if positions[j] != {current}:
            resets.append(j)
            current = max(positions[j])
    return resets


class _Builder:
    def __init__(self, profile: StepProfile, plan: Plan) -> None:
        self.p = profile
        self.ops = profile.ops
        self.tensors = profile.tensors
        step = profile.derived("schedule", lambda: _step(profile))
        self.decision = dict(step.kept)
        self.decided: list[int] = []  # tensors the plan decides on
        for name, d in plan.decisions.items():  # saved activations, and unsaved tensors
            t = step.planned.get(name)  # kept or offloaded as checkpoints
            if t is not None:
                self.decision[t.id] = d if t.bytes >= MIN_PLANNED_BYTES else Decision.KEEP
                self.decided.append(t.id)
        self.stays = step.stays
        self.prefetch = {step.named[n].id: i for n, i in plan.prefetch.items()}
        # checkpoints the runtime holds for rebuilds, kept or reloaded (NOTE [rebuild groups])
        self.checkpoints = {profile.checkpointable[n].id for n, d in plan.decisions.items()
                            if d != Decision.RECOMPUTE and n in profile.checkpointable}
        self.first_backward = step.first_backward
        self.items: list[Item] = []
        self.res: list[Residency] = []
        self.d2h: list[Copy] = []
        self.h2d: list[Copy] = []
        self.uses: dict[int, list[int]] = {}  # residency -> items reading it
        self.live: dict[int, int] = {}  # tensor -> residency resident in backward
        self.reload_of: dict[int, int] = {}  # tensor -> h2d index
        self.d2h_of: dict[int, int] | None = None  # tensor -> d2h index
        self.mutators = step.mutators
        self.end = step.end
        self.unpacked = step.unpacked
        self.released = step.released
        self.resets = step.resets
        self.forward, self.backward = step.forward, step.backward
        self.ideal_time = step.ideal_time
        self.small_reads = step.small_reads
        self.profile, self.plan = profile, plan
        self.first_item: dict[int, int] = {}  # backward op -> its first item (rebuilds first)
        self.members: list[tuple[int, int]] = []  # (residency, op) joined that op's group

    # -- helpers --------------------------------------------------------------------------
    def _gone(self, tid: int, pos: int) -> bool:
        """A saved tensor backward has unpacked for the last time before op ``pos``."""
        end = self.end.get(tid)
        return end is not None and end < pos

    def _new_residency(self, t: TensorRecord, source: str, item: int) -> int:
        rid = len(self.res)
        self.res.append(Residency(t.id, t.bytes, source))  # type: ignore[arg-type]
        self.uses[rid] = [item]
        if source == "compute":
            self.items[item].allocs.append(rid)
        return rid

    def _read(self, rid: int, item: int) -> None:
        self.uses[rid].append(item)
        self.items[item].reads.append(rid)

    def _hold_small_reads(self) -> None:
        """NOTE [small unseen tensors held by recipes]: held to the step's end."""
        if not self.small_reads or not self.items:
            return
        watched = watched_ops(self.profile, self.plan)
        if not watched:
            return
        last = len(self.items) - 1
        for reader, writers, u in self.small_reads:
            rid = self.forward.live.get(u)
            if (rid is not None and reader in watched and last not in self.uses[rid]
                    and not any(w in watched for w in writers)):
                self.uses[rid].append(last)

    # -- forward ------------------------------------------------------------------------
    def _forward(self) -> None:
        # (laid out once per profile: copied, as the build extends it; a forward item's
        # allocations and reads are never extended, the only lists shared with the
        # layout: a backward item or a rebuild allocates and reads what comes later)
        f = self.forward
        self.items = [Item(op, op, seconds, False, allocs, [], [], reads)
                      for op, seconds, allocs, reads in f.items]
        self.res = [Residency(tid, size, "compute") for tid, size in f.residencies]
        self.uses = dict(enumerate(list(u) for u in f.uses))
        # End of forward: what backward will not find resident leaves the live set.
        # NOTE [leaving after forward]: a tensor whose decision is the one it has with
        # every saved activation kept leaves or stays as it does then (``_Step.stays``),
        # so only those the plan decides on are asked, in residency order (the
        # order of forward's live set): the same live set, and the same copies in the
        # same order, as asking every resident tensor, without a pass over all of them
        # per plan. (The live set is only looked up, never walked: its order is moot.)
        self.live = live = dict(self.stays)
        decided = [tid for tid in dict.fromkeys(self.decided) if tid in f.live]
        for tid in sorted(decided, key=f.live.__getitem__):
            t, rid = self.tensors[tid], f.live[tid]
            if _keeps(t, self.decision, self.first_backward):
                live[tid] = rid
                continue
            live.pop(tid, None)
            if self.decision.get(tid) == Decision.OFFLOAD:
                self.res[rid].holds += 1
                self.d2h.append(Copy(tid, t.bytes, rid, after_item=t.producer))
        self.d2h.sort(key=lambda c: c.after_item)

    # -- backward -----------------------------------------------------------------------
    def _ensure(self, tid: int, pos: int, made: list[int]) -> int | None:
        """Make ``tid`` resident before the item being built at ``pos``; its residency."""
        t = self.tensors[tid]
        if t.kind != "activation":  # (``_is_activation`` and ``_gone`` written out: hot)
            return None
        end = self.end.get(tid)
        gone = end is not None and end < pos and tid not in made  # (not made again here)
        if (rid := self.live.get(tid)) is not None:
            if not gone:
                return rid
            del self.live[tid]
        if self.decision.get(tid) == Decision.OFFLOAD and not gone:
            return self._reload(t, pos)
        assert t.producer is not None and self.ops[t.producer].phase == "forward"
        # Re-run the producer, then the forward in-place ops that mutated the tensor.
        for index in (t.producer, *self.mutators.get(tid, ())):
            op = self.ops[index]
            reads = []
            for x in dict.fromkeys(op.inputs):
                if (r := self._ensure(x, pos, made)) is not None:
                    reads.append(r)
                    if x in self.checkpoints:  # the group after this one lets go of it
                        self.members.append((r, pos))
            k = len(self.items)
            self.items.append(Item(op.index, pos, op.time_s, True, [], [], [], []))
            for rid in reads:
                self._read(rid, k)
            for out in op.outputs:
                o = self.tensors[out]
                made_here = o.producer == op.index and _is_activation(o)
                gone = made_here and self._gone(out, pos) and out not in made
                if gone:  # a sibling whose first copy backward is done with
                    self.live.pop(out, None)
                if made_here and out not in self.live:
                    rid = self.live[out] = self._new_residency(o, "compute", k)
                    if gone or self.decision.get(out) != Decision.RECOMPUTE:
                        made.append(out)  # an intermediate: freed after the group
                        if out == tid or not self.mutators.get(out):
                            # (a sibling changed in place later in forward is not this
                            # value: the runtime lets it go with the re-run)
                            self.members.append((rid, pos))
                elif made_here:  # the kernel makes a copy of a resident sibling too
                    self._new_residency(o, "compute", k)
                elif out in self.live and k not in self.uses[self.live[out]]:
                    self._read(self.live[out], k)
        return self.live[tid]

    def _reload(self, t: TensorRecord, pos: int) -> int:
        k = len(self.items)  # the item about to be built needs it
        rid = len(self.res)
        self.res.append(Residency(t.id, t.bytes, "reload"))
        self.uses[rid] = []
        # (the runtime issues reloads from backward's unpacks: none before backward)
        issue = max(min(self.prefetch.get(t.id, self.first_backward), pos), self.first_backward)
        if self.d2h_of is None:  # the offloads are all known once forward is laid out
            self.d2h_of = {c.tensor: i for i, c in enumerate(self.d2h)}
        d2h = self.d2h_of[t.id]
        self.reload_of[t.id] = len(self.h2d)
        self.h2d.append(Copy(t.id, t.bytes, rid, issue_position=issue, need_item=k, d2h=d2h))
        self.live[t.id] = rid
        return rid

    def _drop_unread_checkpoints(self) -> None:
        """An offloaded checkpoint no rebuild reloads is not copied (as in the runtime):
        its device memory goes after its last forward use."""
        unread = {id(c) for c in self.d2h if c.tensor not in self.reload_of
                  and self.tensors[c.tensor].name in self.p.checkpointable}
        if not unread:
            return
        old = self.d2h
        for c in old:
            if id(c) in unread:
                self.res[c.residency].holds -= 1
        self.d2h = [c for c in old if id(c) not in unread]
        index = {id(c): i for i, c in enumerate(self.d2h)}
        for copy in self.h2d:
            copy.d2h = index[id(old[copy.d2h])]

    def _backward(self) -> None:
        live, end, decision, res = self.live, self.end, self.decision, self.res
        uses = self.uses
        moved = (Decision.OFFLOAD, Decision.RECOMPUTE)
        for index, seconds, wanted, last, makes in self.backward:
            made: list[int] = []
            self.first_item[index] = len(self.items)
            reads = []
            for tid in wanted:  # (``_ensure``'s first case written out: most are resident)
                rid = live.get(tid)
                if rid is None or ((e := end.get(tid)) is not None and e < index
                                   and tid not in made):
                    rid = self._ensure(tid, index, made)
                if rid is not None:
                    reads.append(rid)
            for tid in last:  # unpacked for the last time: the group holds it
                if tid in live and decision.get(tid) in moved:
                    self.members.append((live[tid], index))
            k = len(self.items)
            item = Item(index, index, seconds, False, [], [], [], [])  # (no factory calls)
            self.items.append(item)
            for rid in dict.fromkeys(reads):  # (``_read`` written out)
                uses[rid].append(k)
                item.reads.append(rid)
            for tid in self.released.get(index, ()):  # NOTE [held until let go]
                rid = live.get(tid)
                if rid is not None and k not in uses[rid]:
                    uses[rid].append(k)
            for tid, size in makes:  # (``_new_residency`` written out)
                if tid not in live:
                    live[tid] = rid = len(res)
                    res.append(Residency(tid, size, "compute"))
                    uses[rid] = [k]
                    item.allocs.append(rid)
            for tid in made:  # intermediates rebuilt for this op only
                live.pop(tid, None)

    def build(self) -> Schedule:
        self._forward()
        self._backward()
        self._drop_unread_checkpoints()
        self._hold_small_reads()
        for rid, pos in self.members:  # held until the group after ``pos`` begins
            r = bisect.bisect_right(self.resets, pos)
            if r < len(self.resets):
                self.uses[rid].append(self.first_item[self.resets[r]] - 1)
        # Every residency has a reader, and its last reader frees it: a computed one is
        # read by the item that makes it, a reload by the item ``_ensure`` made it for
        # (reloads are made only on demand: a prefetch point moves one, never makes one).
        for rid, items in self.uses.items():
            assert items, f"residency {rid} (tensor {self.res[rid].tensor}) has no reader"
            self.items[max(items)].frees.append(rid)
        for copy in self.h2d:  # the first item that reads it: a rebuild for the same op,
            copy.need_item = min(self.uses[copy.residency])  # if one came after the reload
        self.h2d.sort(key=lambda c: (c.issue_position, c.need_item))
        for h, copy in enumerate(self.h2d):
            self.reload_of[copy.tensor] = h
        reload = {copy.residency: h for h, copy in enumerate(self.h2d)}
        if reload:  # (forward's items read no reload)
            for item in self.items[len(self.forward.items):]:
                needs = {reload[rid] for rid in item.reads if rid in reload}
                if needs:  # (most read none: their empty list stays)
                    item.needs = sorted(needs)
        return Schedule(self.items, self.res, self.d2h, self.h2d,
                        ideal_time=self.ideal_time,
                        first_backward=self.first_backward)


def on_compute_stream(sched: Schedule, d2h_s: list[float], h2d_s: list[float]) -> Schedule:
    """``sched`` with every copy a compute item of its own (``d2h_s``, ``h2d_s``: each
    copy's seconds), as PyTorch's activation-offloading pass issues them on the compute
    stream: a copy out right after the last forward item that reads the tensor (freeing
    it there, as the copy engine's completion would), a reload right before the first
    item that needs it (allocating it). The copy engines are left with nothing to do.
    The items share their lists of residencies with ``sched``'s."""
    last_read: dict[int, int] = {}  # residency -> last forward item reading it
    for k, item in enumerate(sched.items):
        if item.position >= sched.first_backward:
            break
        for rid in (*item.allocs, *item.reads):
            last_read[rid] = k
    after: dict[int, list[Item]] = {}  # item -> copies out right after it
    for copy, seconds in zip(sched.d2h, d2h_s, strict=True):
        k = last_read[copy.residency]
        position = sched.items[k].position
        after.setdefault(k, []).append(Item(sched.items[k].op, position, seconds, False,
                                            frees=[copy.residency]))
    before: dict[int, list[Item]] = {}  # item -> reloads right before it
    for copy, seconds in zip(sched.h2d, h2d_s, strict=True):
        need = sched.items[copy.need_item]
        before.setdefault(copy.need_item, []).append(Item(need.op, need.position, seconds,
                                                          False, allocs=[copy.residency]))
    items = []
    for k, item in enumerate(sched.items):
        items += before.get(k, [])
        # (its lists shared, not copied: ``simulate`` lays the schedule out for this
        # call alone and keeps only this one; nothing changes a schedule's lists after)
        items.append(Item(item.op, item.position, item.duration, item.recompute,
                          item.allocs, item.frees, [], item.reads))
        items += after.get(k, [])
    return Schedule(items, sched.residencies, [], [], sched.ideal_time, sched.first_backward)


def min_working_set(profile: StepProfile) -> tuple[int, int]:
    """The largest set of activations one op needs at once, and that op: no plan goes below."""
    return profile.working_set
