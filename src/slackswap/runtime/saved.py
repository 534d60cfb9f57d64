"""The saved-tensor hooks: what autograd holds for each saved tensor under a plan, and
how it comes back in backward (kept, reloaded from host memory, or rebuilt).

NOTE [saves named by their order]
    A save is named by its place in the step: the j-th tensor autograd saves is the one
    the profile's j-th save saved (NOTE [watch only what the plan rebuilds]). A step that
    saves other tensors than its profile (tokens routed to experts in other numbers, a
    path the profile did not take) would give the rest of its saves others' names, and
    their decisions, first uses and prefetch points: measured on a Switch model, reloads
    issued 21 ops early and 7.6% over the budget. So under a plan that moves anything
    each named save of a planned size is checked against the profile's bytes, and the
    step is refused at the first that differs.

NOTE [a recompute the step cannot replay]
    Saves of the same sizes are no proof of the same path: a model that skips a block
    (a flag set between steps, a schedule) whose next block is shaped as it is saves
    the next block's tensors under the skipped one's names. Those ops ran in segments the
    watch left dark, so a save the plan recomputes came with no recipe, and the step was
    refused as a plan recomputing an op that cannot replay (a hand-made plan's error,
    naming an in-place write). Under a profile, a plan recomputes only what the profile
    found replayable (checked before the model runs), so a save the plan recomputes
    that the step cannot replay says the step is another than the profiled one: it is a
    path change, and the step runs again as plain PyTorch (NOTE [a step off the profiled
    path] in ``runtime/block.py``). Without a profile every op is watched and named by
    the profiler's rule, and the plan's error stands.

NOTE [values, not storages]
    A storage changed in place between two saves holds two values; the runtime keys what
    it holds by (storage, how many recorded ops had written it), so each save gets back
    the value it saved.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from slackswap.core.plan import MIN_PLANNED_BYTES, Decision
from slackswap.errors import NESTED_BACKWARD, InputError, PathChanged, VerifyError, path_changed
from slackswap.profiling.recorder import dtype_name
from slackswap.runtime.copies import HostCopies
from slackswap.runtime.recipes import (
    Node,
    detached,
    geometry,
    op_info,
    plain_strided,
    view_of,
)
from slackswap.runtime.recording import Recorder
from slackswap.runtime.replay import Replayer
from slackswap.runtime.state import StepState
from slackswap.runtime.stats import RuntimeStats
from slackswap.runtime.values import Value
from slackswap.runtime.watch import Watch

__all__ = ["SavedValues", "OffPathSaves", "kept_as_saved"]

_KEEP = Decision.KEEP
_NO_LIMIT = sys.maxsize
_PARAMETER = torch.nn.Parameter
_REF = weakref.ref
_H = TypeVar("_H", "_Saved", "_Packed")
# a handle of a forward that left the profiled path and ran again, read in backward
_DROPPED = ("backward reached a tensor saved by a forward pass that left the profiled path "
            "and ran again as plain PyTorch: that first try's graph was let go of; take the "
            "loss from what the model returned")


def _modified(what: str) -> RuntimeError:
    """Autograd's own check, which saved-tensor hooks switch off: ``what`` changed in place
    after it was saved for backward."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} changed after it was saved for backward (as autograd "
        "checks without slackswap)")


class _Saved:
    """A saved tensor the runtime leaves as autograd saved it (a parameter, the batch, a
    small or unnamed activation): held with its version, since autograd's own check that
    it has not changed in place before backward is off under saved-tensor hooks."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version

    def drop(self) -> None:
        """NOTE [a step off the profiled path]: the tensor goes, whoever holds this."""
        self.tensor = None

    def unpack(self) -> torch.Tensor:
        if self.tensor is None:
            raise InputError(_DROPPED)
        if self.tensor._version != self.version:
            raise _modified(f"a tensor of shape {list(self.tensor.shape)}")
        return self.tensor


# NOTE [no cyclic GC until backward]
#     Python's cyclic collector is paused from a block's entry (NOTE [no cyclic GC in
#     forward] in ``runtime/block.py``) until the step's backward has run, not only
#     through forward. The runtime keeps a small record per saved tensor and per watched
#     op until backward (about 3,800 more tracked objects than plain PyTorch's forward
#     leaves on gpt2-xl@12), several in reference cycles (a node and its op's outputs).
#     Resumed at the block's exit, the collector at once walked all of them (a young
#     collection: 1.4 ms a step on a CPU, 0.5 for plain PyTorch), inside the forward
#     that the GPU waits on (on the H200 the compute stream waited for the host in
#     forward only). Resumed after backward, the same walk comes where the host is ahead
#     of the GPU: the work is moved out of forward, not removed. It resumes at the end of
#     the first backward through saved tensors of a step while paused (a callback queued
#     on the autograd engine at the first unpack in that backward; a backward that raised
#     runs no callback, and resumes as autograd lets go of it), when autograd has let go
#     of every handle the runtime packed in the paused step once the model's forward
#     returned (a graph dropped without backward; another step's graph dropped resumes
#     nothing), when the next block opens, when the model's forward raises (under
#     ``attach`` the block is then closed unaware, or on Ctrl-C not at all, while an
#     interactive session keeps the traceback and with it the graph), or at the block's
#     exit when it packed nothing or was refused. Only a collector the runtime paused is
#     resumed: a program that turned it off itself keeps it off (but one that calls
#     ``gc.disable()`` while the runtime holds it paused cannot be told apart, and sees
#     it resumed after backward). What a reference cycle holds (an activation in a
#     cycle of the model's own objects) is then freed only after backward: the profiled
#     step runs with the collector paused the same way (``_run_step`` in
#     ``profiling/step.py``), so the profile releases it where the runtime does.
class _CollectorPause:
    """The cyclic collector, paused by the runtime (NOTE [no cyclic GC until backward])."""

    __slots__ = ("held", "owner", "pauses", "waiting")

    def __init__(self) -> None:
        self.held = False
        self.owner: SavedValues | None = None  # the step's values, whose handles it waits on
        self.pauses = 0  # how many times it paused the collector
        self.waiting = False  # a resume is queued on a backward running now

    def hold(self, owner: SavedValues) -> None:
        if gc.isenabled():
            gc.disable()
            self.held, self.owner, self.waiting = True, owner, False
            self.pauses += 1  # (what was queued for an earlier pause resumes nothing)

    def release(self) -> None:
        if self.held:
            self.held, self.owner = False, None
            gc.enable()

    def after_backward(self) -> None:
        """Resume when the backward running now ends: a backward that raised runs no
        callback (its ``_Resume`` goes with it, and resumes); saved tensors read outside
        backward (``grad_fn._saved_self``) leave it to the next unpack."""
        if _graph_task() != -1:
            self.waiting = True
            _queue_callback(_Resume(self.pauses))


class _Resume:
    """Queued on autograd's engine: resumes the pause it was queued in as backward ends,
    or as autograd lets go of it unrun (the backward raised); not a later step's."""

    __slots__ = ("pause",)

    def __init__(self, pause: int) -> None:
        self.pause = pause

    def __call__(self) -> None:
        COLLECTOR.waiting = False
        if COLLECTOR.pauses == self.pause:
            COLLECTOR.release()

    __del__ = __call__


