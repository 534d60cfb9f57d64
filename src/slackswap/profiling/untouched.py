"""A profiled step that leaves the model, the batch and the RNG as they were.

NOTE [a profiled step leaves no trace]
    ``slackswap.plan(model, batch)``, ``attach`` and ``compile`` run a real training step
    to profile it (measured and traced modes). Whatever that step changes, training after
    it must not see: it would differ from plain PyTorch even at ``budget=1.0``. A step can
    change
    - the gradients (put back: the step accumulates into fresh ``.grad`` tensors),
    - the buffers (batch-norm statistics): copied before, written back after,
    - other tensors in place: a parameter decayed in forward, ``nn.Embedding(max_norm=)``'s
      renormalised rows, a batch tensor changed in place, a tensor the module holds as a
      plain attribute. :class:`StateGuard`, a dispatch mode over an eager step, copies
      each such storage before the first op that writes it (only those written: no copy
      of a model that writes none) and writes the copies back afterwards. A compiled
      step (``slackswap.compile``) runs no dispatch mode: its writes to these are not
      put back,
    - the modules' Python attributes: a call counter, a flag, a tensor rebound to a new
      one. Scalars and tensors are rebound as they were, lists, dicts and sets refilled,
      scalar and tensor attributes the step added (a lazily made cache) removed. The
      module's own registries are among the dicts refilled (hooks, parameters, buffers,
      submodules): a flag the step set goes together with the hooks it registered
      (transformers' ``capture_outputs`` registers its output hooks on the first call
      and marks the model; the flag removed alone, the next call registers them twice
      and collects every hidden state twice),
    - autocast's cache of weight casts (NOTE [autocast's cache of weight casts]),
    - the parameters' gradient hooks of the program's own do not run (NOTE [a parameter's
      gradient hooks wait for the training step]),
    - the RNG streams: the CPU's, every CUDA device's, any generator a module holds
      (``torch.Generator``, NumPy's ``Generator`` or ``RandomState``, ``random.Random``),
      any ``torch.Generator`` an op of the step drew from (``generator=``: one passed to
      the model's call, as diffusers' ``AutoencoderKL(x, generator=g)`` takes, or a
      global; :class:`StateGuard` takes its state before its first draw),
      and the process-wide ones outside torch, Python's ``random`` and NumPy's global
      generator (:class:`HostRandom`): Hugging Face's wav2vec2, HuBERT and their kin draw
      SpecAugment's masks from ``np.random`` in every training forward, so a profiled
      step that left it advanced gave ``attach`` other masks than plain training. Whether
      the step drew from them or from a generator a module holds is kept
      (``StepProfile.host_random``): the runtime then takes them too when it may have to
      put a step back (NOTE [refusals leave no trace]).
    Not put back, and so not promised: writes by no op at all (through a NumPy array
    over a parameter), objects nested deeper than one container in a module attribute,
    and other state outside the model (a global counter, a logger).
"""

from __future__ import annotations

import contextlib
import copy
import random
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from slackswap.profiling.naming import written_arguments

