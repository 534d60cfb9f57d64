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
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from slackswap.core.plan import MIN_PLANNED_BYTES, Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError
from slackswap.profiling.naming import (
    ForwardModules,
    activation_name,
    is_attention,
    is_random,
    is_recorded,
    name_kind,
    op_kind,
)

__all__ = ["apply", "RuntimeStats"]


class _Timer:
    """Seconds spent in sections of backward: the CPU clock, or on CUDA a pair of events
    on the compute stream, read only when asked so that timing never makes a step wait."""

    def __init__(self) -> None:
        self._cpu_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def section(self, device: torch.device):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._cpu_s += time.perf_counter() - begin

    @property
    def seconds(self) -> float:
        for _, end in self._events:
            end.synchronize()
        return self._cpu_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


@dataclass
class RuntimeStats:
    """What the last step did. Resident bytes count the saved activations the runtime
    holds on the device (kept, reloaded or rebuilt), each storage once, from when it is
    saved or brought back until backward unpacks it for the last time; storages under
    1 KiB, which are never moved, are left out."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    prefetched: int = 0  # reloads issued at their prefetch point
    late_reloads: int = 0  # reloads issued only when backward needed them
    stalls: int = 0  # times backward waited for a reload
    recomputed_ops: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    _recompute: _Timer = field(default_factory=_Timer, repr=False)
    _stall: _Timer = field(default_factory=_Timer, repr=False)

    @property
    def recompute_s(self) -> float:
        """Time spent rebuilding dropped activations."""
        return self._recompute.seconds

    @property
    def stall_s(self) -> float:
        """Time backward waited for reloads (on CUDA: the compute stream's wait)."""
        return self._stall.seconds

    def as_dict(self) -> dict[str, float]:
        """Every figure, times included (on CUDA this waits for the step's timing events)."""
        figures = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return figures | {"recompute_s": self.recompute_s, "stall_s": self.stall_s}

    def _hold(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)


@dataclass(frozen=True, slots=True)
class _Ref:
    """An activation argument: a view into the storage of ``node`` as it was after
    ``upto`` of its steps."""

    node: _Node
    upto: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(slots=True)
class _Step:
    func: Any
    args: Any  # with activation tensors replaced by _Ref
    kwargs: Any
    output: int  # which tensor output of the op is the node's storage
    rng: tuple[torch.Tensor, torch.Tensor | None] | None
    outputs: list[_Node | None]  # the nodes of all the op's outputs, shared by its steps


class _Node:
    """How one storage made in forward came to be: its producer, then in-place ops."""

    __slots__ = ("name", "key", "device", "steps", "ref", "kept", "storage", "__weakref__")

    def __init__(self, name: str, step: _Step, tensor: torch.Tensor) -> None:
        self.name = name
        self.key = _storage_key(tensor)
        self.device = tensor.device
        self.steps = [step]
        self.ref = weakref.ref(tensor)
        self.kept: Any = None  # a weak reference to a saved, kept tensor over the storage
        # NOTE: a weak reference to the StorageImpl keeps its address from being reused,
        # so storage keys stay unique while this node lives.
        self.storage = StorageWeakRef(tensor.untyped_storage())

    def alive(self, upto: int) -> torch.Tensor | None:
        """A tensor over the storage as it is after ``upto`` steps, if one still lives."""
        if len(self.steps) != upto:
            return None
        tensor = self.ref()
        if tensor is None and self.kept is not None:
            tensor = self.kept()
        return tensor


# NOTE: aten arguments are scalars, tensors and flat lists of them (a schema never nests
# deeper), so two small functions replace torch.utils._pytree here: the dispatch mode runs
# them on every op of the forward pass, and pytree's generality costs about 10x more.
def _map_args(fn: Any, x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_map_args(fn, y) for y in x)
    return fn(x)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The strided tensor outputs of an op, in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.layout == torch.strided else []
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    return []


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _view(base: torch.Tensor, size, stride, offset, dtype) -> torch.Tensor:
    out = base.new_empty(0, dtype=dtype)
    return out.set_(base.untyped_storage(), offset, size, stride)


def _no_autocast() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    return stack


def _rng_state(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state, and the CUDA generator's of ``device`` (the op's)."""
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None],
                   device: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass(frozen=True, slots=True)
class _GeneratorState:
    """A ``torch.Generator`` argument as it was before the op drew from it: replay draws
    from a fresh generator in that state, since the user's own has moved on."""

    device: torch.device
    state: torch.Tensor

    def generator(self) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.set_state(self.state)
        return generator


@dataclass(frozen=True, slots=True)
class _Scratch:
    """A tensor from outside the step that the op writes (a BatchNorm running statistic):
    a replay writes to a copy, so rebuilding an activation leaves the model as it was."""

    tensor: torch.Tensor


_WRITTEN: dict[Any, frozenset] = {}
# Batch norms whose schemas do not mark the running statistics they update (3 and 4).
_UNMARKED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4),
                    "miopen_batch_norm": (3, 4)}