COLLECTOR = _CollectorPause()
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_graph_task = torch._C._current_graph_task_id


class _Packed:
    """What autograd holds for a saved tensor the plan names: the tensor itself (kept), or
    how to get it back. When autograd lets go of it, the runtime lets go of what it held
    for it."""

    __slots__ = ("owner", "decision", "vkey", "name", "node", "geometry", "device",
                 "tensor", "saved", "version", "modified", "__weakref__")

    def __init__(self, owner: SavedValues, decision: str, vkey: Value, name: str | None,
                 node: Node | None, t: torch.Tensor, tensor: torch.Tensor | None) -> None:
        self.owner, self.decision, self.vkey, self.name, self.node = (
            owner, decision, vkey, name, node)
        self.device = t.device
        self.tensor = tensor  # kept activations only
        self.geometry = geometry(t) if tensor is None else None
        # autograd's own check, which its hooks switch off: the saved tensor must not
        # change in place before backward reads it (a kept one shares its version counter)
        self.saved = weakref.ref(t) if tensor is None else None
        self.version = t._version
        self.modified = False

    def __del__(self) -> None:
        if self.owner is not None:
            self.owner.handle_gone(self.vkey, self.tensor is not None)

    def drop(self) -> None:
        """NOTE [a step off the profiled path]: what the runtime holds for this handle
        goes now, as if autograd had let go of it, whoever still holds it."""
        owner, self.owner = self.owner, None
        if owner is not None:
            kept, self.tensor = self.tensor is not None, None
            owner.handle_gone(self.vkey, kept)

    def check_version(self) -> None:
        saved = self.saved() if self.tensor is None else self.tensor
        if self.modified or (saved is not None and saved._version != self.version):
            raise _modified(f"'{self.name}'")

    @property
    def upto(self) -> int:
        return self.vkey[1]


