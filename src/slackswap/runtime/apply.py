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
from slackswap.profiling.step import (
    batch_fingerprint,
    batch_tensors,
    eager_module,
    model_fingerprint,
    refuse_own_checkpointing,
)
from slackswap.runtime.checks import check_recomputable, checkpoint_releases
from slackswap.runtime.copies import HostCopies
from slackswap.runtime.recipes import (
    GeneratorState,
    Node,
    Ref,
    Scratch,
    Step,
    map_args,
    no_autocast,
    op_device,
    op_tensors,
    rng_state,
    set_rng_state,
    storage_key,
    view_of,
    written_arguments,
)
from slackswap.runtime.stats import RuntimeStats

__all__ = ["apply", "RuntimeStats"]


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
            rng = rng_state(op_device(args))
            generator = kwargs.get("generator")
            if isinstance(generator, torch.Generator):
                recorded = GeneratorState(generator.device, generator.get_state())
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
    ``batch``, when given, is checked against the plan's fingerprint up front; otherwise
    the model and the batch it is called with are checked before it runs. Plans name
    activations by the ids a profile of the same model, batch shape and kernels gives.

    On CUDA the forward pass is assumed to run on one stream per device, and backward on
    the autograd engine's one thread per device (the usual single-GPU step).
    """

    def __init__(self, model: torch.nn.Module, plan: Plan,
                 profile: StepProfile | None = None, batch: Any = None) -> None:
        model = eager_module(model)  # inside torch.compile's or DDP's wrapper
        # Prefetch points are profile op indices; the profile says which op needs what.
        self._first_use: dict[str, int] = {}
        self._checkpoints: dict[str, int] = {}  # unsaved tensors kept -> release position
        self._prefetch = sorted(plan.prefetch.items(), key=lambda kv: (kv[1], kv[0]))
        profile = profile if profile is not None else plan._profile
        self._fingerprint, self._profile = plan.fingerprint, profile
        if batch is not None:
            self._check_model(model)
            named = dict(batch_tensors(batch))
            self._check_batch(list(named.values()), named)
        if profile is not None:
            plan.check(profile)
            check_recomputable(profile, plan)
            self._first_use = {n: t.first_backward_use for n, t in profile.by_name.items()
                               if t.first_backward_use is not None}
            self._checkpoints = checkpoint_releases(profile, plan)
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
        self._nodes: dict[int, Node] = {}
        # storages from outside the step (parameters, buffers, the batch): never named
        self._external: dict[int, StorageWeakRef] = {}
        # host copies, by storage; each lives as long as a packed handle for it does, so a
        # second backward through a retained graph can reload it again
        self._host: dict[int, torch.Tensor] = {}
        self._handles: dict[int, int] = {}  # packed handles autograd still holds, by storage
        self._back: dict[int, torch.Tensor] = {}  # storages rebuilt or reloaded, this step
        self._pending: dict[int, int] = {}  # packed handles not yet unpacked, by storage
        self._held: dict[int, int] = {}  # saved storages resident on the device -> bytes
        self._counts: dict[tuple[str, str], int] = {}
        self._checked = False
        self._offloaded: dict[str, int] = {}  # activation id -> storage key, this step
        self._next_prefetch = 0
        self._copies = HostCopies()

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
        self._external[storage_key(t)] = StorageWeakRef(t.untyped_storage())

    def _is_external(self, key: int) -> bool:
        ref = self._external.get(key)
        return ref is not None and not ref.expired()

    # -- forward: naming and recipes ---------------------------------------------------
    def _record(self, func, kind, args, kwargs, out, rng) -> None:
        module = self._path()
        nodes = self._nodes

        def ref(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.layout == torch.strided:
                key = storage_key(x)
                node = nodes.get(key)
                if node is not None:
                    return Ref(node, len(node.steps), tuple(x.size()), tuple(x.stride()),
                                x.storage_offset(), x.dtype)
                if not self._is_external(key):
                    self._mark_external(x)
            # parameters, buffers, batch inputs and constants stay as they are
            return x

        step_args = map_args(ref, args)
        step_kwargs = {k: map_args(ref, v) for k, v in kwargs.items()} if kwargs else kwargs
        written = written_arguments(func)
        if written:  # a replay must not repeat its writes to buffers (BatchNorm's stats)
            step_args = tuple(Scratch(a) if i in written and isinstance(a, torch.Tensor)
                              else a for i, a in enumerate(step_args))
            step_kwargs = {k: Scratch(v) if k in written and isinstance(v, torch.Tensor)
                           else v for k, v in step_kwargs.items()}
        tensors = op_tensors(out)
        outputs: list[Node | None] = [None] * len(tensors)
        for i, t in enumerate(tensors):
            key = storage_key(t)
            if self._is_external(key):
                continue
            node = self._nodes.get(key)
            step = Step(func, step_args, step_kwargs, i, rng, outputs)
            if node is None:
                k = self._counts.get((module, kind), 0)
                self._counts[module, kind] = k + 1
                node = self._nodes[key] = Node(activation_name(module, kind, k), step, t)
                outputs[i] = node
                if node.name in self._checkpoints:  # autograd does not save it: we keep it
                    self._kept_checkpoints[key] = (self._checkpoints[node.name], t)
                    self._hold(key, t.untyped_storage().nbytes())
            elif func._schema.is_mutable:
                node.steps.append(step)

    # -- saved_tensors_hooks -----------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        node = self._nodes.get(key)
        nbytes = t.untyped_storage().nbytes()
        if node is None or nbytes < MIN_PLANNED_BYTES:
            return t
        self._pending[key] = self._pending.get(key, 0) + 1
        self._outstanding += 1
        decision = self.decisions.get(node.name, "keep")
        if decision == "keep":
            self._hold(key, nbytes)
            # detached: a saved output holding its own grad_fn would make the graph a
            # cycle that outlives a dropped step
            kept = t.detach()
            node.kept.append(weakref.ref(kept))  # a rebuild may read it after t died
            packed = _Packed("keep", key, node, 0, None, t.device, tensor=kept)
        else:
            geometry = (tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)
            packed = _Packed(decision, key, node, len(node.steps), geometry, t.device)
        if decision == "offload" and key not in self._host:
            with self._unrecorded():
                self._host[key] = self._copies.offload(t)
            self._offloaded[node.name] = key
            self.stats.offloaded_bytes += self._host[key].numel()
        self._handles[key] = self._handles.get(key, 0) + 1
        weakref.finalize(packed, self._handle_gone, key)
        return packed

    def _handle_gone(self, key: int) -> None:
        """Autograd freed a packed handle (its node ran, or the graph was dropped): once
        none is left for the storage, whatever the runtime holds for it goes."""
        self._handles[key] -= 1
        if self._handles[key] == 0:
            del self._handles[key]
            self._host.pop(key, None)
            self._back.pop(key, None)
            self._release(key)
            self._outstanding -= self._pending.pop(key, 0)  # never unpacked
            if self._outstanding == 0:
                self._group = {}

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
            out = view_of(base, *packed.geometry)
        remaining = self._pending.pop(key, 0) - 1
        if remaining > 0:
            self._pending[key] = remaining
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
    def _rebuild(self, node: Node, upto: int) -> torch.Tensor:
        """The node's storage as it was after ``upto`` steps, as a tensor over it."""
        alive = node.alive(upto)
        if alive is not None:
            return alive
        if self._replaying:  # an input of the rebuild in progress: timed with it
            return self._replay(node, upto)
        # The recorded ops already carry autocast's casts: replay them as they ran.
        with torch.no_grad(), no_autocast(), self.stats.recompute_section(node.device):
            self._replaying = True
            try:
                return self._replay(node, upto)
            finally:
                self._replaying = False

    def _replay(self, node: Node, upto: int) -> torch.Tensor:
        current: torch.Tensor | None = None

        def resolve(x: Any) -> Any:
            if isinstance(x, GeneratorState):
                return x.generator()
            if isinstance(x, Scratch):
                return x.tensor.clone()
            if not isinstance(x, Ref):
                return x
            base = current if x.node is node else self._materialize(x.node, x.upto)
            return view_of(base, x.size, x.stride, x.offset, x.dtype)

        for step in node.steps[:upto]:
            args = map_args(resolve, step.args)
            kwargs = {k: map_args(resolve, v) for k, v in step.kwargs.items()}
            if step.rng is not None:
                saved = rng_state(node.device)
                set_rng_state(step.rng, node.device)
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

    def _release_checkpoints(self, position: int | None) -> None:
        """Let go of the checkpoints no rebuild before ``position`` (None: any) reads."""
        for key, (last, _) in list(self._kept_checkpoints.items()):
            if position is None or last < position:
                del self._kept_checkpoints[key]
                self._release(key)

    def _keep_siblings(self, step: Step, made: list[torch.Tensor]) -> None:
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

    def _materialize(self, node: Node, upto: int) -> torch.Tensor:
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