def _written_arguments(func: Any) -> frozenset:
    """Positions and names of the arguments an op writes, from its schema (memoised)."""
    written = _WRITTEN.get(func)
    if written is None:
        arguments = func._schema.arguments
        marked = [i for i, a in enumerate(arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        marked += _UNMARKED_WRITES.get(op_kind(func), ())
        written = frozenset(marked) | {arguments[i].name for i in marked}
        _WRITTEN[func] = written
    return written


def _op_device(args: tuple) -> torch.device | None:
    for x in args:
        if isinstance(x, torch.Tensor):
            return x.device
    return None


class _Tracer(TorchDispatchMode):
    def __init__(self, owner: apply) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if (not is_recorded(func) or owner._replaying
                or torch._C._current_graph_task_id() != -1):
            return func(*args, **kwargs)
        kind = op_kind(func)
        rng = None
        # attention kernels draw from the RNG when they have dropout
        if is_random(func) or is_attention(kind):
            rng = _rng_state(_op_device(args))
            generator = kwargs.get("generator")
            if isinstance(generator, torch.Generator):
                recorded = _GeneratorState(generator.device, generator.get_state())
        out = func(*args, **kwargs)
        if rng is not None and isinstance(kwargs.get("generator"), torch.Generator):
            kwargs = {**kwargs, "generator": recorded}
        owner._record(func, name_kind(kind), args, kwargs, out, rng)
        return out


class _Packed:
    __slots__ = ("decision", "key", "node", "upto", "geometry", "device", "tensor",
                 "__weakref__")

    def __init__(self, decision, key, node, upto, geometry, device, tensor=None) -> None:
        self.decision, self.key, self.node, self.upto = decision, key, node, upto
        self.geometry, self.device = geometry, device
        self.tensor = tensor  # kept activations only


class apply:  # noqa: N801 - used as a context manager, like torch's save_on_cpu
    """Run the forward pass inside ``with slackswap.apply(model, plan):``; backward may
    run inside or after the block. Gradients are bit-identical to training without it.

    ``profile``, when given, is the profile the plan was made for: the plan is checked
    against it before anything runs, and reloads start at the plan's prefetch points.
    A plan from ``slackswap.plan(model, batch)`` carries its profile, so it need not be
    given; without one, each reload starts when backward needs the tensor.

    On CUDA the forward pass is assumed to run on one stream per device, and backward on
    the autograd engine's one thread per device (the usual single-GPU step).
    ``batch``, when given, is checked against the plan's fingerprint. Plans name
    activations by the ids a profile of the same model, batch shape and kernels gives
    (profile with ``kernels="native"`` or ``mode="measured"`` for the device you train on).
    """

    def __init__(self, model: torch.nn.Module, plan: Plan,
                 profile: StepProfile | None = None, batch: Any = None) -> None:
        from slackswap.profiling.step import eager_module

        model = eager_module(model)  # inside torch.compile's or DDP's wrapper
        # Prefetch points are profile op indices; the profile says which op needs what.
        self._first_use: dict[str, int] = {}
        self._checkpoints: dict[str, int] = {}  # unsaved tensors kept -> release position
        self._prefetch = sorted(plan.prefetch.items(), key=lambda kv: (kv[1], kv[0]))
        profile = profile if profile is not None else plan._profile
        self._fingerprint, self._profile = plan.fingerprint, profile
        if batch is not None:
            from slackswap.profiling.step import batch_tensors

            self._check_model(model)
            named = dict(batch_tensors(batch))
            self._check_batch(list(named.values()), named)
        if profile is not None:
            plan.check(profile)
            _check_recomputable(profile, plan)
            self._first_use = {n: t.first_backward_use for n, t in profile.by_name.items()
                               if t.first_backward_use is not None}
            self._checkpoints = _checkpoint_releases(profile, plan)
        self.model = model
        self.decisions = {n: d for n, d in plan.decisions.items() if d != "keep"}
        self.stats = RuntimeStats()
        self._active = False
        self._replaying = False
        self._group: dict[tuple[int, int], torch.Tensor] = {}  # made by rebuilds, this op
        self._group_position: int | None = None
        self._outstanding = 0  # packed handles not yet unpacked, all storages together
        # checkpoints held for rebuilds: storage -> (release position, tensor)
        self._kept_checkpoints: dict[int, tuple[int, torch.Tensor]] = {}
        self._nodes: dict[int, _Node] = {}
        # storages from outside the step (parameters, buffers, the batch): never named
        self._external: dict[int, StorageWeakRef] = {}
        # host copies, by storage; each lives as long as a packed handle for it does, so a
        # second backward through a retained graph can reload it again
        self._host: dict[int, torch.Tensor] = {}
        self._host_refs: dict[int, int] = {}
        self._back: dict[int, torch.Tensor] = {}  # storages rebuilt or reloaded, this step
        self._pending: dict[int, int] = {}  # packed handles not yet unpacked, by storage
        self._held: dict[int, int] = {}  # saved storages resident on the device -> bytes
        self._counts: dict[tuple[str, str], int] = {}
        self._checked = False
        self._offloaded: dict[str, int] = {}  # activation id -> storage key, this step
        self._next_prefetch = 0
        self._copies = _Copies()

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> apply:
        self._active = torch.is_grad_enabled()  # under no_grad nothing is saved
        if not self._active:
            return self
        self._check_model(self.model)
        self._reset()
        self._call_hook = self.model.register_forward_pre_hook(self._check_call,
                                                               with_kwargs=True)
        self._tracker = ForwardModules(self.model)
        self._path = self._tracker.innermost
        self._tracker.__enter__()
        self._tracer = _Tracer(self)
        self._tracer.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        # NOTE [no cyclic GC in forward]: the runtime keeps a small record per forward op
        # until backward, and those allocations set off Python's cyclic collector over
        # the whole heap again and again: two thirds of the runtime's cost per op, on a
        # heap as large as a training process has. Reference counting still frees
        # everything; only the cycle collector waits until the block ends.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            return
        self._hooks.__exit__(*exc)
        self._tracer.__exit__(*exc)
        self._tracker.__exit__(*exc)
        self._call_hook.remove()
        if self._gc_was_enabled:
            gc.enable()

    # -- what the plan was made for ----------------------------------------------------
    def _check_model(self, model: torch.nn.Module) -> None:
        from slackswap.profiling.step import model_fingerprint, refuse_own_checkpointing

        refuse_own_checkpointing(model)
        if model_fingerprint(model) != self._fingerprint[:32]:
            raise InputError(
                "plan was made for a different model (its modules, parameter shapes or "
                "train/eval mode differ); re-plan for this model"
            )

    def _check_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the model runs: it runs once in the block, on the plan's batch."""
        if self._calls:
            raise InputError(
                "the model ran twice in one `with slackswap.apply(...)` block, but a plan "
                "covers one forward pass: open one block per forward (per micro-batch)"
            )
        self._calls += 1
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        self._check_batch(tensors, dict(kwargs) or dict(enumerate(args)))

    def _check_batch(self, tensors: list[torch.Tensor], named: dict | None = None) -> None:
        from slackswap.profiling.step import batch_fingerprint

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
        self._counts.clear()
        self._checked = False
        self._calls = 0
        self._group, self._group_position = {}, None
        self._kept_checkpoints = {}
        self._offloaded = {}
        self._next_prefetch = 0
        self._held = {}
        self._external = {}
        for t in (*self.model.parameters(), *self.model.buffers()):
            self._mark_external(t)

    def _mark_external(self, t: torch.Tensor) -> None:
        # the weak reference keeps the storage's key from being reused while it is held
        self._external[_storage_key(t)] = StorageWeakRef(t.untyped_storage())

    def _is_external(self, key: int) -> bool:
        ref = self._external.get(key)
        return ref is not None and not ref.expired()

    # -- forward: naming and recipes ---------------------------------------------------
    def _record(self, func, kind, args, kwargs, out, rng) -> None:
        module = self._path()
        nodes = self._nodes

        def ref(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.layout == torch.strided:
                key = _storage_key(x)
                node = nodes.get(key)
                if node is not None:
                    return _Ref(node, len(node.steps), tuple(x.size()), tuple(x.stride()),
                                x.storage_offset(), x.dtype)
                if not self._is_external(key):
                    self._mark_external(x)
            # parameters, buffers, batch inputs and constants stay as they are
            return x

        step_args = _map_args(ref, args)
        step_kwargs = {k: _map_args(ref, v) for k, v in kwargs.items()} if kwargs else kwargs
        written = _written_arguments(func)
        if written:  # a replay must not repeat its writes to buffers (BatchNorm's stats)
            step_args = tuple(_Scratch(a) if i in written and isinstance(a, torch.Tensor)
                              else a for i, a in enumerate(step_args))
            step_kwargs = {k: _Scratch(v) if k in written and isinstance(v, torch.Tensor)
                           else v for k, v in step_kwargs.items()}
        tensors = _tensors(out)
        outputs: list[_Node | None] = [None] * len(tensors)
        for i, t in enumerate(tensors):
            key = _storage_key(t)
            if self._is_external(key):
                continue
            node = self._nodes.get(key)
            step = _Step(func, step_args, step_kwargs, i, rng, outputs)
            if node is None:
                k = self._counts.get((module, kind), 0)
                self._counts[module, kind] = k + 1
                node = self._nodes[key] = _Node(activation_name(module, kind, k), step, t)
                outputs[i] = node
                if node.name in self._checkpoints:  # autograd does not save it: we keep it
                    self._kept_checkpoints[key] = (self._checkpoints[node.name], t)
                    self._hold(key, t.untyped_storage().nbytes())
            elif func._schema.is_mutable:
                node.steps.append(step)

    # -- saved_tensors_hooks -----------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        node = self._nodes.get(key)
        nbytes = t.untyped_storage().nbytes()
        if node is None or nbytes < MIN_PLANNED_BYTES:
            return t
        self._pending[key] = self._pending.get(key, 0) + 1
        self._outstanding += 1
        decision = self.decisions.get(node.name, "keep")
        if decision == "keep":
            self._hold(key, nbytes)
            node.kept = weakref.ref(t)  # a rebuild may read it after the op's own tensor died
            return _Packed("keep", key, node, 0, None, t.device, tensor=t)
        geometry = (tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)
        packed = _Packed(decision, key, node, len(node.steps), geometry, t.device)
        if decision == "offload":
            if key not in self._host:
                with self._unrecorded():
                    self._host[key] = self._copies.offload(t)
                self._offloaded[node.name] = key
                self.stats.offloaded_bytes += self._host[key].numel()
            self._host_refs[key] = self._host_refs.get(key, 0) + 1
            weakref.finalize(packed, self._drop_host, key)
        return packed

    def _drop_host(self, key: int) -> None:
        """A packed handle is gone (autograd freed it): its host copy may go too."""
        self._host_refs[key] -= 1
        if self._host_refs[key] == 0:
            del self._host_refs[key], self._host[key]

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if not self._checked:
            self._check_seen()
        key = packed.key
        position = self._first_use.get(packed.node.name)
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
            base = self._back.get(key)
            if base is None:
                if packed.decision == "offload":
                    self.stats.late_reloads += 1  # not prefetched: backward waits for it
                    base = self._reload(key, packed.device, waited=True)
                else:
                    base = self._rebuild(packed.node, packed.upto)
                self._bring_back(key, base)
            base = self._copies.ready(base, self.stats)
            out = _view(base, *packed.geometry)
        remaining = self._pending.get(key, 0) - 1
        self._pending[key] = max(remaining, 0)
        # the last saved reference to it is back; below zero, a second backward through a
        # retained graph (or a second read of ctx.saved_tensors) brought it back again
        if remaining <= 0:
            base = self._back.pop(key, None)
            if base is not None:  # another rebuild for this same op may still read it
                self._group[key, packed.upto] = base
            self._release(key)
        if remaining >= 0:
            self._outstanding -= 1
            if self._outstanding == 0:  # backward is through: what rebuilds made goes
                self._group = {}
                self._release_checkpoints(None)
        return out

    @contextlib.contextmanager
    def _unrecorded(self):
        """The runtime's own ops in forward (host copies) are not the model's: no names,
        no recipes (a recipe holding a storage would keep it alive)."""
        before, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._replaying = before

    def _hold(self, key: int, nbytes: int) -> None:
        if key not in self._held:
            self._held[key] = nbytes
            self.stats._hold(nbytes)

    def _release(self, key: int) -> None:
        nbytes = self._held.pop(key, None)
        if nbytes is not None:
            self.stats.resident_bytes -= nbytes

    def _bring_back(self, key: int, base: torch.Tensor) -> None:
        self._back[key] = base
        self._hold(key, base.untyped_storage().nbytes())

    def _reload(self, key: int, device: torch.device, waited: bool = False) -> torch.Tensor:
        host = self._host[key]
        self.stats.reloaded_bytes += host.numel()
        if waited and device.type != "cuda":  # a synchronous copy backward waits for
            self.stats.stalls += 1
            with self.stats._stall.section(device):
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
            key = self._offloaded.get(name)
            waiting = key is not None and self._pending.get(key, 0) > 0
            if waiting and key in self._host and key not in self._back:
                self._bring_back(key, self._reload(key, device))
                self.stats.prefetched += 1

    def _check_seen(self) -> None:
        self._checked = True
        produced = {node.name for node in self._nodes.values()}
        missing = [n for n in self.decisions if n not in produced]
        if missing:
            raise InputError(
                f"plan names '{missing[0]}' (and {len(missing) - 1} more) that this step did "
                "not produce: it was made for another model, batch shape or kernels"
            )

    # -- recompute ---------------------------------------------------------------------
    def _rebuild(self, node: _Node, upto: int) -> torch.Tensor:
        """The node's storage as it was after ``upto`` steps, as a tensor over it."""
        alive = node.alive(upto)
        if alive is not None:
            return alive
        if self._replaying:  # an input of the rebuild in progress: timed with it
            return self._replay(node, upto)
        # The recorded ops already carry autocast's casts: replay them as they ran.
        with torch.no_grad(), _no_autocast(), self.stats._recompute.section(node.device):
            self._replaying = True
            try:
                return self._replay(node, upto)
            finally:
                self._replaying = False

    def _replay(self, node: _Node, upto: int) -> torch.Tensor:
        current: torch.Tensor | None = None

        def resolve(x: Any) -> Any:
            if isinstance(x, _GeneratorState):
                return x.generator()
            if isinstance(x, _Scratch):
                return x.tensor.clone()
            if not isinstance(x, _Ref):
                return x
            base = current if x.node is node else self._materialize(x.node, x.upto)
            return _view(base, x.size, x.stride, x.offset, x.dtype)

        for step in node.steps[:upto]:
            args = _map_args(resolve, step.args)
            kwargs = {k: _map_args(resolve, v) for k, v in step.kwargs.items()}
            if step.rng is not None:
                saved = _rng_state(node.device)
                _set_rng_state(step.rng, node.device)
            out = step.func(*args, **kwargs)
            if step.rng is not None:
                _set_rng_state(saved, node.device)
            self.stats.recomputed_ops += 1
            if current is None:
                made = _tensors(out)
                current = made[step.output]
                self._keep_siblings(step, made)
        assert current is not None
        return current

    def _release_checkpoints(self, position: int | None) -> None:
        """Let go of the checkpoints no rebuild before ``position`` (None: any) reads."""
        for key, (last, _) in list(self._kept_checkpoints.items()):
            if position is None or last < position:
                del self._kept_checkpoints[key]
                self._release(key)

    def _keep_siblings(self, step: _Step, made: list[torch.Tensor]) -> None:
        """A re-run producer makes its other outputs too (attention's logsumexp beside its
        output): as in the simulator, this op's rebuilds have them, and one planned for
        recompute that backward will unpack stays instead of being rebuilt again."""
        for j, sibling in enumerate(step.outputs):
            if sibling is None or j == step.output or sibling.alive(1) is not None:
                continue
            if len(sibling.steps) == 1:  # not changed in place later in forward
                self._group[sibling.key, 1] = made[j]
                # one planned for recompute stays till backward unpacks it; an offloaded
                # one is reloaded then, as the simulator schedules it
                planned = self.decisions.get(sibling.name) == "recompute"
                if planned and self._pending.get(sibling.key, 0) > 0 \
                        and sibling.key not in self._back:
                    self._bring_back(sibling.key, made[j])

    def _materialize(self, node: _Node, upto: int) -> torch.Tensor:
        """An input of a rebuild: back already, still alive, on the host, or rebuilt."""
        if node.key in self._back:  # a prefetched reload may still be in flight
            return self._copies.ready(self._back[node.key], self.stats)
        alive = node.alive(upto)
        if alive is not None:
            return alive
        # made already for this backward op (NOTE [rebuild groups]): an input read twice
        # (a residual, say) is made once
        if (base := self._group.get((node.key, upto))) is not None:
            return base
        if node.key in self._host and len(node.steps) == upto:
            # backward unpacks it later; the rebuild reads it now
            base = self._copies.ready(self._reload(node.key, node.device), self.stats)
        else:
            base = self._rebuild(node, upto)
        self._group[node.key, upto] = base
        if self._pending.get(node.key, 0) > 0 and len(node.steps) == upto:
            # a saved activation backward will unpack later: keep it, as the simulator does
            self._bring_back(node.key, base)
        return base



def _checkpoint_releases(profile: StepProfile, plan: Plan) -> dict[str, int]:
    """Unsaved tensors the plan keeps as checkpoints for rebuilds, and the backward op
    after whose rebuilds each may go: where the simulator's schedule frees it."""
    kept = {profile.checkpointable[n].id: n for n, d in plan.decisions.items()
            if d == "keep" and n in profile.checkpointable}
    if not kept:
        return {}
    from slackswap.sim.schedule import build_schedule

    schedule = build_schedule(profile, plan)
    releases = {}
    for item in schedule.items:
        for rid in item.frees:
            name = kept.get(schedule.residencies[rid].tensor)
            if name is not None and item.position >= schedule.first_backward:
                releases[name] = item.position
    return releases


def _check_recomputable(profile: StepProfile, plan: Plan) -> None:
    """Refuse, before anything runs, to recompute an activation that an in-place op
    changes after a forward op has read it: the values backward needs are gone."""
    for name, decision in plan.decisions.items():
        t = profile.by_name.get(name)
        if decision != "recompute" or t is None:
            continue
        reads = [c for c in t.forward_consumers if t.id not in profile.ops[c].outputs]
        if not reads:
            continue
        for op in profile.ops[min(reads) + 1:]:
            if op.phase == "forward" and op.inplace and t.id in op.outputs:
                raise InputError(
                    f"cannot recompute '{name}': {op.kind} (op {op.index}) changes it in "
                    f"place after op {min(reads)} read it; keep or offload it instead"
                )


class _Copies:
    """Host copies. On CUDA: pinned buffers, offloads on a D2H stream and reloads on an
    H2D stream (a pair per device), the compute stream waiting on a reload's event only
    when it needs the tensor; ``record_stream`` tells the caching allocator not to reuse
    memory a copy still reads or writes. Elsewhere: plain synchronous copies into separate
    buffers.

    A reload's buffer is allocated on the compute stream, so memory backward frees serves
    later compute-stream allocations too (one pool, as the simulator assumes); the H2D
    stream first waits for the compute work queued so far, which is the plan's prefetch
    point: backward has reached it."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._events: dict[int, Any] = {}  # id of a reloaded tensor -> its copy's event

    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def offload(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.device.type != "cuda":
            host = torch.empty(storage.nbytes(), dtype=torch.uint8)
            host.untyped_storage().copy_(storage)
            return host
        d2h, _ = self._cuda_streams(t.device)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream(t.device))  # t has been computed
        with torch.cuda.stream(d2h):
            host.untyped_storage().copy_(storage, non_blocking=True)
        t.record_stream(d2h)  # its memory is not reused before the copy has read it
        return host

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":  # a buffer of its own, as a device copy would be
            return host.to(device, copy=True)
        d2h, h2d = self._cuda_streams(device)
        base = torch.empty(host.shape, dtype=host.dtype, device=device)
        h2d.wait_stream(torch.cuda.current_stream(device))  # base's memory is free
        h2d.wait_stream(d2h)  # the offload into ``host`` has landed
        with torch.cuda.stream(h2d):
            base.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(h2d)
        base.record_stream(h2d)
        self._events[id(base)] = event
        return base

    def ready(self, base: torch.Tensor, stats: RuntimeStats) -> torch.Tensor:
        """Make the compute stream wait for ``base``'s reload, if one is in flight; a
        copy not finished when asked is a stall, timed on the compute stream."""
        event = self._events.pop(id(base), None)
        if event is not None:
            current = torch.cuda.current_stream(base.device)
            if event.query():
                current.wait_event(event)
            else:
                stats.stalls += 1
                with stats._stall.section(base.device):
                    current.wait_event(event)
        return base