class SavedValues:
    """Pack and unpack for one ``slackswap.apply`` block, over all the steps it runs:
    handles of an earlier step stay valid (they hold their own nodes), and what the
    runtime holds for a value goes when autograd lets go of its last handle."""

    def __init__(self, decisions: dict[str, str], verify: bool, watch: Watch | None,
                 first_use: dict[str, int], prefetch: list[tuple[str, int]],
                 copies: HostCopies, produced_at: dict[str, int] | None = None,
                 free_before: dict[str, int] | None = None,
                 issued_at: dict[str, int] | None = None,
                 held_limit: int | None = None) -> None:
        self.decisions = decisions  # the plan's non-keep decisions
        self.verify = verify
        self.watch = watch
        self.first_use = first_use  # saved activation -> backward op that first needs it
        self.prefetch = prefetch  # reloads, in the order they are issued
        self.produced_at = produced_at or {}  # saved activation -> its forward op
        # offloaded activation -> the op before which its device memory goes
        # (NOTE [offloads free where simulated])
        self.free_before = free_before or {}
        # NOTE [offloads issued in groups] in ``slackswap.core.offloads``: offloaded
        # activation -> the pack (by index) that issues its group's copies; an offload at
        # or past it (a value written in place since, offloaded again) is issued at once
        self.issued_at = issued_at or {}
        self.stats = RuntimeStats()
        self.copies = copies
        self.replayer = Replayer(self)
        self.in_forward = False  # the model's forward is running (unpack there is refused)
        # NOTE [a longer path under a plan that keeps everything] and NOTE [a longer path
        # holds no more than the profiled step]
        self.pack_limit = watch.model_packs if watch is not None else None
        self.held_limit = held_limit if held_limit is not None else _NO_LIMIT
        # the places where the profiled step saved a tensor from outside it
        self.outside = watch.outside if watch is not None else frozenset()
        # across steps, by value; each lives as long as a packed handle for it does, so a
        # second backward through a retained graph can reload or rebuild it again
        self.host: dict[Value, torch.Tensor] = {}  # host copies
        self.originals: dict[Value, torch.Tensor] = {}  # verify=True only
        self.handles: dict[Value, int] = {}  # packed handles autograd holds
        self.back: dict[Value, torch.Tensor] = {}  # rebuilt or reloaded, not yet unpacked
        self.pending: dict[Value, int] = {}  # packed handles not yet unpacked
        self.outstanding = 0  # moved handles not yet unpacked, all values together
        # made by rebuilds for one backward op (NOTE [rebuild groups])
        self.group: dict[Value, torch.Tensor] = {}
        self.group_position: int | None = None
        self.new_step(StepState({}), None)

    def new_step(self, state: StepState, recorder: Recorder | None) -> None:
        self.stats = RuntimeStats(_link_of=self.copies.link)
        self.state, self.recorder = state, recorder
        self.group, self.group_position = {}, None
        # checkpoints held for rebuilds: storage -> (release position, tensor)
        self.kept_checkpoints: dict[int, tuple[int, torch.Tensor]] = {}
        for vkey in getattr(self, "host_checkpoints", {}):  # a step that never ran backward
            self._drop_host_checkpoint(vkey)
        # offloaded checkpoints: value -> release position (the host copy is in ``host``)
        self.host_checkpoints: dict[Value, int] = {}
        self.offloaded: dict[str, Value] = {}  # activation id -> value, this step
        self.next_prefetch = 0
        # saved values resident on the device -> (bytes, storage key)
        self.held: dict[Any, tuple[int, int]] = {}
        self.holders: dict[int, int] = {}  # storage key -> how many of ``held`` hold it
        # kept saves in the step's own places: storage key -> bytes, and their sum
        # (NOTE [a longer path holds no more than the profiled step])
        self.sized: dict[int, int] = {}
        self.sized_bytes = 0
        self.checked = False
        # the saves the model's forward may make in this step, until it returns (NOTE [a
        # longer path holds no more than the profiled step]; ``apply.run_forward``)
        self.limit_now = self.pack_limit
        self.held_now = self.held_limit
        # weak references to this step's handles over activations, packed in the model's
        # forward (NOTE [a step off the profiled path])
        self.made: list[Any] = []

    # -- forward -----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        # the hottest path of forward (a call per saved tensor, about 340 a step of
        # gpt2-xl@12): attribute lookups hoisted, the common cases first
        # (``benchmarks/host_work.py`` times it)
        # long because one function call per saved tensor is itself the cost it avoids
        recorder, state, copies = self.recorder, self.state, self.copies
        if copies.undated:  # NOTE [buffers held by events]
            copies.poll()
        name = recorder.next_pack() if recorder is not None else None
        limit = self.limit_now
        if limit is not None and recorder.packs_seen > limit and self.in_forward:
            raise _longer_path(limit)
        if type(t) is _PARAMETER:  # a weight as the model holds it (a third of the saves
            return _Saved(t)  # of a transformer): a leaf, so held as it is
        if not plain_strided(t):  # kept as autograd saved it
            return self._made(_Saved(t))
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()  # storage_key(t), its bytes
        node = state.nodes.get(key)
        # detached: a saved output holding its own grad_fn would make the graph a cycle
        # that outlives a dropped step (the detached tensor shares the version counter)
        if nbytes < MIN_PLANNED_BYTES:
            return self._made(_Saved(state.kept(t, key, node)))
        decisions = self.decisions
        if node is None:
            if state.is_external(key):  # a parameter, a buffer, the batch: mostly leaves,
                # which hold no node, so no cycle to break (the detach costs 2 to 5 us)
                return kept_as_saved(t)
            if name is None:
                return self._made(_Saved(state.kept(t, key, None)))
        if name is not None and decisions:  # an activation: NOTE [saves named by their order]
            assert self.watch is not None
            planned = self.watch.bytes.get(name)
            if planned is not None and planned != nbytes:
                raise _other_step(nbytes, name, planned, t.dtype,
                                  self.watch.dtypes.get(name))
        if node is None:
            if name in decisions:  # saved unwatched, and the plan moves it
                node = state.unwatched_node(t, key)
                node.name = name
        elif name is not None and node.name is None:
            node.name = name
        else:
            name = node.name
        due = copies.due
        if due and (at := self.produced_at.get(name)) is not None and due[0][0] <= at + 1:
            copies.free_due(at, self.stats)
        decision = decisions.get(name, _KEEP)
        vkey = (key, len(node.steps) if node is not None else 0)
        pending, handles = self.pending, self.handles
        if decision == _KEEP:
            kept = state.kept(t, key, node)
            self.hold(vkey, nbytes, key, name is not None and name not in self.outside)
            packed = _Packed(self, _KEEP, vkey, name, node, t, kept)
            pending[vkey] = pending.get(vkey, 0) + 1  # self._count(vkey), inlined
            handles[vkey] = handles.get(vkey, 0) + 1
            return self._made(packed)
        assert node is not None
        if decision == Decision.RECOMPUTE and not node.replayable():
            if self.watch is not None:  # NOTE [a recompute the step cannot replay]
                raise PathChanged(path_changed(
                    f"its save '{name}', which the plan recomputes, was made by ops the "
                    f"profiled step did not run there ({node.unreplayable()})"))
            raise InputError(
                f"cannot recompute '{name}': {node.unreplayable()} is not known to "
                "replay bit for bit; keep or offload it (plans from slackswap.plan "
                "never recompute it)"
            )
        packed = _Packed(self, decision, vkey, name, node, t, None)
        # counted before anything below can raise: its ``__del__`` uncounts
        pending[vkey] = pending.get(vkey, 0) + 1
        handles[vkey] = handles.get(vkey, 0) + 1
        self.outstanding += 1
        if self.verify and vkey not in self.originals:  # NOTE [verify reads as backward]
            self.originals[vkey] = detached(t)
        if decision == Decision.OFFLOAD and vkey not in self.host:
            issue = recorder is None or recorder.packs_seen > self.issued_at.get(name, -1)
            if recorder is not None:  # the runtime's own ops: ``_quiet()``, no context
                quiet, recorder.quiet = recorder.quiet, True
            try:
                host = self.host[vkey] = copies.offload(
                    t, self.stats, self.free_before.get(name), issue, key, nbytes)
            finally:
                if recorder is not None:
                    recorder.quiet = quiet
            self.offloaded[name] = vkey
            self.stats.offloaded_bytes += host.nbytes
        ref = _REF(packed)
        state.packs.setdefault(key, []).append(ref)
        if self.in_forward:
            self.made.append(ref)
        return packed

    def forward_returned(self) -> None:
        """The model's forward returned: its own forward hooks save after this, past the
        profiled step's count (NOTE [the saves by the model's return] in
        ``profiling/step.py``), unchecked by NOTE [a longer path holds no more than the
        profiled step]."""
        self.limit_now, self.held_now = None, _NO_LIMIT

    def _made(self, handle: _H) -> _H:
        """A handle over an activation: let go of should the step run again (NOTE [a step
        off the profiled path])."""
        if self.in_forward:
            self.made.append(_REF(handle))
        return handle

    def drop_step(self) -> None:
        """NOTE [a step off the profiled path]: the step's forward ran part way and runs
        again; everything the runtime holds for what it saved goes now, before the second
        try. Autograd's nodes of the first try may outlive it (a backward hook's closure
        that holds them makes a cycle through autograd that no collector frees: measured
        with ``MemTracker``'s module tracker, half the first try's kept activations
        stayed through the second), but hold no activation after this."""
        made, self.made = self.made, []
        for ref in made:
            handle = ref()
            if handle is not None:
                handle.drop()
        self.release_checkpoints(None)

    def issue_waiting(self) -> None:
        """Issue the copies of offloads still waiting for their group: forward is over,
        or refused (NOTE [offloads issued in groups])."""
        if self.recorder is None:
            self.copies.issue()
            return
        with self._quiet():
            self.copies.issue()

    def _quiet(self) -> Any:
        """The runtime's own ops in forward (host copies) are not the model's: no names,
        no recipes (a recipe holding a storage would keep it alive)."""
        assert self.recorder is not None
        return self.recorder.quieted()

    def hold_checkpoint(self, key: int, release: int, t: torch.Tensor, name: str) -> None:
        """A tensor autograd does not save, just made, kept for rebuilds until
        ``release``: on the device, or, when the plan offloads it, as a host copy of its
        value now (its node's first step) that a rebuild reloads (``Replayer``)."""
        nbytes = t.untyped_storage().nbytes()
        if self.decisions.get(name) == Decision.OFFLOAD and nbytes >= MIN_PLANNED_BYTES:
            vkey = (key, 1)
            with self._quiet():
                self.host[vkey] = self.copies.offload(t, self.stats)
            self.host_checkpoints[vkey] = release
            self.offloaded[name] = vkey
            self.stats.offloaded_bytes += nbytes
            return
        self.kept_checkpoints[key] = (release, t)
        self.hold((key, None), nbytes, key)

    def _drop_host_checkpoint(self, vkey: Value) -> None:
        host = self.host.pop(vkey, None)
        if host is not None:
            self.copies.give_back(host)
        if self.back.pop(vkey, None) is not None:
            self.release(vkey)

    def handle_gone(self, vkey: Value, kept: bool) -> None:
        """Autograd freed a packed handle (its node ran, or the graph was dropped): once
        none is left for the value, whatever the runtime holds for it goes."""
        self.handles[vkey] -= 1
        if self.handles[vkey] == 0:
            del self.handles[vkey]
            host = self.host.pop(vkey, None)
            if host is not None:
                self.copies.give_back(host)
            self.back.pop(vkey, None)
            self.originals.pop(vkey, None)
            self.release(vkey)
            never = self.pending.pop(vkey, 0)  # never unpacked
            if not kept and never:
                self.outstanding -= never
                if self.outstanding == 0:
                    self.group = {}
            # NOTE [no cyclic GC until backward]: the paused step's graph is gone (another
            # step's, dropped in or after this one's forward, resumes nothing)
            if not self.handles and COLLECTOR.owner is self and not self.in_forward:
                COLLECTOR.release()

    # -- backward ----------------------------------------------------------------------
    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _Saved:
            return packed.unpack()
        if packed.owner is None:
            raise InputError(_DROPPED)
        if self.in_forward:
            raise InputError(NESTED_BACKWARD)
        if not self.checked:
            self._check_seen()
            self.issue_waiting()  # backward began inside the block
        if COLLECTOR.held and not COLLECTOR.waiting:  # NOTE [no cyclic GC until backward]
            COLLECTOR.after_backward()
        if self.state.written and self.recorder is not None:
            self.recorder.mark_modified()
        packed.check_version()
        vkey = packed.vkey
        if self.originals:  # NOTE [verify reads as backward]: autograd's own check
            original = self.originals.get(vkey)
            if original is not None and original._version != packed.version:
                raise _modified(f"'{packed.name}'")
        position = self.first_use.get(packed.name)
        due = self.copies.due
        if due and position is not None and due[0][0] <= position + 1:
            self.copies.free_due(position, self.stats)
        if position is None or position != self.group_position:
            # NOTE [rebuild groups]: what rebuilds make for one backward op (the profile
            # op that first needs this tensor) serves all of that op's rebuilds, then goes,
            # as in the simulator's schedule; without a profile, each unpack is a group.
            self.group, self.group_position = {}, position
            self.release_checkpoints(position)
        self._prefetch_up_to(position, packed.device)
        if packed.decision == Decision.KEEP:
            out = packed.tensor
        else:
            base = self.back.get(vkey)
            if base is None:
                if packed.decision == Decision.OFFLOAD:
                    self.stats.late_reloads += 1  # not prefetched: backward waits for it
                    base = self.reload(vkey, packed.name, packed.device, waited=True)
                else:
                    base = self.replayer.rebuild(packed.node, packed.upto)
                self.bring_back(vkey, base)
            base = self.copies.ready(base, self.stats)
            out = view_of(base, packed.geometry)
            if vkey in self.originals:
                self._verify(packed, out)
        remaining = self.pending.pop(vkey, 0) - 1
        if remaining > 0:
            self.pending[vkey] = remaining
        # the last saved reference to it is back; below zero, a second backward through a
        # retained graph (or a second read of ctx.saved_tensors) brought it back again
        if remaining <= 0:
            base = self.back.pop(vkey, None)
            if base is not None:  # another rebuild for this same op may still read it
                self.group[vkey] = base
            self.release(vkey)
        if remaining >= 0 and packed.decision != Decision.KEEP:
            self.outstanding -= 1
            if self.outstanding == 0:  # backward is through: what rebuilds made goes
                self.group = {}
                self.release_checkpoints(None)
        return out

    def _verify(self, packed: _Packed, out: torch.Tensor) -> None:
        original = view_of(self.originals[packed.vkey], packed.geometry)
        if not _same_bits(original, out):
            how = "reloaded from host memory" if packed.decision == Decision.OFFLOAD else "rebuilt"
            assert packed.node is not None
            last = packed.node.steps[packed.upto - 1].func
            by = f" (last written by {last})" if last is not None else ""
            raise VerifyError(
                f"verify: '{packed.node.name}' {how} differs from the original as backward "
                f"reads it{by}: the step wrote it after saving it where no version counter "
                "sees (through .data or a NumPy view), which the profiled step did not, or "
                "the plan is wrong for this model; keep it, and please report the model"
            )
        self.stats.verified += 1

    def unproduced(self) -> list[str]:
        """What the plan moves that this step has not saved so far."""
        produced = {node.name for node in self.state.nodes.values()}
        if self.watch is not None and self.recorder is not None:
            # saved where nobody watched, small ones included
            produced.update(self.watch.pack_names[:self.recorder.packs_seen])
        return [n for n in self.decisions if n not in produced]

    def saved_later(self, names: list[str]) -> bool:
        """Whether every one of ``names`` is saved later in the profiled step than this
        step has come (by the loss after the model, say)."""
        if self.watch is None or self.recorder is None:
            return False
        later = set(self.watch.pack_names[self.recorder.packs_seen:])
        return all(n in later for n in names)

    def _check_seen(self) -> None:
        self.checked = True
        missing = self.unproduced()
        if missing:
            raise not_produced(missing)

    # -- what is resident, and reloads -------------------------------------------------
    def hold(self, key: Any, nbytes: int, storage: int, sized: bool = False) -> None:
        """Count ``storage`` (its key) resident under ``key`` (a value, or a checkpoint's
        ``(storage, None)``): its bytes once however many keys hold it. One storage may
        be held under two values that are one: saved first where no node stood for it
        (value ``(storage, 0)``), then after a watched op read it and so gave it one
        (``(storage, 1)``), as T5's layer norm saves its input twice. ``sized``: a save
        in a place of the step's own (not one where the profiled step saved a tensor from
        outside it), counted against the simulated peak too (NOTE [a longer path holds no
        more than the profiled step])."""
        if key in self.held:
            return
        holders = self.holders.get(storage, 0)
        if holders == 0:
            if sized and self.in_forward:
                total = self.sized_bytes + nbytes
                if total > self.held_now:
                    raise _held_more(self.held_limit)
                self.sized_bytes = total
                self.sized[storage] = nbytes
            self.stats._hold(nbytes)
        self.held[key] = (nbytes, storage)
        self.holders[storage] = holders + 1

    def release(self, key: Any) -> None:
        entry = self.held.pop(key, None)
        if entry is None:
            return
        nbytes, storage = entry
        holders = self.holders[storage] - 1
        if holders:
            self.holders[storage] = holders
        else:
            del self.holders[storage]
            self.stats.resident_bytes -= nbytes
            if self.sized and self.sized.pop(storage, None) is not None:
                self.sized_bytes -= nbytes

    def bring_back(self, vkey: Value, base: torch.Tensor) -> None:
        self.back[vkey] = base
        storage = base.untyped_storage()
        self.hold(vkey, storage.nbytes(), storage._cdata)

    def reload(self, vkey: Value, name: str | None, device: torch.device,
               waited: bool = False) -> torch.Tensor:
        host = self.host[vkey]
        self.stats.reloaded_bytes += host.nbytes
        self.stats.reload_order.append(name or "")
        if waited and not self.copies.asynchronous(device):  # a copy backward waits for
            self.stats.stalls += 1
            with self.stats.stall_section(device):
                return self.copies.reload(host, device)
        return self.copies.reload(host, device)  # on CUDA, ``ready`` times any wait

    def _prefetch_up_to(self, position: int | None, device: torch.device) -> None:
        """Issue the reloads whose prefetch point is at or before ``position`` (the
        profile op that needs the tensor being unpacked now), in plan order."""
        if position is None:
            return
        while self.next_prefetch < len(self.prefetch):
            name, point = self.prefetch[self.next_prefetch]
            if point > position:
                break
            self.next_prefetch += 1
            vkey = self.offloaded.get(name)
            waiting = vkey is not None and (self.pending.get(vkey, 0) > 0
                                            or vkey in self.host_checkpoints)
            if waiting and vkey in self.host and vkey not in self.back:
                self.bring_back(vkey, self.reload(vkey, name, device))
                self.stats.prefetched += 1

    def release_checkpoints(self, position: int | None) -> None:
        """Let go of the checkpoints no rebuild before ``position`` (None: any) reads."""
        for key, (last, _) in list(self.kept_checkpoints.items()):
            if position is None or last < position:
                del self.kept_checkpoints[key]
                self.release((key, None))
        for vkey, last in list(self.host_checkpoints.items()):
            if position is None or last < position:
                del self.host_checkpoints[vkey]
                self._drop_host_checkpoint(vkey)


