"""``slackswap.apply``: keep, offload or recompute each saved activation of a real step.

NOTE [one owner of the hooks]
    Only the innermost ``saved_tensors_hooks`` pair runs, so keep, offload and recompute
    share one pair. A ``TorchDispatchMode`` watches the forward pass: it names every new
    storage exactly as the profiler does (``<module>:<op>:<k>``, see
    :mod:`slackswap.profiling.naming`) and records how each was made: the op, its
    arguments (activations by reference, never by value), and the RNG state before a
    random op. The pack hook then keeps a tensor, copies its storage to host memory
    (offload), or drops it and keeps only the recipe (recompute). The unpack hook brings
    an offloaded storage back, or replays the recipe: inputs first (recursively, when they
    were dropped too), random ops under the RNG state they first ran with, in-place ops on
    the storage in their original order, so the rebuilt values are bit-identical.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from slackswap.core.plan import MIN_PLANNED_BYTES, Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import NESTED_BACKWARD, InputError, VerifyError
from slackswap.profiling.naming import (
    ActivationNamer,
    ForwardModules,
    is_attention,
    is_random,
    is_recorded,
    is_replayable,
    module_events,
    op_kind,
)
from slackswap.profiling.step import (
    batch_fingerprint,
    batch_tensors,
    eager_module,
    model_fingerprint,
    model_state,
    refuse_own_checkpointing,
    refusing_own_checkpoint_calls,
)
from slackswap.runtime.checks import prepare
from slackswap.runtime.copies import HostCopies
from slackswap.runtime.recipes import (
    GeneratorState,
    Node,
    Outside,
    Ref,
    Scratch,
    Step,
    geometry,
    map_args,
    no_autocast,
    op_device,
    op_tensors,
    plain_strided,
    rng_state,
    set_rng_state,
    storage_key,
    view_of,
    written_arguments,
)
from slackswap.runtime.stats import RuntimeStats
from slackswap.runtime.watch import Watch, can_watch, watch_for

__all__ = ["apply", "RuntimeStats"]


class _Tracer(TorchDispatchMode):
    def __init__(self, owner: apply) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if owner._written:
            owner._mark_modified()
        if (not is_recorded(func) or owner._replaying
                or torch._C._current_graph_task_id() != -1):
            return func(*args, **kwargs)
        kind = op_kind(func)
        index = owner._next_op(kind) if owner._watch is not None else None
        rng = None
        # attention kernels draw from the RNG when they have dropout
        if is_random(func) or is_attention(kind):
            rng = rng_state(op_device(args))
            generator = kwargs.get("generator")
            if isinstance(generator, torch.Generator):
                recorded = GeneratorState(generator.device, generator.get_state())
        if func._schema.is_mutable:
            owner._before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if rng is not None and isinstance(kwargs.get("generator"), torch.Generator):
            kwargs = {**kwargs, "generator": recorded}
        owner._record(func, kind, args, kwargs, out, rng, index)
        return out

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


class _Saved:
    """A saved tensor the runtime leaves as autograd saved it (a parameter, the batch, a
    small or unnamed activation): held with its version, since autograd's own check that
    it has not changed in place before backward is off under saved-tensor hooks."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: a tensor of shape {list(self.tensor.shape)} changed "
                "after it was saved for backward (as autograd checks without slackswap)"
            )
        return self.tensor


class _Packed:
    """What autograd holds for a saved tensor: the tensor itself (kept), or how to get it
    back. When autograd lets go of it, the runtime lets go of what it held for it."""

    __slots__ = ("owner", "decision", "vkey", "name", "node", "geometry", "device",
                 "tensor", "saved", "version", "modified", "__weakref__")

    def __init__(self, owner: apply, decision: str, vkey: tuple[int, int], name: str | None,
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
        self.owner._handle_gone(self.vkey, self.tensor is not None)

    def check_version(self) -> None:
        saved = self.saved() if self.tensor is None else self.tensor
        if self.modified or (saved is not None and saved._version != self.version):
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: '{self.name}' changed after it was saved for "
                "backward (as autograd checks without slackswap)"
            )

    @property
    def upto(self) -> int:
        return self.vkey[1]


_ACTIVE: list[apply] = []  # the block open now, if any: blocks do not nest


