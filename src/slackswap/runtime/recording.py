"""Forward under a plan: the ops the runtime watches, named and recorded as recipes.

NOTE [one owner of the hooks]
    Only the innermost ``saved_tensors_hooks`` pair runs, so keep, offload and recompute
    share one pair (:mod:`slackswap.runtime.saved`). A ``TorchDispatchMode`` watches the
    forward ops a rebuild needs (NOTE [watch only what the plan rebuilds]; without a
    profile that can guide it, every op): it names each new storage (from the profile,
    or by the shared rule of :mod:`slackswap.profiling.naming`) and records how it was
    made: the op, its arguments (activations by reference, never by value), and the RNG
    state before a random op. A rebuild replays the recipe (:mod:`slackswap.runtime.replay`).

NOTE [inputs read by rebuilds]
    A rebuild reads the batch (or another host tensor from outside the model) as it is
    then, which must be as forward read it. A write the version counter cannot see, a
    data loader refilling a NumPy buffer the batch shares with it after forward, would
    make the rebuild read other values than forward did, and the gradient differ from
    plain PyTorch's. So a host tensor from outside the step that a recorded op reads
    gets a digest of its values as it is read (once per value forward gives it), and
    the first rebuild to read it checks it, refusing, with what to do, when it changed
    (``Replayer._outside``). A copy would make the rebuild exact, at the cost of host
    memory the plan does not count. Parameters, buffers and device tensors are not
    digested: no NumPy array shares a device storage, and the model's state is checked
    by its version.

NOTE [small unseen tensors]
    A watched op can read a storage no watched op made and that is not the model's or
    the batch's: made by an unwatched segment, or by no op at all (``torch.tensor(3)`` in
    a forward, as DeBERTa's relative positions make their constants). A small one (under
    ``MIN_PLANNED_BYTES``, the size no plan moves) is held by the recipe as a tensor from
    outside the step: a replay reads it as forward did, or, changed in place since,
    stops (``Replayer._outside``), and is resident until the step's recipes go, as the
    simulator holds it (NOTE [small unseen tensors held by recipes] in
    ``sim/schedule.py``). A larger one is read back only while autograd or a plan still
    holds it, and a rebuild needing it after that stops.
NOTE [after the step's forward]
    The block may go on after the step's forward (the model and the loss the profile
    traced): ``loss.backward()`` inside it first makes the gradient seed (``ones_like``)
    outside autograd's graph task, and a training loop may log or step its optimizer
    there. Once the watched step has run every forward op of its profile, an op is not
    the step's: it is neither checked against the profile (which has no op there: such
    a block was refused) nor recorded, but its in-place writes still count, so that a
    rebuild never reads a value changed after it was made.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
from torch.utils._python_dispatch import TorchDispatchMode

from slackswap.core.plan import MIN_PLANNED_BYTES
from slackswap.errors import InputError, PathChanged, path_changed
from slackswap.profiling.naming import (
    ActivationNamer,
    ForwardModules,
    module_events,
    value_digest,
)
from slackswap.runtime.recipes import (
    GeneratorState,
    Node,
    Outside,
    Ref,
    Scratch,
    Step,
    geometry,
    map_args,
    op_device,
    op_info,
    op_tensors,
    rng_state,
    storage_key,
)
from slackswap.runtime.state import StepState, unseen_step
from slackswap.runtime.values import Recorded
from slackswap.runtime.watch import Watch

__all__ = ["Recorder"]


class _Tracer(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    # NOTE [dynamo off in dispatch]: torch wraps a mode's ``__torch_dispatch__`` in
    # ``torch._dynamo.disable`` so that a compiled function running under the mode never
    # compiles the mode's own Python. That wrapper costs about 5 us per op, a tenth of
    # what watching an op costs; the two calls below do the same (no frame evaluation
    # callback while the runtime's code runs, the caller's put back after).
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = _set_eval_frame(None)
        try:
            return self.recorder.dispatch(func, args, kwargs or {})
        finally:
            _set_eval_frame(prior)

    def on(self) -> None:
        self.__enter__()

    def off(self) -> None:
        top = torch._C._len_torch_dispatch_stack() - 1
        if top < 0 or torch._C._get_dispatch_stack_at(top) is not self:
            raise InputError(
                "a dispatch mode entered inside the model's forward was still active when "
                "its module returned; slackswap.apply cannot run with it (keep the plan "
                "to whole modules, or leave the mode in the module that entered it)"
            )
        self.__exit__(None, None, None)


class Recorder:
    """Watches one forward pass for a plan: which ops, their names and recipes, and the
    in-place writes that matter to what the plan saved."""

    def __init__(self, state: StepState, watch: Watch | None, checkpoints: dict[str, int],
                 values: Recorded, wrappers: frozenset[int] = frozenset()) -> None:
        self.state, self.watch, self.values = state, watch, values
        self.wrappers = wrappers  # ids of the modules wrapping the model (DDP's)
        self.checkpoints = checkpoints  # unsaved tensors kept -> release position
        self.quiet = False  # the runtime's own ops (host copies, replays) are not the model's
        self.tracer = _Tracer(self)
        self.tracing = False
        self.segment = 0
        self.op_index = 0
        self.packs_seen = 0
        self.namer = ActivationNamer()
        self.path: Any = None  # full watch: the innermost module running
        # NOTE [hooks only where watching changes]: the module events of this step, while
        # learning them; the events learned, and each hooked module's calls seen so far
        self.learning: list[tuple[torch.nn.Module, bool]] | None = None
        self.events: _Events | None = None
        self.seen: dict[tuple[int, bool], int] = {}

    def enter(self, model: torch.nn.Module, stack: contextlib.ExitStack) -> None:
        """Start watching, with every change undone by ``stack``."""
        if self.watch is None:  # every op, named by the shared rule
            tracker = ForwardModules(model)
            self.path = tracker.innermost
            stack.enter_context(tracker)
            stack.enter_context(self.tracer)
        elif any(self.watch.segments):  # nothing to count when nothing is watched
            events = _EVENTS.get((id(self.watch), id(model)))
            handles = (events.hook(self._sparse_event)
                       if events is not None and events.of(self.watch, model) else None)
            if handles is None:  # every module event, learning which module makes which
                self.learning = []
                stack.enter_context(module_events(self.module_event))
                stack.callback(self._remember_events, model)
            else:  # NOTE [hooks only where watching changes]
                self.events = events
                for handle in handles:
                    stack.callback(handle.remove)
            if self.watch.segments[0]:
                self.tracer.on()
                self.tracing = True
            stack.callback(self.stop)

    @contextlib.contextmanager
    def quieted(self):
        before, self.quiet = self.quiet, True
        try:
            yield
        finally:
            self.quiet = before

    # -- watching only what the plan needs (NOTE [watch only what the plan rebuilds]) ---
    def module_event(self, *args: Any) -> None:
        """A module's forward starts or ends: the next segment of ops begins."""
        if self.quiet or (self.wrappers and id(args[0]) in self.wrappers):
            return
        if self.learning is not None:
            self.learning.append((args[0], len(args) == 2))
        self._begin_segment(self.segment + 1)

    def _begin_segment(self, segment: int) -> None:
        if self.state.written:
            self.mark_modified()
        self.segment = segment
        watch = self.watch
        assert watch is not None
        on = segment < len(watch.segments) and watch.segments[segment]
        if segment < len(watch.starts):
            self.op_index = watch.starts[segment]
        if on != self.tracing:
            self.tracer.on() if on else self.tracer.off()
            self.tracing = on

    def _sparse_event(self, module: torch.nn.Module, pre: bool) -> None:
        """A hooked module's forward starts (``pre``) or ends: NOTE [hooks only where
        watching changes]."""
        if self.quiet:
            return
        events = self.events
        key = (id(module), pre)
        seen = self.seen.get(key, 0)
        self.seen[key] = seen + 1
        segments = events.segments.get(key)
        segment = segments[seen] if segments is not None and seen < len(segments) else None
        if segment is None:
            raise PathChanged(path_changed(
                f"it called {type(module).__name__} more often than the profiled step did"))
        if segment > 0:  # 0: an event where watching does not change
            self._begin_segment(segment)

    def _remember_events(self, model: torch.nn.Module) -> None:
        """The step saw every module event its profile has: which module made each is
        kept for the next steps of this plan on this model."""
        learning, watch = self.learning, self.watch
        self.learning = None
        if learning is not None and watch is not None and len(learning) == len(watch.starts) - 1:
            _remember(watch, model, learning)

    def stop(self) -> None:
        if self.tracing:
            self.tracing = False
            self.tracer.off()

    def next_op(self, kind: str) -> int:
        """The profile's index of the op the watched segment runs now, checked."""
        index, watch = self.op_index, self.watch
        self.op_index += 1
        assert watch is not None
        expected = watch.op_kinds.get(index)
        if expected != kind:
            got = f"ran {expected}" if expected else "had no op"
            raise PathChanged(path_changed(f"its op {index} is {kind} where the profiled "
                                           f"step's {got}"))
        return index

    def next_pack(self) -> str | None:
        """The id of what this save saves: the j-th save of the step saves what the
        profile's j-th save did (None without a profile to say, or unnamed there)."""
        if self.watch is None or self.quiet:
            return None
        j = self.packs_seen
        self.packs_seen = j + 1
        names = self.watch.pack_names
        return names[j] if j < len(names) else None

    # -- one watched op ----------------------------------------------------------------
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.state.written:
            self.mark_modified()
        recorded, kind, random, mutable, written = op_info(func)
        if not recorded or self.quiet or torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)
        if self.watch is not None and self.op_index >= self.watch.ends[-1]:
            # NOTE [after the step's forward]: not an op of the step; its writes count
            if mutable:
                self.before_write(func, written, args, kwargs, recorded=False)
            return func(*args, **kwargs)
        index = self.next_op(kind) if self.watch is not None else None
        rng = generator = None
        if random:
            rng = rng_state(op_device(args))
            generator = kwargs.get("generator")
            if isinstance(generator, torch.Generator):
                generator = GeneratorState(generator.device, generator.get_state())
        if mutable:
            self.before_write(func, written, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(generator, GeneratorState):
            kwargs = {**kwargs, "generator": generator}
        self.record(func, kind, mutable, written, args, kwargs, out, rng, index)
        return out

    def before_write(self, func: Any, written: frozenset, args: tuple, kwargs: dict,
                     recorded: bool = True) -> None:
        """An op is about to change tensors in place. An outside tensor a recipe has read
        is snapshotted first, so a rebuild reads what forward read; an activation written
        without being an output of the op, or by an op not ``recorded``, gets a step no
        replay can repeat. The saved
        tensors over what it writes are looked at once it has (autograd bumps their
        version after the kernel; see :meth:`mark_modified`)."""
        state, copies = self.state, self.values.copies
        for position, x in (*enumerate(args), *kwargs.items()):
            if (position not in written or not isinstance(x, torch.Tensor)
                    or x.layout != torch.strided):
                continue
            key = storage_key(x)
            state.written.extend(state.packs.get(key, ()))
            copies.before_write(key)  # an offload of its earlier value may still read it
            node = state.nodes.get(key)
            if node is None:  # an outside storage: counted, and kept as it was if read
                writes = state.outside_writes.get(key, 0)
                if key in state.outside_read and (key, writes) not in state.snapshots:
                    state.snapshots[key, writes] = copy_storage(x)
                state.outside_writes[key] = writes + 1
            elif not recorded or not _returns_alias(func, position):
                node.wrote(unseen_step(), x)

    def mark_modified(self) -> None:
        """Saved tensors the last op changed are marked, so backward fails as autograd
        does when it reads one (its hooks switch that check off)."""
        written = self.state.written
        for ref in written:
            packed = ref()
            saved = packed.saved() if packed is not None else None
            if saved is not None and saved._version != packed.version:
                packed.modified = True
        written.clear()

    def record(self, func: Any, kind: str, mutable: bool, written: frozenset, args: tuple,
               kwargs: dict, out: Any, rng: Any, index: int | None) -> None:
        # the hottest path of a watched forward: attribute lookups hoisted, storages read
        # once per tensor
        state = self.state
        nodes, is_external = state.nodes, state.is_external
        outside_read, outside_writes = state.outside_read, state.outside_writes
        state_keys, units = state.state_keys, state.units
        sparse = index is not None
        strided, tensor_type = torch.strided, torch.Tensor

        def ref(x: Any) -> Any:
            if not isinstance(x, tensor_type):
                return x  # constants stay as they are
            if x.layout != strided:  # read again only as it is now
                return Outside(x, x._version)
            storage = x.untyped_storage()
            key = storage._cdata  # storage_key(x)
            node = nodes.get(key)
            if (node is None and sparse and not is_external(key)
                    and storage.nbytes() >= MIN_PLANNED_BYTES):
                # made in a segment nobody watched: read back as it is now, from a
                # saved handle, or not at all (then a rebuild needing it stops); a
                # smaller one is held as from outside (NOTE [small unseen tensors])
                node = state.unwatched_node(x, key)
            if node is not None:
                return Ref(node, len(node.steps), geometry(x))
            if not is_external(key):
                state.mark_external(x)
            outside_read.add(key)
            writes = outside_writes.get(key, 0)
            version = x._version
            if key not in state_keys and key not in units and x.device.type == "cpu":
                # NOTE [inputs read by rebuilds]: once per value and view (a write by an
                # op nobody watched bumps the version, not ``writes``)
                value = (key, writes, version, x.size(), x.stride(), x.storage_offset(), x.dtype)
                if value not in state.frozen:
                    state.frozen[value] = value_digest(x)
            return Outside(x, version, writes, state)

        if written:  # a replay must not repeat its writes to buffers (BatchNorm's stats)
            def mark(position: Any, x: Any) -> Any:
                if position not in written or not isinstance(x, torch.Tensor):
                    return map_args(ref, x)
                if x.layout == strided and (
                        (key := storage_key(x)) in nodes or not is_external(key)):
                    # an activation (one made where nobody watched gets its node here):
                    # a Scratch would hold it, and its memory, as long as the recipe
                    return ref(x)
                return Scratch(x)
            step_args = tuple(mark(i, a) for i, a in enumerate(args))
            step_kwargs = {k: mark(k, v) for k, v in kwargs.items()}
        else:
            step_args = map_args(ref, args)
            step_kwargs = {k: map_args(ref, v) for k, v in kwargs.items()} if kwargs else kwargs
        grad = torch.is_grad_enabled()
        tensors = op_tensors(out)
        outputs: list[Node | None] = [None] * len(tensors)
        names = self.watch.op_names[index] if sparse else None
        for i, t in enumerate(tensors):
            key = t.untyped_storage()._cdata  # storage_key(t)
            if is_external(key):
                continue
            node = nodes.get(key)
            if node is None and sparse and mutable:
                # written in place here, made where nobody watched: no replay makes it
                node = state.unwatched_node(t, key)
            if node is None:
                name = (names[i] if i < len(names) else None) if names is not None else (
                    self.namer(self.path(), kind))
                node = nodes[key] = Node(
                    name, Step(func, step_args, step_kwargs, i, rng, outputs, grad), t)
                outputs[i] = node
                release = self.checkpoints.get(name)
                if release is not None:  # autograd does not save it: the runtime keeps it
                    self.values.hold_checkpoint(key, release, t, name)
            elif mutable:
                node.wrote(Step(func, step_args, step_kwargs, i, rng, outputs, grad), t)


# NOTE [hooks only where watching changes]
#     The runtime splits forward into the profile's segments by counting module events,
#     and a global module hook takes every module call of the model off PyTorch's fast
#     path: measured on gpt2-xl@12 (meta tensors, 302 events a step), 1.8 ms a step for
#     no-op hooks, 2.7 ms with the counting, a fifth of the runtime's host time in
#     forward. Only the events where watching turns on or off do anything. So the first
#     step of a plan on a model counts every event and learns which module made each
#     (the module, whether its call starts or ends, which of its calls); later steps hook
#     just the modules that make an event where watching changes, first among their own
#     hooks as the global ones run first, and jump to that event's segment. Inside a
#     watched segment every op is still checked against the profile's; a hooked module
#     called more often than in the learned step is refused; the saves are still named
#     and sized by their order (NOTE [saves named by their order]).
class _Events:
    """The module events of one plan's step on one model, learned (see the note)."""

    __slots__ = ("model", "watch", "modules", "segments")

    def __init__(self, model: torch.nn.Module, watch: Watch,
                 learned: list[tuple[torch.nn.Module, bool]]) -> None:
        self.model, self.watch = weakref.ref(model), weakref.ref(watch)
        on = watch.segments
        changes = {event for event in range(1, len(on)) if on[event] != on[event - 1]}
        calls: dict[tuple[int, bool], list[int]] = {}
        modules: dict[int, Any] = {}
        for event, (module, pre) in enumerate(learned, start=1):
            calls.setdefault((id(module), pre), []).append(event if event in changes else 0)
            modules[id(module)] = module
        # (module, starts) -> the segment each of its calls begins (0: nothing changes)
        self.segments = {key: events for key, events in calls.items() if any(events)}
        self.modules = [weakref.ref(modules[i]) for i in {i for i, _ in self.segments}]

    def of(self, watch: Watch, model: torch.nn.Module) -> bool:
        """Learned for this watch on this model (not others that took their ids)."""
        return self.watch() is watch and self.model() is model

    def hook(self, event: Any) -> list[Any] | None:
        """Hooks calling ``event`` on the modules whose events change what is watched,
        their handles; None when one of those modules is gone."""
        modules = [ref() for ref in self.modules]
        if any(m is None for m in modules):
            return None
        handles = []
        for m in modules:
            if (id(m), True) in self.segments:
                handles.append(m.register_forward_pre_hook(
                    lambda module, args: event(module, True), prepend=True))
            if (id(m), False) in self.segments:
                handles.append(m.register_forward_hook(
                    lambda module, args, out: event(module, False), prepend=True,
                    always_call=True))
        return handles


_EVENTS: dict[tuple[int, int], _Events] = {}


def _remember(watch: Watch, model: torch.nn.Module,
              learned: list[tuple[torch.nn.Module, bool]]) -> None:
    if len(_EVENTS) >= 64:  # the oldest goes (a dict keeps its order)
        del _EVENTS[next(iter(_EVENTS))]
    _EVENTS[id(watch), id(model)] = _Events(model, watch, learned)


_RETURNS_ALIAS: dict[tuple[Any, Any], bool] = {}


def _returns_alias(func: Any, position: Any) -> bool:
    """The op returns (an alias of) the argument it writes at ``position``, as in-place
    and ``out=`` ops do: the write is then recorded as a step of the returned storage."""
    known = _RETURNS_ALIAS.get((func, position))
    if known is None:
        known = _RETURNS_ALIAS[func, position] = _schema_returns_alias(func, position)
    return known


def _schema_returns_alias(func: Any, position: Any) -> bool:
    arguments = func._schema.arguments
    if isinstance(position, int):
        argument = arguments[position] if position < len(arguments) else None
    else:
        argument = next((a for a in arguments if a.name == position), None)
    if argument is None or argument.alias_info is None:
        return False
    sets = argument.alias_info.after_set
    return any(r.alias_info is not None and r.alias_info.after_set & sets
               for r in func._schema.returns)


def copy_storage(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage, in a buffer of their own on its device."""
    storage = t.untyped_storage()
    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=t.device)
    copy.untyped_storage().copy_(storage)
    return copy