# NOTE [verify reads as backward]
#     ``verify=True`` compares each reload and rebuild with what plain PyTorch's backward
#     would read in its place: the saved tensor's own storage as it is when backward
#     unpacks it, held from the save on by a detached alias (no copy; it shares the saved
#     tensor's version counter, as autograd's saved variable does). It was a copy taken as
#     the tensor was saved, which agreed with a reload or rebuild of the saved value even
#     where the step had since written it on a step other than the profiled one (a branch
#     on the data), which the profile could not mark: through ``.data`` or a NumPy array
#     over it (no version counter sees it; plain PyTorch's backward reads it as written),
#     or by an op autograd sees, where plain PyTorch raises but the runtime's own check
#     had nothing to read once the saved tensor's Python object was gone (it holds only a
#     weak reference, so as not to hold the storage the plan frees). ``verify`` now
#     raises autograd's own error for the second and ``VerifyError`` for the first.
#     Without ``verify`` neither is seen on such a step: seeing it would cost a Python
#     call per op, or a tensor (about 8 us) per moved save. Holding the storage costs what
#     the copy did (the device memory the plan would have freed), and no copy's time.
def kept_as_saved(t: torch.Tensor) -> _Saved:
    """``t`` held as autograd holds it (an output detached from the node that saves it,
    which would otherwise make a cycle), its version checked in backward."""
    return _Saved(t if t.grad_fn is None else detached(t))