__all__ = ["REBINDABLE", "HostRandom", "StateGuard", "held_generators", "leaves_no_trace"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_CONTAINERS = (list, dict, set)
# an attribute of these kinds that a step added is taken away when the step is put back
REBINDABLE = (*_SCALARS, tuple, torch.Tensor)


def _real(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
            and t.layout == torch.strided and t.device.type != "meta")


# NOTE [a tensor resized in place is put back whole]
#     A step may resize a tensor in place (``resize_``, a module's cache grown as it
#     counts), not only write it: its storage then holds other bytes and the tensor has
#     another shape. Writing the old bytes back into the grown storage raised (a
#     traceback from the profiler, or from the runtime's second try of a step off the
#     profiled path). What is put back is the storage's size, its bytes, and the
#     tensor's geometry over it (size, stride, offset), so the tensor is again as it was,
#     the same object for whoever else holds it.
_Geometry = tuple[int, tuple[int, ...], tuple[int, ...], int]  # storage bytes, size, stride, offset


def _geometry(t: torch.Tensor) -> _Geometry:
    return (t.untyped_storage().nbytes(), tuple(t.shape), t.stride(), t.storage_offset())


def _reshaped(t: torch.Tensor, geometry: _Geometry) -> torch.UntypedStorage:
    """NOTE [a tensor resized in place is put back whole]: ``t`` over a storage of the
    size it had, in the geometry it had (call under ``no_grad``); that storage."""
    storage = t.untyped_storage()
    if _geometry(t) != geometry:
        if storage.nbytes() != geometry[0]:
            storage.resize_(geometry[0])
        t.set_(storage, geometry[3], geometry[1], geometry[2])
    return storage


def put_back(t: torch.Tensor, values: torch.UntypedStorage, geometry: _Geometry) -> None:
    """``t``'s storage holds ``values`` again and ``t`` the geometry it had (NOTE [a
    tensor resized in place is put back whole]; call under ``no_grad``)."""
    _reshaped(t, geometry).copy_(values)


class StateGuard(TorchDispatchMode):
    """Copies each watched storage before the first op that writes it; :meth:`restore`
    writes the copies back (NOTE [a profiled step leaves no trace])."""

    def __init__(self, tensors: Iterable[torch.Tensor],
                 weights: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.watched: dict[int, torch.Tensor] = {
            t.untyped_storage()._cdata: t for t in tensors if _real(t)}
        self.copies: dict[int, tuple[torch.Tensor, torch.UntypedStorage, _Geometry]] = {}
        self.host_random = False  # whether the step drew from :class:`HostRandom`'s streams
        # NOTE [autocast's cache of weight casts]: the weights whose casts autocast
        # caches, and whether the step cast one (then its casts are let go after it)
        self.weights = {id(w) for w in weights if w.requires_grad}
        self.cast_weights = False
        # each ``torch.Generator`` an op drew from (``generator=``), as before its first
        # draw: one the model holds nowhere (a call's argument, a global) is put back too
        self.generators: dict[int, _GeneratorState] = {}
        self.drawn: list[torch.Generator] = []  # them, once put back
        # buffers the step resized in place: name -> (shape before, shape after)
        self.resized: dict[str, tuple[list[int], list[int]]] = {}
        # the modules' Python attributes the step set: module name -> attribute names
        self.attributes: dict[str, list[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TO_COPY and args and id(args[0]) in self.weights:
            self.cast_weights = True  # NOTE [autocast's cache of weight casts]
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and id(generator) not in self.generators:
            self.generators[id(generator)] = _GeneratorState(generator)
        if func._schema.is_mutable and self.watched:
            written = written_arguments(func)
            for position, x in (*enumerate(args), *kwargs.items()):
                if position in written and isinstance(x, torch.Tensor) and _real(x):
                    self._before_write(x)
        return func(*args, **kwargs)

    def _before_write(self, x: torch.Tensor) -> None:
        key = x.untyped_storage()._cdata
        owner = self.watched.get(key)
        if owner is not None and key not in self.copies:
            with _disable_current_modes(), torch.no_grad():
                self.copies[key] = (owner, owner.untyped_storage().clone(), _geometry(owner))

    def restore(self) -> None:
        with _disable_current_modes(), torch.no_grad():
            for owner, saved, geometry in self.copies.values():
                put_back(owner, saved, geometry)
        self.copies.clear()
        for generator in self.generators.values():
            generator.restore()
        self.drawn = [g.generator for g in self.generators.values()]
        self.generators.clear()


def _tensors(model: torch.nn.Module, batch: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """What a step may change in place, besides the buffers (copied whole, as a compiled
    step's writes are not seen op by op): parameters, tensors modules hold as plain
    attributes, and the batch."""
    out = [*model.parameters(), *batch]
    for module in model.modules():
        out += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return out


class _Attributes:
    """Each module's Python attributes as they were, put back after the step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved: list[tuple[torch.nn.Module, set[str], dict[str, Any]]] = []
        for module in model.modules():
            attrs = vars(module)
            kept: dict[str, Any] = {}
            for name, value in attrs.items():
                if isinstance(value, REBINDABLE):
                    kept[name] = value  # rebound after the step: the same object back
                elif isinstance(value, _CONTAINERS):
                    # refilled in place; the registries too (``_forward_hooks``,
                    # ``_buffers``, ...): what the step registered goes with its flags
                    kept[name] = _Contents(value)
                elif isinstance(value, _GENERATORS):
                    kept[name] = _GeneratorState(value)
            self.saved.append((module, set(attrs), kept))

    def changed(self, model: torch.nn.Module, written: set[int] = frozenset()
                ) -> dict[str, list[str]]:
        """The attributes the step rebound, added, refilled (a list it appended to;
        not torch's registries, ``_buffers`` and the like, nor generators) or wrote in
        place (a tensor it holds as a plain attribute, over a storage in ``written``), by
        module name (NOTE [a step off the profiled path])."""
        names = {id(m): n for n, m in model.named_modules()}
        # a step that registered hooks (transformers' output capturing, on a model's first
        # call) marks that in private attributes: put back without the hooks, a step run
        # again would register them twice
        hooked = any(n.startswith("_") and isinstance(v, _Contents) and _refilled(v)
                     for _, _, kept in self.saved for n, v in kept.items())
        out: dict[str, list[str]] = {}
        for module, before, kept in self.saved:
            attrs = vars(module)
            rebound = [n for n, v in kept.items() if (
                not n.startswith("_") and _refilled(v, attrs.get(n, _MISSING))
                if isinstance(v, _Contents)
                else not isinstance(v, _GeneratorState) and (
                    attrs.get(n, _MISSING) is not v or _storage(v) in written))]
            added = [n for n, v in attrs.items() if n not in before
                     and isinstance(v, REBINDABLE)]
            changed = [n for n in rebound + added if not (hooked and n.startswith("_"))]
            if changed and id(module) in names:
                out[names[id(module)]] = sorted(changed)
        return out

    def drew(self) -> bool:
        """Whether the step drew from a generator a module holds."""
        return any(v.changed() for _, _, kept in self.saved for v in kept.values()
                   if isinstance(v, _GeneratorState))

    def restore(self) -> None:
        for module, names, kept in self.saved:
            attrs = vars(module)
            for name, value in kept.items():
                if isinstance(value, (_Contents, _GeneratorState)):
                    value.restore()
                elif attrs.get(name, _MISSING) is not value:
                    attrs[name] = value
            for name in [n for n in attrs if n not in names]:
                # a counter or a cache the step started (a length and the tensor it
                # covers go together): the next call makes them again
                if isinstance(attrs[name], REBINDABLE):
                    del attrs[name]


_MISSING = object()


def _storage(value: Any) -> int | None:
    if isinstance(value, torch.Tensor) and value.layout == torch.strided and _real(value):
        return value.untyped_storage()._cdata
    return None


def _refilled(kept: _Contents, now: Any = None) -> bool:
    """Whether a container the step reached was rebound (to ``now``) or refilled."""
    if now is not None and now is not kept.container:
        return True
    try:
        return bool(kept.container != kept.contents)
    except Exception:  # noqa: BLE001 - elements that cannot compare: changed, maybe
        return True


class HeldAttributes:
    """Some modules' Python attributes as they were (or their absence), put back by
    :meth:`restore`: those the profiled step set, before a step runs again.

    A tensor attribute is held by a weak reference and a copy of its values made by
    ``snapshot`` (the runtime's: into host memory, NOTE [refusals leave no trace]): a
    strong reference would keep the tensor the step replaces alive through the step,
    memory plain PyTorch frees at the assignment and the plan does not count (a cached
    position table measured one table over the simulated peak). Put back as it was:
    the same tensor if it lives (its values copied back if the step wrote it in place),
    else a new one on its device with the values it had."""

    __slots__ = ("values",)

    def __init__(self, model: torch.nn.Module, names: dict[str, list[str]],
                 snapshot: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        self.values: list[tuple[dict[str, Any], str, Any, Any]] = []
        for module_name, attributes in names.items():
            try:
                module = model.get_submodule(module_name)
            except AttributeError:  # not in this model: nothing of it to put back
                continue
            attrs = vars(module)
            for name in attributes:
                value = attrs.get(name, _MISSING)
                held: Any = None
                if isinstance(value, _CONTAINERS):
                    held = _Contents(value)
                elif isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
                    held = _HeldTensor(value, snapshot(value, ("attribute", id(attrs), name)))
                self.values.append((attrs, name, value if held is None or
                                    isinstance(held, _Contents) else None, held))

    def restore(self) -> None:
        for attrs, name, value, held in self.values:
            if isinstance(held, _HeldTensor):
                attrs[name] = held.restored()
            elif value is _MISSING:
                attrs.pop(name, None)
            else:
                attrs[name] = value
                if held is not None:  # a list the step appended to
                    held.restore()


class _HeldTensor:
    __slots__ = ("ref", "version", "values", "device", "geometry")

    def __init__(self, t: torch.Tensor, values: torch.Tensor) -> None:
        self.ref, self.version, self.values, self.device = (
            weakref.ref(t), t._version, values, t.device)
        self.geometry = _geometry(t)

    def restored(self) -> torch.Tensor:
        t = self.ref()
        with torch.no_grad():
            if t is None:  # replaced and freed: a new one with its values
                return self.values.to(self.device, copy=True)
            if t._version != self.version:  # written in place (or resized)
                _reshaped(t, self.geometry)
                t.copy_(self.values)
        return t


class _Contents:
    __slots__ = ("container", "contents")

    def __init__(self, container: list | dict | set) -> None:
        self.container, self.contents = container, copy.copy(container)

    def restore(self) -> None:
        c = self.container
        try:
            if c == self.contents:
                return
        except Exception:  # noqa: BLE001 - elements that cannot compare: refill anyway
            pass
        if isinstance(c, list):
            c[:] = self.contents
        else:
            c.clear()
            c.update(self.contents)


_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def _get_state(generator: Any) -> Any:
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return generator.getstate() if isinstance(generator, random.Random) \
        else generator.get_state()


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        generator.set_state(state)


class _GeneratorState:
    __slots__ = ("generator", "state")

    def __init__(self, generator: Any) -> None:
        self.generator, self.state = generator, _get_state(generator)

    def changed(self) -> bool:
        return not _same(_get_state(self.generator), self.state)

    def restore(self) -> None:
        _set_state(self.generator, self.state)


def _same(a: Any, b: Any) -> bool:
    """Two generator states equal, element by element (tuples of arrays, dicts of ints)."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


# NOTE [generators a profiled step drew from]
#     A ``torch.Generator`` the model reaches by none of its attributes (a global one,
#     ``torch.rand(..., generator=NOISE)``) is drawn from by the step, and by a step the
#     runtime runs again off the profiled path (NOTE [a step off the profiled path]) from
#     where its first try left it: a wrong draw, so a gradient other than plain
#     PyTorch's. The profiled step sees every generator an op draws from (``generator=``,
#     :class:`StateGuard`); they are kept per model (the model weakly: the generators as
#     the op received them, a wrapper of its own over the same generator, which would die
#     with the op) for the runtime to take the state of before each step
#     (``drawn_from``); a later profiled step that drew from none (an analytic one, on
#     fake tensors) leaves them known. A plan applied to a model this process never
#     profiled (read from a file) does not know them.
_DRAWN: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.Generator]] = (
    weakref.WeakKeyDictionary())


def drawn_from(model: torch.nn.Module) -> list[torch.Generator]:
    """The generators the last profiled step of ``model`` drew from."""
    return _DRAWN.get(model, [])


def held_generators(modules: Iterable[torch.nn.Module], passed: Iterable[Any] = (),
                    ) -> list[_GeneratorState]:
    """The state of each generator the modules hold as an attribute, and of each
    ``torch.Generator`` among ``passed`` (the model call's arguments), to put back."""
    return [*(_GeneratorState(v) for m in modules for v in vars(m).values()
              if isinstance(v, _GENERATORS)),
            *(_GeneratorState(v) for v in passed if isinstance(v, torch.Generator))]


class HostRandom:
    """The process-wide random streams outside torch that a model's forward may draw
    from: Python's ``random`` and NumPy's global generator (NOTE [a profiled step leaves
    no trace]). Reading NumPy's costs about 0.1 ms; the runtime takes them under every
    plan (NOTE [the state a second try starts from] in ``runtime/state.py``), and the
    generators modules hold only for steps whose profile drew from any of them."""

    __slots__ = ("python", "numpy")

    def __init__(self) -> None:
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def changed(self) -> bool:
        return random.getstate() != self.python or not _same(np.random.get_state(),
                                                             self.numpy)

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)


# NOTE [autocast's cache of weight casts]
#     Under autocast, the low-precision cast of a weight (a leaf that requires grad) is
#     cached until the outermost autocast region ends: a forward casts each weight once,
#     and every later use in the region reads the cached cast, with no ``_to_copy`` op.
#     ``attach`` profiles inside the training step's own region (its forward hook), so a
#     profiled step left its casts cached, and the training forward right after it ran
#     no cast where the profile had one: its first step of each batch shape under
#     autocast left the profiled path (a plan that recomputes ran it again from the
#     start, as NOTE [a step off the profiled path] runs a LayerDrop skip), and so did the
#     measured step after CUDA's warm-up steps. So a profiled (or warm-up) step that cast
#     one of the model's weights (:class:`StateGuard` sees the ``_to_copy`` of it: the
#     weight was not cached before the step) lets go of autocast's cache after it, and
#     the next forward casts as the profile did. A step that cast none (the model ran
#     already in this region, its casts cached) leaves the cache as it is: the profile
#     and the training forward both read it, as plain PyTorch's forward would. Asked
#     after the step, nothing is cast to find out (a cast of every weight to ask the
#     cache first would hold half the float32 weights' bytes again on the device).
#     Letting go of the cache drops other modules' cached casts too: a module trained
#     twice in the region, around the attached model's first forward of a batch shape,
#     casts its weights again the second time (its gradient then adds two casts' in
#     float32, not one cast's).
_TO_COPY = torch.ops.aten._to_copy.default


# NOTE [a parameter's gradient hooks wait for the training step]
#     The profiled step's backward ran the program's hooks on the parameters' gradients:
#     an optimizer fused into backward (``register_post_accumulate_grad_hook``, one
#     optimizer step per parameter as its gradient is ready, as PyTorch's tutorial on
#     saving memory shows) stepped on the profiled step's gradients, and its state (SGD's
#     momentum, Adam's moments and step count, outside the model) kept that step, so every
#     step after differed from plain PyTorch's; a hook that logs or counts gradients saw
#     one step more; and what the hooks allocated in backward (the optimizer's state) was
#     counted as the step's backward temporaries, in the activation peak the budget is a
#     fraction of. A parameter's hooks act on its gradient only (a leaf's gradient flows
#     nowhere else), and the profiled step's gradients are thrown away: they wait,
#     emptied from their dicts in place (PyTorch's own handles and its C++ side hold
#     those dicts) and refilled in order afterwards, for the training steps. The model's
#     module backward hooks run: they are part of the graph the step records.


def _held_hooks(params: Iterable[torch.Tensor]) -> list[tuple[dict, dict]]:
    """Empty each of ``params``' dicts of gradient hooks (``Tensor.register_hook`` and
    ``register_post_accumulate_grad_hook``) in place; returns each dict with what it held."""
    held = []
    for param in params:
        for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(param, name, None)
            if hooks:
                held.append((hooks, dict(hooks)))
                hooks.clear()
    return held


@contextlib.contextmanager
def leaves_no_trace(model: torch.nn.Module, batch: Iterable[torch.Tensor] = (),
                    ) -> Iterator[StateGuard]:
    """Run a real step of ``model`` on ``batch`` inside, with the yielded
    :class:`StateGuard` active over every op of it: afterwards gradients, tensors written
    in place, module attributes and RNG streams are as they were (NOTE [a profiled step
    leaves no trace])."""
    grads = {p: p.grad for p in model.parameters()}
    for param in grads:
        param.grad = None  # the profiled step accumulates into fresh tensors, not these
    hooks = _held_hooks(grads)  # NOTE [a parameter's gradient hooks wait for the training step]
    buffers = {b: b.clone() for b in model.buffers()}  # what a compiled step writes too
    attributes = _Attributes(model)
    guard = StateGuard(_tensors(model, batch), model.parameters())
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    host_random = HostRandom()
    try:
        yield guard
    finally:
        if guard.cast_weights:  # NOTE [autocast's cache of weight casts]
            torch.clear_autocast_cache()
        written = set(guard.copies)  # the storages the step wrote in place
        guard.restore()
        if guard.drawn:  # (an analytic step, on fake tensors, draws from none)
            _DRAWN[model] = guard.drawn  # NOTE [generators a profiled step drew from]
        guard.host_random = host_random.changed() or attributes.drew()
        guard.attributes = attributes.changed(model, written)
        host_random.restore()
        # a buffer the step replaced (``register_buffer`` again: a dynamic RoPE's
        # ``inv_freq`` past its cached length) is no resize: the registry is put back below
        guard.resized = {name: (list(buffers[b].shape), list(b.shape))
                         for name, b in model.named_buffers()
                         if b in buffers and b.shape != buffers[b].shape}
        with torch.no_grad():
            for buffer, saved in buffers.items():
                if buffer.shape != saved.shape:  # resized in place: a per-channel
                    buffer.resize_(saved.shape)  # observer's min_val, empty until a step
                buffer.copy_(saved)
        attributes.restore()
        for param, grad in grads.items():
            param.grad = grad
        for held, saved in hooks:
            held.update(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