class apply:  # noqa: N801 - used as a context manager, like torch's save_on_cpu
    """Run the forward pass inside ``with slackswap.apply(model, plan):``; backward may
    run inside or after the block. Gradients are bit-identical to training without it.

    ``profile``, when given, is the profile the plan was made for: the plan is checked
    against it before anything runs, and reloads start at the plan's prefetch points.
    A plan from ``slackswap.plan(model, batch)`` carries its profile, so it need not be
    given; without one, each reload starts when backward needs the tensor.
    ``batch``, when given, is checked against the plan's fingerprint up front; otherwise
    the model and the batch it is called with are checked before it runs. Plans name
    activations by the ids a profile of the same model, batch shape and kernels gives.

    ``verify=True`` proves the plan on this model: the runtime keeps a copy of every
    activation it offloads or drops, and compares every reload and rebuild with it byte
    for byte, raising :class:`~slackswap.VerifyError` on the first difference (it holds
    that copy until backward, so use it for a step, not for training).

    On CUDA the forward pass is assumed to run on one stream per device, and backward on
    the autograd engine's one thread per device (the usual single-GPU step).
    """

    def __init__(self, model: torch.nn.Module, plan: Plan,
                 profile: StepProfile | None = None, batch: Any = None,
                 verify: bool = False) -> None:
        model = eager_module(model)  # inside torch.compile's or DDP's wrapper
        # Prefetch points are profile op indices; the profile says which op needs what.
        self._first_use: dict[str, int] = {}
        self._checkpoints: dict[str, int] = {}  # unsaved tensors kept -> release position
        # without a profile, reloads are issued when backward needs them
        self._prefetch = sorted(plan.prefetch.items(), key=lambda kv: (kv[1], kv[0]))
        profile = profile if profile is not None else plan._profile
        self._fingerprint, self._profile = plan.fingerprint, profile
        if batch is not None:
            self._check_model(model)
            named = dict(batch_tensors(batch))
            self._check_batch(list(named.values()), named)
        if profile is not None:
            ready = prepare(profile, plan)
            self._first_use, self._checkpoints = ready.first_use, ready.checkpoints
            self._prefetch = ready.prefetch  # on a tie, in the simulator's order
        self.model = model
        self.verify = verify
        # NOTE [watch only what the plan rebuilds]; without a profile that can guide it,
        # every forward op is watched and named by the shared rule
        params = next(iter(model.parameters()), None)
        device = params.device.type if params is not None else "cpu"
        self._watch: Watch | None = (
            watch_for(profile, plan) if profile is not None and can_watch(profile, device)
            else None)
        self._tracer: _Tracer | None = None
        self._tracing = False
        self._segment = 0
        self._op_index = 0
        self._packs_seen = 0
        self._kept_refs: dict[int, Any] = {}  # storage -> a kept tensor over it, unwatched
        self.decisions = {n: d for n, d in plan.decisions.items() if d != "keep"}
        self.stats = RuntimeStats()
        self._active = False
        self._in_forward = False  # the model's forward is running (set by its hooks)
        self._exit: contextlib.ExitStack | None = None
        self._replaying = False
        # Saved values are keyed by storage and version (NOTE [values, not storages]).
        self._group: dict[tuple[int, int], torch.Tensor] = {}  # made by rebuilds, this op
        self._group_position: int | None = None
        self._outstanding = 0  # packed handles not yet unpacked, all storages together
        # checkpoints held for rebuilds: storage -> (release position, tensor)
        self._kept_checkpoints: dict[int, tuple[int, torch.Tensor]] = {}
        self._nodes: dict[int, Node] = {}
        # storages from outside the step (parameters, buffers, the batch): never named
        self._external: dict[int, StorageWeakRef] = {}
        self._state: dict[str, torch.Tensor] = {}  # the model's parameters and buffers
        self._state_keys: set[int] = set()
        self._outside_read: set[int] = set()  # outside storages that recipes read
        self._packs: dict[int, list[Any]] = {}  # storage -> its packed handles, this step
        self._written: list[Any] = []  # packed handles over storages just written
        self._outside_writes: dict[int, int] = {}  # outside storage -> writes in forward
        # outside storages as they were before forward changed them: (storage, writes)
        self._snapshots: dict[tuple[int, int], torch.Tensor] = {}
        # host copies, by value; each lives as long as a packed handle for it does, so a
        # second backward through a retained graph can reload it again
        self._host: dict[tuple[int, int], torch.Tensor] = {}
        self._originals: dict[tuple[int, int], torch.Tensor] = {}  # verify=True only
        self._handles: dict[tuple[int, int], int] = {}  # packed handles autograd holds
        self._back: dict[tuple[int, int], torch.Tensor] = {}  # rebuilt or reloaded, this step
        self._pending: dict[tuple[int, int], int] = {}  # packed handles not yet unpacked
        self._held: dict[Any, int] = {}  # saved values resident on the device -> bytes
        self._checked = False
        self._offloaded: dict[str, tuple[int, int]] = {}  # activation id -> value, this step
        self._next_prefetch = 0
        self._copies = HostCopies()

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> apply:
        if _ACTIVE:
            raise InputError(
                "slackswap.apply blocks do not nest: a block already runs "
                f"{'this' if _ACTIVE[-1] is self else 'another'} plan; close it first "
                "(one block per forward pass)"
            )
        self._active = torch.is_grad_enabled()  # under no_grad nothing is saved
        if not self._active:
            return self
        self._check_model(self.model)
        self._reset()
        # Every global change is undone by this stack, on every exit path.
        with contextlib.ExitStack() as stack:
            _ACTIVE.append(self)
            stack.callback(_ACTIVE.remove, self)
            stack.callback(self.model.register_forward_pre_hook(
                self._check_call, with_kwargs=True).remove)
            stack.callback(self.model.register_forward_hook(
                self._forward_done, always_call=True).remove)
            stack.enter_context(refusing_own_checkpoint_calls())
            self._tracer = _Tracer(self)
            if self._watch is None:
                self._tracker = ForwardModules(self.model)
                self._path = self._tracker.innermost
                self._namer = ActivationNamer()
                stack.enter_context(self._tracker)
                stack.enter_context(self._tracer)
            elif any(self._watch.segments):  # nothing to count when nothing is watched
                stack.enter_context(module_events(self._module_event))
                if self._watch.segments[0]:
                    self._tracer.on()
                    self._tracing = True
                stack.callback(self._stop_tracing)
            stack.enter_context(
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            # NOTE [no cyclic GC in forward]: the runtime keeps a small record per forward
            # op until backward, and those allocations set off Python's cyclic collector
            # over the whole heap again and again: two thirds of the runtime's cost per
            # op, on a heap as large as a training process has. Reference counting still
            # frees everything; only the cycle collector waits until the block ends.
            if gc.isenabled():
                gc.disable()
                stack.callback(gc.enable)
            self._exit = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._exit is not None:
            stack, self._exit = self._exit, None
            stack.__exit__(*exc)

    # -- what the plan was made for ----------------------------------------------------
    def _check_model(self, model: torch.nn.Module) -> None:
        self._modules = list(model.named_modules())  # one walk serves every check
        self._state = model_state(model, self._modules)
        refuse_own_checkpointing(model, self._modules)
        if model_fingerprint(model, self._modules, self._state) != self._fingerprint[:32]:
            raise InputError(
                "plan was made for a different model (its modules, parameter shapes, "
                "which parameters train, or train/eval mode differ); re-plan for this model"
            )

    def _check_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the model runs: it runs once in the block, on the plan's batch."""
        if self._calls:
            raise InputError(
                "the model ran twice in one `with slackswap.apply(...)` block, but a plan "
                "covers one forward pass: open one block per forward (per micro-batch)"
            )
        self._calls += 1
        self._in_forward = True
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        self._check_batch(tensors, dict(kwargs) or dict(enumerate(args)))
        for t in tensors:  # the batch is from outside the step
            if t.layout == torch.strided:
                self._mark_external(t)

    # -- watching only what the plan needs (NOTE [watch only what the plan rebuilds]) ---
    def _module_event(self, *args: Any) -> None:
        """A module's forward starts or ends: the next segment of ops begins."""
        if self._replaying or self._watch is None:
            return
        if self._written:
            self._mark_modified()
        self._segment += 1
        watch, segment = self._watch, self._segment
        on = segment < len(watch.segments) and watch.segments[segment]
        if segment < len(watch.starts):
            self._op_index = watch.starts[segment]
        if on != self._tracing:
            assert self._tracer is not None
            self._tracer.on() if on else self._tracer.off()
            self._tracing = on

    def _stop_tracing(self) -> None:
        if self._tracing and self._tracer is not None:
            self._tracing = False
            self._tracer.off()

    def _next_op(self, kind: str) -> int:
        """The profile's index of the op the watched segment runs now, checked."""
        index, watch = self._op_index, self._watch
        self._op_index += 1
        assert watch is not None
        expected = watch.op_kinds.get(index)
        if expected != kind:
            got = f"op {index} is {expected}" if expected else f"has no op {index} there"
            raise InputError(
                f"the step ran {kind} where its profile {got}: the plan's profile is not of "
                "this step (another batch, code path or kernels); profile it again with "
                "mode='traced' (slackswap.plan(model, batch) does) or on this device"
            )
        return index

    def _forward_done(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._in_forward = False

    def _check_batch(self, tensors: list[torch.Tensor], named: dict | None = None) -> None:
        if batch_fingerprint(tensors) == self._fingerprint[32:]:
            return
        if self._profile is not None and named:
            shapes = {t.name: t.shape for t in self._profile.tensors if t.kind == "input"}
            for key, t in named.items():
                planned = shapes.get(f"input:{key}")
                if isinstance(t, torch.Tensor) and planned not in (None, list(t.shape)):
                    raise InputError(f"plan was made for batch '{key}' of shape {planned}, "
                                     f"not {list(t.shape)}; re-plan for this shape")
        got = [list(t.shape) for t in tensors]
        raise InputError(f"plan was made for a batch of other shapes than {got}; "
                         "re-plan for this batch")

    def _reset(self) -> None:
        # What earlier steps packed stays valid: their handles hold their own nodes, and
        # host copies and rebuilt storages go as they are unpacked.
        self.stats = RuntimeStats()
        self._nodes = {}
        self._namer = ActivationNamer()
        self._segment, self._op_index, self._packs_seen = 0, 0, 0
        self._kept_refs = {}
        self._checked = False
        self._calls = 0
        self._in_forward = False
        self._group, self._group_position = {}, None
        self._kept_checkpoints = {}
        self._offloaded = {}
        self._next_prefetch = 0
        self._held = {}
        self._external = {}
        self._outside_read = set()
        self._outside_writes = {}
        self._snapshots = {}
        self._packs = {}
        self._written = []
        # the model's state is held (by self._state) through the step, so its storage
        # keys stay its own without a weak reference each
        self._state_keys = {storage_key(t) for t in self._state.values()
                            if t.layout == torch.strided}

    def _mark_external(self, t: torch.Tensor) -> None:
        # the weak reference keeps the storage's key from being reused while it is held
        self._external[storage_key(t)] = StorageWeakRef(t.untyped_storage())

    def _is_external(self, key: int) -> bool:
        if key in self._state_keys:
            return True
        ref = self._external.get(key)
        return ref is not None and not ref.expired()

    # -- forward: naming and recipes ---------------------------------------------------
    def _before_write(self, func, args, kwargs) -> None:
        """An op is about to change tensors in place. An outside tensor a recipe has read
        is snapshotted first, so a rebuild reads what forward read; an activation written
        without being an output of the op gets a step no replay can repeat. The saved
        tensors over what it writes are looked at once it has (autograd bumps their
        version after the kernel; see :meth:`_mark_modified`)."""
        written = written_arguments(func)
        for position, x in (*enumerate(args), *kwargs.items()):
            if (position not in written or not isinstance(x, torch.Tensor)
                    or x.layout != torch.strided):
                continue
            key = storage_key(x)
            self._written.extend(self._packs.get(key, ()))
            node = self._nodes.get(key)
            if node is None:  # an outside storage: counted, and kept as it was if read
                writes = self._outside_writes.get(key, 0)
                if key in self._outside_read and (key, writes) not in self._snapshots:
                    self._snapshots[key, writes] = _copy_storage(x)
                self._outside_writes[key] = writes + 1
            if node is not None and not _returns_alias(func, position):
                node.steps.append(Step(None, (), {}, 0, None, [None]))

    def _mark_modified(self) -> None:
        """Saved tensors the last op changed are marked, so backward fails as autograd
        does when it reads one (its hooks switch that check off)."""
        for ref in self._written:
            packed = ref()
            saved = packed.saved() if packed is not None else None
            if saved is not None and saved._version != packed.version:
                packed.modified = True
        self._written.clear()

    def _record(self, func, kind, args, kwargs, out, rng, index: int | None) -> None:
        nodes = self._nodes
        outside_read = self._outside_read
        sparse = index is not None

        def ref(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x  # constants stay as they are
            if x.layout == torch.strided:
                key = storage_key(x)
                node = nodes.get(key)
                if node is None and sparse and not self._is_external(key):
                    # made in a segment nobody watched: read back as it is now, from a
                    # saved handle, or not at all (then a rebuild needing it stops)
                    node = self._unwatched_node(x, key)
                if node is not None:
                    return Ref(node, len(node.steps), geometry(x))
                if not self._is_external(key):
                    self._mark_external(x)
                outside_read.add(key)
                return Outside(x, x._version, self._outside_writes.get(key, 0))
            # parameters, buffers, batch inputs: read again only as they are now
            return Outside(x, x._version)

        written = written_arguments(func)
        if written:  # a replay must not repeat its writes to buffers (BatchNorm's stats)
            def mark(key: Any, x: Any) -> Any:
                if key not in written or not isinstance(x, torch.Tensor):
                    return map_args(ref, x)
                if x.layout == torch.strided and storage_key(x) in nodes:
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
        mutable = func._schema.is_mutable
        names = self._watch.op_names[index] if sparse else None
        for i, t in enumerate(tensors):
            key = storage_key(t)
            if self._is_external(key):
                continue
            node = self._nodes.get(key)
            step = Step(func, step_args, step_kwargs, i, rng, outputs, grad)
            if node is None and sparse and mutable:
                # written in place here, made where nobody watched: no replay makes it
                node = self._unwatched_node(t, key)
            if node is None:
                name = (names[i] if i < len(names) else None) if names is not None else (
                    self._namer(self._path(), kind))
                node = self._nodes[key] = Node(name, step, t)
                outputs[i] = node
                if node.name in self._checkpoints:  # autograd does not save it: we keep it
                    self._kept_checkpoints[key] = (self._checkpoints[node.name], t)
                    self._hold((key, None), t.untyped_storage().nbytes())
            elif mutable:
                node.steps.append(step)

    # -- saved_tensors_hooks -----------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        name = None
        if self._watch is not None and not self._replaying:
            # the j-th save of the step saves what the profile's j-th save did
            j = self._packs_seen
            self._packs_seen = j + 1
            names = self._watch.pack_names
            name = names[j] if j < len(names) else None
        if not plain_strided(t):  # kept as autograd saved it
            return _Saved(t)
        key = storage_key(t)
        node = self._nodes.get(key)
        nbytes = t.untyped_storage().nbytes()
        # detached: a saved output holding its own grad_fn would make the graph a cycle
        # that outlives a dropped step (the detached tensor shares the version counter)
        if nbytes < MIN_PLANNED_BYTES:
            return _Saved(self._kept(t, key, node))
        if node is None:
            if self._is_external(key):
                return _Saved(t.detach())
            if name is None:
                return _Saved(self._kept(t, key, None))
            if name in self.decisions:
                node = self._saved_node(t, key, name, nbytes)
        elif name is not None and node.name is None:
            node.name = name
        else:
            name = node.name
        decision = self.decisions.get(name, "keep")
        # NOTE [values, not storages]: a storage changed in place between two saves holds
        # two values; the version is how many recorded ops have written it so far.
        vkey = (key, len(node.steps) if node is not None else 0)
        if decision == "keep":
            kept = self._kept(t, key, node)
            self._hold(vkey, nbytes)
            packed = _Packed(self, "keep", vkey, name, node, t, kept)
        else:
            assert node is not None
            if decision == "recompute" and not node.replayable():
                raise InputError(
                    f"cannot recompute '{name}': {node.unreplayable()} is not known to "
                    "replay bit for bit; keep or offload it (plans from slackswap.plan "
                    "never recompute it)"
                )
            packed = _Packed(self, decision, vkey, name, node, t, None)
            self._outstanding += 1
            if self.verify and vkey not in self._originals:
                with self._unrecorded():
                    self._originals[vkey] = _copy_storage(t)
            if decision == "offload" and vkey not in self._host:
                with self._unrecorded():
                    self._host[vkey] = self._copies.offload(t)
                self._offloaded[name] = vkey
                self.stats.offloaded_bytes += self._host[vkey].numel()
            self._packs.setdefault(key, []).append(weakref.ref(packed))
        self._pending[vkey] = self._pending.get(vkey, 0) + 1
        self._handles[vkey] = self._handles.get(vkey, 0) + 1
        return packed

    def _kept(self, t: torch.Tensor, key: int, node: Node | None) -> torch.Tensor:
        """``t`` detached, as autograd will hold it: a rebuild may read the storage
        through it after ``t`` died (or through a node a watched op makes for it later)."""
        kept = t.detach()
        if node is not None:
            node.kept.append(weakref.ref(kept))
        else:
            self._kept_refs[key] = weakref.ref(kept)
        return kept

    def _unwatched_node(self, t: torch.Tensor, key: int) -> Node:
        """A storage made where the runtime did not watch: its first step is one no
        replay repeats, so it is read back as it is, or from a saved handle, never made."""
        node = self._nodes[key] = Node(None, Step(None, (), {}, 0, None, [None]), t)
        kept = self._kept_refs.get(key)
        if kept is not None:
            node.kept.append(kept)
        return node

    def _saved_node(self, t: torch.Tensor, key: int, name: str, nbytes: int) -> Node:
        """Autograd saves, unwatched, the tensor the profile names ``name``, and the plan
        moves it."""
        assert self._watch is not None
        planned = self._watch.bytes.get(name)
        if planned is not None and planned != nbytes:
            raise InputError(
                f"the step saved {nbytes} bytes where its profile saved '{name}' "
                f"({planned} bytes): the plan's profile is not of this step (another "
                "batch, code path or kernels); profile it again with mode='traced' "
                "(slackswap.plan(model, batch) does) or on this device"
            )
        node = self._unwatched_node(t, key)
        node.name = name
        return node

    def _handle_gone(self, vkey: tuple[int, int], kept: bool) -> None:
        """Autograd freed a packed handle (its node ran, or the graph was dropped): once
        none is left for the value, whatever the runtime holds for it goes."""
        self._handles[vkey] -= 1
        if self._handles[vkey] == 0:
            del self._handles[vkey]
            self._host.pop(vkey, None)
            self._back.pop(vkey, None)
            self._originals.pop(vkey, None)
            self._release(vkey)
            never = self._pending.pop(vkey, 0)  # never unpacked
            if not kept and never:
                self._outstanding -= never
                if self._outstanding == 0:
                    self._group = {}

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _Saved:
            return packed.unpack()
        if self._in_forward:
            raise InputError(NESTED_BACKWARD)
        if not self._checked:
            self._check_seen()
        if self._written:
            self._mark_modified()
        packed.check_version()
        vkey = packed.vkey
        position = self._first_use.get(packed.name)
        if position is None or position != self._group_position:
            # NOTE [rebuild groups]: what rebuilds make for one backward op (the profile
            # op that first needs this tensor) serves all of that op's rebuilds, then goes,
            # as in the simulator's schedule; without a profile, each unpack is a group.
            self._group, self._group_position = {}, position
            self._release_checkpoints(position)
        self._prefetch_up_to(position, packed.device)
        if packed.decision == "keep":
            out = packed.tensor
        else:
            base = self._back.get(vkey)
            if base is None:
                if packed.decision == "offload":
                    self.stats.late_reloads += 1  # not prefetched: backward waits for it
                    base = self._reload(vkey, packed.device, waited=True)
                else:
                    base = self._rebuild(packed.node, packed.upto)
                self._bring_back(vkey, base)
            base = self._copies.ready(base, self.stats)
            out = view_of(base, packed.geometry)
            if vkey in self._originals:
                self._verify(packed, out)
        remaining = self._pending.pop(vkey, 0) - 1
        if remaining > 0:
            self._pending[vkey] = remaining
        # the last saved reference to it is back; below zero, a second backward through a
        # retained graph (or a second read of ctx.saved_tensors) brought it back again
        if remaining <= 0:
            base = self._back.pop(vkey, None)
            if base is not None:  # another rebuild for this same op may still read it
                self._group[vkey] = base
            self._release(vkey)
        if remaining >= 0 and packed.decision != "keep":
            self._outstanding -= 1
            if self._outstanding == 0:  # backward is through: what rebuilds made goes
                self._group = {}
                self._release_checkpoints(None)
        return out

    def _verify(self, packed: _Packed, out: torch.Tensor) -> None:
        original = view_of(self._originals[packed.vkey], packed.geometry)
        if not _same_bits(original, out):
            how = "reloaded from host memory" if packed.decision == "offload" else "rebuilt"
            last = packed.node.steps[packed.upto - 1].func
            raise VerifyError(
                f"verify: '{packed.node.name}' {how} differs from the original (last "
                f"written by {last}); keep it, and please report the model"
            )
        self.stats.verified += 1

    @contextlib.contextmanager
    def _unrecorded(self):
        """The runtime's own ops in forward (host copies) are not the model's: no names,
        no recipes (a recipe holding a storage would keep it alive)."""
        before, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._replaying = before

    def _hold(self, key: Any, nbytes: int) -> None:
        if key not in self._held:
            self._held[key] = nbytes
            self.stats._hold(nbytes)

    def _release(self, key: Any) -> None:
        nbytes = self._held.pop(key, None)
        if nbytes is not None:
            self.stats.resident_bytes -= nbytes

    def _bring_back(self, vkey: tuple[int, int], base: torch.Tensor) -> None:
        self._back[vkey] = base
        self._hold(vkey, base.untyped_storage().nbytes())

    def _reload(self, vkey: tuple[int, int], device: torch.device,
                waited: bool = False) -> torch.Tensor:
        host = self._host[vkey]
        self.stats.reloaded_bytes += host.numel()
        if waited and device.type != "cuda":  # a synchronous copy backward waits for
            self.stats.stalls += 1
            with self.stats.stall_section(device):
                return self._copies.reload(host, device)
        return self._copies.reload(host, device)  # on CUDA, ``ready`` times any wait

    def _prefetch_up_to(self, position: int | None, device: torch.device) -> None:
        """Issue the reloads whose prefetch point is at or before ``position`` (the
        profile op that needs the tensor being unpacked now), in plan order."""
        if position is None:
            return
        while self._next_prefetch < len(self._prefetch):
            name, point = self._prefetch[self._next_prefetch]
            if point > position:
                break
            self._next_prefetch += 1
            vkey = self._offloaded.get(name)
            waiting = vkey is not None and self._pending.get(vkey, 0) > 0
            if waiting and vkey in self._host and vkey not in self._back:
                self._bring_back(vkey, self._reload(vkey, device))
                self.stats.prefetched += 1

    def _check_seen(self) -> None:
        self._checked = True
        produced = {node.name for node in self._nodes.values()}
        if self._watch is not None:  # saved where nobody watched, small ones included
            produced.update(self._watch.pack_names[:self._packs_seen])
        missing = [n for n in self.decisions if n not in produced]
        if missing:
            raise InputError(
                f"plan names '{missing[0]}' (and {len(missing) - 1} more) that this step did "
                "not produce: it was made for another model, batch shape or kernels"
            )

    # -- recompute ---------------------------------------------------------------------
    def _rebuild(self, node: Node, upto: int) -> torch.Tensor:
        """The node's storage as it was after ``upto`` steps, as a tensor over it."""
        alive = node.alive(upto)
        if alive is not None:
            return alive
        if self._replaying:  # an input of the rebuild in progress: timed with it
            return self._replay(node, upto)
        # The recorded ops already carry autocast's casts: replay them as they ran.
        with no_autocast(), self.stats.recompute_section(node.device):
            self._replaying = True
            try:
                return self._replay(node, upto)
            finally:
                self._replaying = False

    def _replay(self, node: Node, upto: int) -> torch.Tensor:
        current: torch.Tensor | None = None

        def resolve(x: Any) -> Any:
            if isinstance(x, Outside):
                return self._outside(x, node)
            if isinstance(x, GeneratorState):
                return x.generator()
            if isinstance(x, Scratch):
                return x.tensor.detach().clone()
            if not isinstance(x, Ref):
                return x
            base = current if x.node is node else self._materialize(x.node, x.upto)
            return view_of(base, x.geometry)

        for step in node.steps[:upto]:
            if step.func is None or not is_replayable(step.func):
                raise InputError(
                    f"cannot rebuild '{node.name}': {node.unreplayable()} is not known to "
                    "replay bit for bit; keep or offload the activations it depends on"
                )
            args = map_args(resolve, step.args)
            kwargs = {k: map_args(resolve, v) for k, v in step.kwargs.items()}
            if step.rng is not None:
                saved = rng_state(node.device)
                set_rng_state(step.rng, node.device)
            # in the grad mode it first ran in (kernels may differ by it), on inputs that
            # need no grad, so no graph is built and nothing is packed
            with torch.set_grad_enabled(step.grad):
                out = step.func(*args, **kwargs)
            if step.rng is not None:
                set_rng_state(saved, node.device)
            self.stats.recomputed_ops += 1
            if current is None:
                made = op_tensors(out)
                current = made[step.output]
                self._keep_siblings(step, made)
        assert current is not None
        return current

    def _outside(self, x: Outside, node: Node) -> torch.Tensor:
        """An outside tensor as the recorded op read it: as it is, or as forward saw it
        before changing it in place; changed since by anything else, the rebuild stops."""
        t = x.tensor
        strided = t.layout == torch.strided
        writes = self._outside_writes.get(storage_key(t), 0) if strided else 0
        if t._version == x.version and writes == x.writes:
            return t.detach()
        if strided:
            snapshot = self._snapshots.get((storage_key(t), x.writes))
            if snapshot is not None:
                return view_of(snapshot, geometry(t))
        raise InputError(
            f"cannot rebuild '{node.name}': a tensor from outside the step (parameter, "
            f"buffer or batch input of shape {list(t.shape)}) it was made from was changed "
            "in place after forward read it; keep or offload that activation, or change "
            "the tensor only after backward"
        )

    def _release_checkpoints(self, position: int | None) -> None:
        """Let go of the checkpoints no rebuild before ``position`` (None: any) reads."""
        for key, (last, _) in list(self._kept_checkpoints.items()):
            if position is None or last < position:
                del self._kept_checkpoints[key]
                self._release((key, None))

    def _keep_siblings(self, step: Step, made: list[torch.Tensor]) -> None:
        """A re-run producer makes its other outputs too (attention's logsumexp beside its
        output): as in the simulator, this op's rebuilds have them, and one planned for
        recompute that backward will unpack stays instead of being rebuilt again."""
        for j, sibling in enumerate(step.outputs):
            if sibling is None or j == step.output or sibling.alive(1) is not None:
                continue
            if len(sibling.steps) == 1:  # not changed in place later in forward
                vkey = (sibling.key, 1)
                self._group[vkey] = made[j]
                # one planned for recompute stays till backward unpacks it; an offloaded
                # one is reloaded then, as the simulator schedules it
                planned = self.decisions.get(sibling.name) == "recompute"
                if planned and self._pending.get(vkey, 0) > 0 and vkey not in self._back:
                    self._bring_back(vkey, made[j])

    def _materialize(self, node: Node, upto: int) -> torch.Tensor:
        """An input of a rebuild: back already, still alive, on the host, or rebuilt."""
        vkey = (node.key, upto)
        if vkey in self._back:  # a prefetched reload may still be in flight
            return self._copies.ready(self._back[vkey], self.stats)
        alive = node.alive(upto)
        if alive is not None:
            return alive
        # made already for this backward op (NOTE [rebuild groups]): an input read twice
        # (a residual, say) is made once
        if (base := self._group.get(vkey)) is not None:
            return base
        if vkey in self._host:
            # backward unpacks it later; the rebuild reads it now
            base = self._copies.ready(self._reload(vkey, node.device), self.stats)
        else:
            base = self._rebuild(node, upto)
        self._group[vkey] = base
        if self._pending.get(vkey, 0) > 0:
            # a saved activation backward will unpack later: keep it, as the simulator does
            self._bring_back(vkey, base)
        return base


def _returns_alias(func: Any, position: Any) -> bool:
    """The op returns (an alias of) the argument it writes at ``position``, as in-place
    and ``out=`` ops do: the write is then recorded as a step of the returned storage."""
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


def _copy_storage(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=t.device)
    copy.untyped_storage().copy_(storage)
    return copy


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