_UNSEEN = torch._C._DisableTorchDispatch


class _HostCopy:
    """One value of a storage saved in a step off the profiled path, in host memory: the
    buffer, the handles over it, and its last reload while something still holds it."""

    __slots__ = ("table", "copies", "vkey", "host", "storage", "handles", "back", "held")

    def __init__(self, table: dict[tuple[int, int], _HostCopy], copies: HostCopies,
                 vkey: tuple[int, int], host: torch.Tensor,
                 storage: torch.UntypedStorage) -> None:
        # the step's copies by value, not the hooks: a graph kept holds no step state
        self.table, self.copies, self.vkey, self.host = table, copies, vkey, host
        # held while the copy is: the storage's key is not reused meanwhile
        self.storage = StorageWeakRef(storage)
        self.handles = 0
        self.back: Any = None  # a weak reference to the last reload
        # the storage's bytes on the device, held once forward wrote it after the copy
        # where no version counter sees (NOTE [a step off the profiled path])
        self.held: torch.Tensor | None = None

    def gone(self) -> None:
        self.handles -= 1
        if self.handles == 0:
            if self.table.get(self.vkey) is self:
                del self.table[self.vkey]
            host, self.host, self.held = self.host, None, None
            if host is not None:
                self.copies.give_back(host)


class _OnHost:
    """What autograd holds for an activation saved in a step off the profiled path: its
    host copy, the view it was, and the version it was saved at. Autograd's own check
    that it was not changed in place before backward is off under saved-tensor hooks, so
    a tensor with no storage of its own shares the saved tensor's version counter (every
    view and ``detach`` of it shares it too) and is compared at unpack."""

    __slots__ = ("copy", "geometry", "device", "counter", "version", "__weakref__")

    def __init__(self, copy: _HostCopy, t: torch.Tensor) -> None:
        self.geometry, self.device, self.version = geometry(t), t.device, t._version
        counter = detached(t)
        with _UNSEEN():  # its storage let go of: no bytes held
            counter.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.counter = counter
        copy.handles += 1
        self.copy = copy  # (last: a handle whose making raised gives nothing back)

    def __del__(self) -> None:
        copy = getattr(self, "copy", None)
        if copy is not None:
            copy.gone()


class OffPathSaves:
    """The saved-tensor hooks of a step run again off the profiled path (NOTE [a step off
    the profiled path] in ``runtime/block.py``): each activation of the step (not a
    parameter, buffer or batch tensor; of a planned size) is copied to host memory as it
    is saved, with the runtime's host copies, one copy per value of a storage however
    many times it is saved, and reloaded when backward unpacks it (each reload serving
    every unpack while something holds it); the rest is held as autograd holds it. On
    CUDA the copies in flight hold at most ``in_flight`` bytes of device memory."""

    def __init__(self, state: StepState, copies: HostCopies, stats: RuntimeStats,
                 in_flight: int) -> None:
        self.state, self.copies, self.stats, self.in_flight = state, copies, stats, in_flight
        self.by_value: dict[tuple[int, int], _HostCopy] = {}  # (storage, version) -> copy

    def pack(self, t: torch.Tensor) -> Any:
        if type(t) is _PARAMETER or not plain_strided(t) or t.is_meta:
            return kept_as_saved(t)
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes < MIN_PLANNED_BYTES or self.state.is_external(key):
            return kept_as_saved(t)
        vkey = (key, t._version)
        copy = self.by_value.get(vkey)
        if copy is None:
            copies = self.copies
            host = copies.offload(t, self.stats, None, True, key, nbytes)
            copy = self.by_value[vkey] = _HostCopy(self.by_value, copies, vkey, host, storage)
            self.stats.offloaded_bytes += nbytes
            if copies.undated:  # asynchronous copies in flight
                copies.hold_in_flight(self.in_flight, self.stats)
        return _OnHost(copy, t)

    def before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op of the step is about to write tensors in place: a storage whose value a
        host copy holds is held on the device from now on, each handle over it reading it
        as it will be at backward, as plain PyTorch's do (a write no version counter sees,
        through ``.data``: NOTE [a step off the profiled path])."""
        written = op_info(func)[4]
        by_value = self.by_value
        for position, x in (*enumerate(args), *kwargs.items()):
            if (position not in written or not isinstance(x, torch.Tensor)
                    or x.layout != torch.strided or x.is_meta):
                continue
            key = x.untyped_storage()._cdata
            self.copies.before_write(key)  # an offload's copy still reading it goes first
            for vkey, copy in by_value.items():
                if vkey[0] == key and copy.held is None:
                    copy.held = _storage_bytes(x)

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _Saved:
            return packed.unpack()
        if packed.counter._version != packed.version:
            raise _modified(f"a tensor of shape {list(packed.geometry.size)}")
        copy = packed.copy
        base = copy.held if copy.held is not None else (
            copy.back() if copy.back is not None else None)
        if base is None:
            copies = self.copies
            base = copies.ready(copies.reload(copy.host, packed.device), self.stats)
            copy.back = weakref.ref(base)
            self.stats.reloaded_bytes += copy.host.nbytes
        return view_of(base, packed.geometry)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage (``streams.bytes_of``), made where no dispatch
    mode sees it."""
    with _UNSEEN():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class OffPathWrites(TorchDispatchMode):
    """The ops of a step run again off the profiled path, seen only for their writes
    (:meth:`OffPathSaves.before_write`): each op pays one Python call, on a step that
    copies every activation it saves to host memory."""

    def __init__(self, saves: OffPathSaves) -> None:
        super().__init__()
        self.saves = saves

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.saves.by_value and op_info(func)[3]:  # it writes in place
            self.saves.before_write(func, args, kwargs)
        return func(*args, **kwargs)


def _other_step(nbytes: int, name: str, planned: int, dtype: torch.dtype,
                profiled: str | None) -> InputError:
    """NOTE [saves named by their order]: the j-th save of the step is the profile's j-th,
    as big, or the step is another than the profiled one. A floating-point save in
    another floating-point dtype than the profile's says autocast first: a step under
    another torch.autocast than its plan's (or a model cast since) saves every
    activation so. (The autocast state cannot be read here: a saved-tensor hook runs
    with autocast's dispatch key excluded.) Otherwise the model took another code path
    (NOTE [a step off the profiled path])."""
    now = dtype_name(dtype)
    if (dtype.is_floating_point and profiled is not None and profiled != now
            and profiled.startswith(("fp", "bf"))):
        return InputError(
            f"the step saved a {now} tensor where its profile saved '{name}' as "
            f"{profiled}: the step runs under another torch.autocast (or the model "
            "was cast) than the step the plan was made for, or takes another code "
            "path; plan it under the autocast and dtype training runs "
            "(slackswap.attach and slackswap.auto plan each autocast state once)")
    return PathChanged(path_changed(f"it saved {nbytes} bytes where the profiled step "
                                    f"saved '{name}', {planned} bytes"))


# NOTE [a longer path under a plan that keeps everything]
#     A plan that keeps every activation moves nothing that depends on the path, so its
#     saves are neither named nor checked against the profile. But its simulated peak is
#     the profiled step's: a step that runs layers the profiled step skipped (LayerDrop
#     drew a skip while profiling: TimeSeriesTransformer's encoder with both of its two
#     layers dropped saved 25 tensors, 11 KiB, where a step running them saved 45 KiB)
#     holds what the plan never measured, over its budget. So such a step is off the
#     profiled path as soon as the model's forward packs more tensors than the profiled
#     step's did by its return (``StepProfile.model_saves``), before it holds the one
#     past them: it runs again as plain PyTorch saving to host memory, within the budget
#     (NOTE [a step off the profiled path] in ``runtime/block.py``). A path with no more
#     saves runs on, unless what it keeps goes past the plan's simulated peak (NOTE [a
#     longer path holds no more than the profiled step]). Sizes are not compared one by
#     one: a mixture of experts routes
#     other token counts to each expert every step (the same count in all), so a save
#     larger than the profiled one in its place is the rule there, not a longer path
#     (the zoo's Switch model ran every step again, at 44% of the plan's memory and a
#     second forward's time).


def _longer_path(limit: int) -> PathChanged:
    return PathChanged(path_changed(
        f"its forward saved more than the {limit} tensors the profiled step saved"))


# NOTE [a longer path holds no more than the profiled step]
#     Under a plan that moves activations too, a step that runs layers the profiled step
#     skipped passed the checks of NOTE [saves named by their order] for a while: layers
#     of one shape save tensors of the same sizes, so an extra layer's saves took the
#     next layers' names (and decisions), and the saves past the profile's last were
#     named by nothing, so checked against nothing and kept as autograd saved them, until
#     the model returned having saved more than the profiled step (``_other_saves`` in
#     ``runtime/block.py``): by then they were held (8 layers of 64 KiB saves, profiled
#     with 4 skipped: 7% to 25% over the plan's budget, as ``MemTracker`` measures it).
#     A save whose name the profile gives no planned size (a parameter's, the batch's, a
#     small one's) is checked against nothing either, and a plan that keeps everything
#     checks no size at all: TimeSeriesTransformer, profiled with both encoder layers
#     dropped, saved the encoder's 2 to 4 KiB tensors in the places of the decoder's and
#     the loss's smaller ones, and held 45,056 B where the plan simulated 11,232 B before
#     its save count passed the profiled step's 33. So in the model's forward, under any
#     plan with a profile to guide it:
#     - a step is off the profiled path as it saves one tensor more than the profiled
#       step had by the model's return (``pack_limit``, one comparison a pack, as under a
#       plan that keeps everything: NOTE [a longer path under a plan that keeps
#       everything]);
#     - and as the kept saves in the step's own places (all but those where the profiled
#       step saved a tensor from outside the step, ``external:N`` and ``input:KEY``; each
#       storage once) would hold more than the simulated step's peak under the plan
#       (``held_limit`` in ``runtime/checks.py``, once per plan, about 0.1 s on
#       gpt2-xl@12; it counts the step's temporaries too, so the profiled path stays
#       within it, as ``benchmarks/scout_families.py`` checks of every family), checked
#       in ``hold`` before the storage is counted, one comparison a kept storage. A path
#       that holds no more than that runs on, whatever its saves' sizes. Only those saves: the
#       runtime also keeps what the simulator does not count as the step's activations,
#       and all it keeps (``stats.resident_bytes``) passed the peak on the profiled path:
#       a second call of the model in one autocast region, profiled with the first
#       call's weight casts cached, saves those casts (``external:N`` in its profile, 32
#       KiB each in the test's MLP) as the runtime's own kept tensors, and the step went
#       off the path every time (test_attach's autocast test).
#     Both hold until the model's forward returns (``forward_returned``): its own forward
#     hooks save after that, as the profiled step counts (NOTE [the saves by the model's
#     return] in ``profiling/step.py``; a hook of the user's that changes the model's
#     output sent every step off the path). Both go off the path before the save that
#     would pass them is held: the step runs
#     again as plain PyTorch saving to host memory, within the budget (NOTE [a step off
#     the profiled path] in ``runtime/block.py``). Neither compares a save with the
#     profiled one in its place: a mixture of experts routes other token counts to each
#     expert every step, so that is not a longer path (NOTE [a longer path under a plan
#     that keeps everything]); its saves are as many, and what it keeps in all stays under
#     a peak that counts the step's temporaries too. Where the profile's hardware cannot
#     be loaded here there is no simulated peak, and only the count is checked. Pack is
#     the hottest path of forward: ``benchmarks/host_work.py --cheap-ops`` times forward
#     as before (within noise, 37 to 43 ms on meta tensors either way).


def _held_more(limit: int) -> PathChanged:
    return PathChanged(path_changed(
        f"its forward held more than the {limit} bytes of saved activations the plan "
        "simulated for the profiled step"))


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included), conjugate and negative bits included."""
    if (a.is_conj(), a.is_neg(), a.shape, a.dtype) != (b.is_conj(), b.is_neg(), b.shape,
                                                         b.dtype):
        return False
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    ints = _SAME_SIZE_INTS[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def not_produced(missing: list[str]) -> InputError:
    """The refusal of a step that did not make what its plan moves."""
    return InputError(
        f"plan names '{missing[0]}' (and {len(missing) - 1} more) that this step did "
        "not produce: it was made for another model, batch shape or kernels, or "
        "the model took a different code path than in the profiled step (a random "
        "skip such as LayerDrop: set its rate to 0)"
    )
