"""Profile one training step (forward, loss, backward) of any ``nn.Module``."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import linecache
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.func import functional_call
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from slackswap.core.costmodel import step_times
from slackswap.core.hardware import Hardware
from slackswap.core.profile import StepProfile
from slackswap.core.units import resolve_budget
from slackswap.device_budget import is_fit
from slackswap.errors import InputError, ProfileError, SlackSwapError
from slackswap.planners import STRATEGIES
from slackswap.profiling.kernels import TargetKernels
from slackswap.profiling.machine import resolve_hardware
from slackswap.profiling.naming import ActivationNamer, module_events, module_path
from slackswap.profiling.recorder import StepRecorder
from slackswap.profiling.sharding import (
    fsdp_hooks_off,
    local_bytes,
    module_class,
    unsharded,
    unsharded_state,
)
from slackswap.profiling.untouched import StateGuard, leaves_no_trace

__all__ = ["batch_fingerprint", "batch_tensors", "default_device", "eager_module", "fingerprint",
           "model_fingerprint", "model_state", "profile", "refuse_own_checkpointing",
           "refuse_functorch", "refuse_saved_tensor_hooks", "refusing_own_checkpoint_calls",
           "refusing_saved_tensor_hooks", "transformer_blocks", "wrappers", "gathered",
           "leaves_no_trace"]

Batch = Mapping[str, Any] | tuple | list | torch.Tensor


def profile(
    model: torch.nn.Module,
    batch: Batch,
    hardware: str | Hardware | None = None,
    mode: Literal["analytic", "measured", "traced"] = "analytic",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    kernels: Literal["cuda", "native"] | None = None,
    name: str | None = None,
    warmup: int = 1,
) -> StepProfile:
    """Profile one training step of ``model`` on ``batch``.

    ``hardware``: a preset name, a hardware file, ``"auto"`` (the preset of the GPU this
    process sees) or a :class:`Hardware`; None plans for ``a100-80gb`` and says so once
    (a :class:`~slackswap.HardwareNotice` warning).

    ``analytic`` traces under ``FakeTensorMode`` (no weights, no compute) and prices each
    op on ``hardware`` with the roofline cost model; ``kernels`` picks whose kernel
    semantics to trace: the hardware's (``cuda``) or the local CPU's (``native``).
    ``measured`` runs a real step on the model's device and times each op; ``traced``
    runs a real step too (so the ops, and the ids a plan names, are exactly those the
    model runs there, data-dependent branches included) and prices each op on
    ``hardware`` as ``analytic`` does.
    The loss is ``loss_fn(output)`` when ``loss_fn`` is given (even where the model
    returns one: the step trained on it is the one planned), else ``output.loss`` (or
    ``output["loss"]``). ``loss_fn`` takes what the model's forward returns and returns
    the scalar loss backward starts from, e.g. ``lambda out: F.cross_entropy(out, y)``
    with the targets ``y`` closed over (a model returning a one-element tensor needs
    none); ``--loss package.module:function`` on the command line.
    A model sharded with FSDP2's ``fully_shard`` is profiled as its unsharded self: in
    ``measured`` and ``traced`` modes its parameters are gathered whole for the step (a
    collective: every rank must call this), in ``analytic`` mode full-shape fakes stand
    in for them; the fingerprint and model-state bytes are those of the model as held.
    """
    hw = resolve_hardware(hardware)
    if (tensors := batch_tensors(batch)) and all(t.numel() == 0 for _, t in tensors):
        raise InputError("the example batch is empty (its tensors have no elements); "
                         "give a batch of at least one example")
    model = eager_module(model)
    name = name or module_class(model).__name__
    refuse_own_checkpointing(model)
    refuse_saved_tensor_hooks()
    refuse_functorch()
    # what a plan is valid for: the model as it is held (sharded, if it is)
    held_fingerprint, state_bytes = _AS_HELD.get(id(model)) or _as_held(model)
    if mode == "analytic":
        # fake tensors: only Python attributes and host random streams can change
        with leaves_no_trace(model) as guard:
            rec, device = _trace_analytic(model, batch, loss_fn, name, kernels or hw.kernels)
        _price(rec, hw)
        used_kernels = kernels or hw.kernels
    elif mode in ("measured", "traced"):
        # NOTE [FSDP2's hooks are not the step]: a sharded model runs as its unsharded self
        # NOTE [a profiled step leaves no trace]
        with unsharded(model), leaves_no_trace(model, (t for _, t in tensors)) as guard:
            rec, device = _trace_measured(model, _own_leaves(batch), loss_fn, name,
                                          warmup if mode == "measured" else 0, guard)
        used_kernels = "cuda" if device.startswith("cuda") else "native"
        if mode == "traced":
            _price(rec, hw)
    else:
        raise InputError(f"unknown profiling mode '{mode}'; use 'analytic', 'measured' or "
                         "'traced'")
    _name_activations(rec)
    return StepProfile(
        model=name,
        fingerprint=held_fingerprint + batch_fingerprint(t for _, t in batch_tensors(batch)),
        hardware=hw.name,
        mode=mode,
        kernels=used_kernels,
        device=device,
        layers=transformer_blocks(model),
        model_state_bytes=state_bytes,
        ops=rec.ops, tensors=rec.tensors, saves=rec.saves,
        module_events=rec.module_events, model_saves=rec.model_saves,
        host_random=guard.host_random, resized_buffers=guard.resized,
        changed_attributes=guard.attributes,
    )


def _price(rec: StepRecorder, hw: Hardware) -> None:
    """Each recorded op's time on ``hw`` by the cost model, under the hardware's stack."""
    times = step_times(rec.ops, rec.tensors, hw, rec.details)
    for op, seconds in zip(rec.ops, times, strict=True):
        op.time_s = seconds


_AS_HELD: dict[int, tuple[str, int]] = {}  # model -> what _as_held said before gathering


def _as_held(model: torch.nn.Module) -> tuple[str, int]:
    """The model's fingerprint and the model-state bytes this rank holds (its shards)."""
    return model_fingerprint(model), sum(local_bytes(t) for t in model_state(model).values())


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """:func:`~slackswap.profiling.sharding.unsharded`, with profiles made inside it still
    describing the model as it is held: sharded (a ``MixedPrecisionPolicy`` gathers
    parameters in another dtype than it keeps them in)."""
    model = eager_module(model)
    _AS_HELD[id(model)] = _as_held(model)
    try:
        with unsharded(model):
            yield
    finally:
        _AS_HELD.pop(id(model), None)


def wrappers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The wrapper modules around :func:`eager_module` (DDP's), outermost first: their
    calls are not the model's, so they split no segment of its ops."""
    found = []
    while (inner := _unwrapped(model)) is not None:
        found.append(model)
        model = inner
    return found


def eager_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside the wrappers training adds: ``torch.compile`` (a step under the
    runtime's dispatch mode runs eagerly) and (Distributed)DataParallel. Profiles and
    plans name the inner model's modules, whichever of them is passed."""
    while (inner := _unwrapped(model)) is not None:
        model = inner
    return model


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module one wrapper wraps, or None when ``model`` is no wrapper."""
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        return model.module
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


_MARK = "gradient_checkpointing"


def refuse_own_checkpointing(model: torch.nn.Module,
                             modules: list[tuple[str, torch.nn.Module]] | None = None) -> None:
    """A model that checkpoints its own blocks hides their activations from the plan."""
    modules = list(model.named_modules()) if modules is None else modules
    # transformers marks each checkpointed module (is_gradient_checkpointing reads these);
    # read without nn.Module.__getattr__, whose miss raises, once per module per step
    if any(vars(m).get(_MARK, getattr(type(m), _MARK, False)) is True for _, m in modules):
        raise InputError(
            "the model has gradient checkpointing on, which recomputes activations its own "
            "way; turn it off (in transformers: model.gradient_checkpointing_disable()) and "
            "let the plan decide what to recompute"
        )


_OWN_CHECKPOINT = (
    "the model calls torch.utils.checkpoint itself, which recomputes activations its own "
    "way; remove those calls (or turn gradient checkpointing off) and let the plan decide "
    "what to recompute"
)


@contextlib.contextmanager
def refusing_own_checkpoint_calls() -> Iterator[None]:
    """Inside, a call to ``torch.utils.checkpoint`` (reentrant or not, directly or through
    a wrapper) raises :class:`InputError`: its own saved-tensor hooks would hide the
    activations of the checkpointed region from the plan."""
    import torch.utils.checkpoint as tuc

    # NOTE: both checkpoint implementations look this helper up in their module when
    # they start; no public hook announces a checkpointed region.
    original = tuc._infer_device_type

    def refuse(*args: Any) -> str:
        raise InputError(_OWN_CHECKPOINT)

    tuc._infer_device_type = refuse
    try:
        yield
    finally:
        tuc._infer_device_type = original


# NOTE [saved-tensor hooks of the program's own]
#     Only the innermost ``saved_tensors_hooks`` pair packs a saved tensor. A model that
#     enters its own in forward (``torch.autograd.graph.save_on_cpu`` around a block,
#     torchtune's activation offloading, tensor parallelism's input resharding) hides
#     that region's saves from the profile's pair and from the runtime's alike: the
#     profile still sees the region's ops, and backward reading their outputs, so it
#     listed those outputs as activations autograd did not save, held to backward, and a
#     plan could offload them as checkpoints, copies that free nothing while the
#     program's hooks hold the originals (a 4-block MLP with one block under
#     ``save_on_cpu``, at a budget of half its peak: 140% of the budget measured on a
#     CPU, the simulation under it). On CUDA (read from the recorder, not measured: it
#     keeps no device per tensor) the host copies ``save_on_cpu`` makes would count as
#     device memory. Gradients stayed exact; the budget did not hold. So a pair pushed
#     while the step's forward runs (on its thread, outside any backward) is refused as
#     it is entered, in the profiled step and under a plan, with what to do; and a pair
#     already active when a step begins, around it, which the step's own pair would
#     silently replace for its forward, is refused before the step starts. (Caught
#     below ``saved_tensors_hooks``, where a pair is pushed, so a subclass with its own
#     ``__enter__`` is seen too.)
_HOOKS_INSIDE = (
    "the model enters saved-tensor hooks of its own in forward (a saved_tensors_hooks pair "
    "such as torch.autograd.graph.save_on_cpu, at {where}), which hide what they save from "
    "the plan; remove them and let the plan decide what to offload"
)
_HOOKS_AROUND = (
    "saved-tensor hooks of your own (torch.autograd.graph.save_on_cpu, or another "
    "saved_tensors_hooks) are active around the step, and the plan's would replace them "
    "in its forward; run the step outside them and let the plan decide what to offload"
)


# NOTE [a step inside a torch.func transform]
#     ``torch.func.grad`` (and ``vjp``, ``jacrev``, ``vmap``, ``jvp``) runs the model on
#     tensors wrapped for its transform, and its ``grad`` refuses saved-tensor hooks: a step
#     under one raised PyTorch's own multi-line error from inside the runtime (``attach``
#     copying the batch to profile it, ``apply`` entering its pair of hooks), where the
#     user needs one line saying what to do. A step begun inside any functorch transform
#     is refused before anything runs: the plan's hooks and the profiled step cannot run
#     on its wrapped tensors.
_FUNCTORCH = (
    "the step runs inside a torch.func transform ({kind}: torch.func.grad, vjp, jacrev, "
    "vmap or jvp), whose wrapped tensors saved-tensor hooks cannot move; call the model "
    "outside it (loss.backward() or torch.autograd.grad), or train it without SlackSwap"
)


def refuse_functorch(prefix: str = "") -> None:
    """Refuse a step begun inside a ``torch.func`` transform (NOTE [a step inside a
    torch.func transform]); ``prefix`` begins the message."""
    top = torch._C._functorch.peek_interpreter_stack()
    if top is not None:
        raise InputError(prefix + _FUNCTORCH.format(kind=top.key().name.lower()))


def refuse_saved_tensor_hooks() -> None:
    """Refuse a step begun inside a ``saved_tensors_hooks`` pair (NOTE [saved-tensor hooks
    of the program's own])."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None and top(True) is not None:
        raise InputError(_HOOKS_AROUND)


class refusing_saved_tensor_hooks:  # noqa: N801 - a context manager, named as one
    """Inside, a ``saved_tensors_hooks`` pair entered on this thread outside backward
    raises :class:`InputError`, unless its pack hook is one of ``own`` (functions, or the
    functions of bound methods): NOTE [saved-tensor hooks of the program's own]. A class,
    not a generator: a block enters it every step."""

    __slots__ = ("own", "thread", "original")

    def __init__(self, *own: Callable[..., Any]) -> None:
        self.own = own

    def __enter__(self) -> None:
        self.thread = threading.get_ident()
        self.original = torch._C._autograd._push_saved_tensors_default_hooks
        torch._C._autograd._push_saved_tensors_default_hooks = self._push

    def __exit__(self, *exc: Any) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks = self.original

    def _push(self, pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
        if (getattr(pack, "__func__", pack) not in self.own
                and threading.get_ident() == self.thread
                and torch._C._current_graph_task_id() == -1):
            raise InputError(_HOOKS_INSIDE.format(where=_program_line()))
        self.original(pack, unpack)


# The models a SlackSwap attachment holds, eager (runtime.attach) or compiled
# (compiled.attach): one attachment a model, whichever kind.
ATTACHED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def check_attach(model: torch.nn.Module, budget: str | int | float, strategy: str) -> None:
    """Refuse, when ``attach`` is called rather than at the first training forward, a
    model attached already, a budget or a strategy that cannot be planned with."""
    if model in ATTACHED:
        raise InputError("slackswap.attach: this model is attached already; call .detach() "
                         "on the first attachment before attaching again")
    if not is_fit(budget):
        resolve_budget(budget, 1)
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy '{strategy}'; strategies: {', '.join(STRATEGIES)}")


def fingerprint(model: torch.nn.Module, batch: Batch) -> str:
    """What a plan is valid for: :func:`model_fingerprint` then :func:`batch_fingerprint`."""
    return model_fingerprint(model) + batch_fingerprint(t for _, t in batch_tensors(batch))


def model_fingerprint(model: torch.nn.Module,
                      modules: list[tuple[str, torch.nn.Module]] | None = None,
                      state: dict[str, torch.Tensor] | None = None,
                      shapes: dict[str, list[int]] | None = None) -> str:
    """32 hex digits: the module tree, parameter and buffer shapes and dtypes, train mode.
    ``modules`` and ``state``: ``model.named_modules()`` and :func:`model_state`, when the
    caller has them already; ``shapes``: the shapes to take for these tensors, by name."""
    model = eager_module(model)
    modules = list(model.named_modules()) if modules is None else modules
    state = model_state(model, modules) if state is None else state
    tensors = tuple((n, t.shape, t.dtype, t.requires_grad) for n, t in state.items())
    if shapes:
        tensors = tuple((n, torch.Size(shapes.get(n, shape)), *rest)
                        for n, shape, *rest in tensors)
    key = (tuple((n, module_class(m)) for n, m in modules), tensors, model.training)
    # the runtime checks the model every step: hash what it is only when it changed
    digest = _FINGERPRINTS.get(key)
    if digest is None:
        parts = {
            "modules": [(n, m.__name__) for n, m in key[0]],
            "state": [(n, list(shape), str(dtype), grad) for n, shape, dtype, grad in key[1]],
            "training": key[2],
        }
        digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
        if len(_FINGERPRINTS) >= 16:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = digest
    return digest


_FINGERPRINTS: dict[tuple, str] = {}


def batch_fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """32 hex digits: the shapes and dtypes of the batch's tensors, whatever their names,
    so a step called with keywords matches one profiled with the same tensors by position."""
    shapes = sorted((list(t.shape), str(t.dtype)) for t in tensors)
    return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:32]


def transformer_blocks(model: torch.nn.Module) -> list[str]:
    """Module paths of the repeated blocks: the longest ``ModuleList`` of one class."""
    best: list[str] = []
    for path, module in model.named_modules():
        longer = isinstance(module, torch.nn.ModuleList) and len(module) > len(best)
        if longer and len({type(child) for child in module}) == 1:
            best = [f"{path}.{i}" if path else str(i) for i in range(len(module))]
    return best


# -- tracing ---------------------------------------------------------------------------


def model_state(model: torch.nn.Module,
           modules: list[tuple[str, torch.nn.Module]] | None = None) -> dict[str, torch.Tensor]:
    """Parameters then buffers by name, each tensor once, as ``named_parameters()`` and
    ``named_buffers()`` list them; one walk over ``modules`` when given."""
    if modules is None:
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state: dict[str, torch.Tensor] = {}
    for members in ("_parameters", "_buffers"):
        seen: set[int] = set()
        for prefix, module in modules:
            for name, t in getattr(module, members).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                state[f"{prefix}.{name}" if prefix else name] = t
    return state


def batch_tensors(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [("input", batch)]
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch)
    return [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]


def _call(model: torch.nn.Module, batch: Batch, name: str) -> Any:
    try:
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (tuple, list)):
            return model(*batch)
        return model(batch)
    except SlackSwapError:
        raise
    except Exception as e:
        if _raised_in_mod_tracker(e):
            raise ProfileError(
                f"cannot profile model '{name}': PyTorch's ModTracker, which follows its "
                f"modules into backward, failed in its forward ({type(e).__name__}: {e}); "
                "the model is not supported (Hugging Face Reformer's reversible layers, "
                "which rebuild their own activations in backward, fail so)"
            ) from e
        if isinstance(e, _VALUE_READS):
            raise ProfileError(
                f"model '{name}' reads a tensor's value in forward ({_model_line(e)}), which "
                "an analytic profile cannot know: it traces fake tensors, which hold no "
                "data; profile the real model with mode='traced' (--mode traced), which "
                "runs one step and prices its ops as analytic does"
            ) from e
        raise ProfileError(f"model '{name}' raised in forward: {type(e).__name__}: {e}") from e


# NOTE [a model that reads a value]: ``.item()``, ``bool(t)`` or ``if t < x:`` on a tensor
# (OPT's LayerDrop under transformers 5.17 compares ``torch.rand([])`` with its rate
# whatever the rate), or an op whose output shape depends on values (``nonzero``), has
# no answer under FakeTensorMode; a traced profile runs the step, so it has one.
_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException,
                GuardOnDataDependentSymNode)


_INSIDE = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
           contextlib.__file__)  # torch, this package, and context managers' plumbing


def _model_line(e: BaseException) -> str:
    """Where the model's own code was when ``e`` was raised: the innermost frame outside
    torch and this package, as ``file:line: source``."""
    where = "its code"
    tb = e.__traceback__
    while tb is not None:
        file, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        if not file.startswith(_INSIDE):
            where = _line(file, line)
        tb = tb.tb_next
    return where


def _program_line() -> str:
    """Where the program's own code is now: the innermost frame on the stack outside
    torch and this package, as ``file:line: source``."""
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_INSIDE):
            return _line(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return "its code"


def _line(file: str, line: int) -> str:
    source = linecache.getline(file, line).strip()
    return f"{os.path.basename(file)}:{line}" + (f": {source}" if source else "")


def _raised_in_mod_tracker(e: BaseException) -> bool:
    """The exception came out of ``ModTracker``'s hooks, not the model's own code."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("mod_tracker.py"):
            return True
        tb = tb.tb_next
    return False


def _described(output: Any) -> str:
    """What a model returned, in a few words, for the error that says it has no loss."""
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, Mapping):
        keys = ", ".join(repr(k) for k in list(output)[:5])
        return f"a mapping with keys {keys}" if keys else "an empty mapping"
    return f"a {type(output).__name__}"


def own_loss(output: Any) -> Any:
    """The loss a model returns itself: ``output.loss`` or ``output["loss"]``, else None."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss


def _loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None, name: str) -> torch.Tensor:
    # a loss_fn given is the loss trained on, even where the model returns one of its own
    # (DAC returns a per-sample commitment loss beside the audio a loss is taken on): the
    # profiled backward is the one the plan is applied to
    loss = loss_fn(output) if loss_fn is not None else own_loss(output)
    if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        loss = output  # the model returns its loss
    if loss is None:
        raise ProfileError(
            f"model '{name}' returned no loss (its output is {_described(output)}); give a "
            "loss: loss_fn=f in Python or --loss package.module:f on the command line, "
            "where f(output) returns a scalar tensor, or pass labels in the batch if the "
            "model computes its own loss"
        )
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.numel() != 1:
        raise ProfileError(
            f"model '{name}': the loss is not a differentiable scalar; check that the model "
            "is in training mode with parameters that require grad"
        )
    return loss


def _run_step(
    call: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor] | None, name: str,
    recorder: StepRecorder, tracker: ModTracker, extra: contextlib.AbstractContextManager,
    params: Iterable[torch.Tensor] = (),
) -> None:
    # The runtime runs a step with Python's cyclic collector paused from the model's call
    # to the end of backward (NOTE [no cyclic GC until backward] in runtime/saved.py), so
    # what a reference cycle holds goes only after backward: the profiled step runs so
    # too, and a tensor's release never depends on when the collector happened to run
    # (it made a profile depend on what the process had run before).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with (_same_name_warning_off(), _tracker_grad_hooks_removed(), tracker, recorder, extra,
              refusing_own_checkpoint_calls(), refusing_saved_tensor_hooks(StepRecorder.pack),
              module_events(recorder.module_event)):
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
                output = call()
                if recorder.model_saves is None:  # (no forward counted them: NOTE [the saves
                    recorder.model_saves = len(recorder.saves)  # by the model's return])
                loss = _loss(output, loss_fn, name)
                del output
            recorder.end_forward()
            with _weight_gradients(recorder, params):
                loss.backward()
        recorder.finish()
    finally:
        if collecting:
            gc.enable()


# NOTE [the saves by the model's return]
#     The runtime checks, as the model's forward returns, that the step saved as many
#     tensors as the profiled step had by then (``StepProfile.model_saves``, NOTE [a step
#     off the profiled path]): it calls the forward through its guard, so it counts before
#     the model's forward hooks run. The profile counted when the model's call returned,
#     after them: a forward hook of the user's on the model that computes (one that
#     changes its output) saved tensors in between, and every step of the attached model
#     was taken as off the path and ran its forward again. So the profiled step counts
#     where the runtime does, as the forward returns (``saves_at_return``).


@contextlib.contextmanager
def saves_at_return(model: torch.nn.Module, recorder: StepRecorder) -> Iterator[None]:
    """Inside, ``recorder.model_saves`` is set as ``model``'s forward returns, before its
    forward hooks run (NOTE [the saves by the model's return])."""
    had, own = "forward" in model.__dict__, model.__dict__.get("forward")
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        output = inner(*args, **kwargs)
        recorder.model_saves = len(recorder.saves)
        return output

    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if had:
            model.__dict__["forward"] = own
        else:
            del model.__dict__["forward"]


@contextlib.contextmanager
def _tracker_grad_hooks_removed() -> Iterator[None]:
    """Remove, once the profiled step is done (or has raised), the gradient hooks that
    ``ModTracker`` registers in this thread on every module's inputs and outputs.

    NOTE [ModTracker's gradient hooks hold the graph]
        ``ModTracker`` follows backward through ``register_multi_grad_hook``, whose hook
        closes over the ``grad_fn`` of each tensor it is registered on, and lives in that
        node's hooks: a cycle through autograd's C++ nodes that no collector frees, and
        ``ModTracker`` keeps no handle. Left there, the profiled step's graph outlived it,
        and with its ``AccumulateGrad`` nodes every parameter that trained before the
        last module's input: a model dropped after ``slackswap.plan(model, batch)`` or
        ``attach`` stayed in memory (a ResNet-18's parameters but the last layer's; on a
        GPU, device memory). The hooks are removed through the handles
        ``register_multi_grad_hook`` returns, which unlinks the closures from the nodes."""
    register = mod_tracker.register_multi_grad_hook
    thread = threading.get_ident()
    handles: list[Any] = []

    def registering(*args: Any, **kwargs: Any) -> Any:
        handle = register(*args, **kwargs)
        if threading.get_ident() == thread:
            handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = registering
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _same_name_warning_off() -> Iterator[None]:
    """``ModTracker`` without its warning that "the module hierarchy tracking maybe be
    messed up", and with the warnings format it sets for the whole process put back.

    NOTE [modules the model does not register]
        ``ModTracker`` names a module the model calls but does not register by its
        class, and warns when a module enters while one of the same name is active. Two
        such modules nested (Llama's rotary embedding under transformers 5.25, whose
        ``kernels`` dependency makes functions into modules) collide so; it counts them,
        so the tracking stays right, and :func:`module_path` places ops only in the
        model's own modules, as the runtime does. The warning is noise to a user, and
        raising it replaces ``warnings.formatwarning`` for the rest of the process."""
    formatwarning = warnings.formatwarning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe")
            yield
    finally:
        warnings.formatwarning = formatwarning


@contextlib.contextmanager
def _weight_gradients(recorder: StepRecorder, params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Mark the gradients backward makes for ``params`` (each as it arrives, and what
    ends up in ``.grad``) as weight gradients: model state, not activation memory."""
    params = [p for p in params if p.requires_grad and p.is_leaf]
    handles = [p.register_hook(functools.partial(_arrived, recorder, p)) for p in params]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    for p in params:
        if p.grad is not None:
            recorder.mark_gradient(p.grad, p)


def _arrived(recorder: StepRecorder, param: torch.Tensor, grad: torch.Tensor) -> None:
    recorder.mark_gradient(grad, param)


def _register_state(
    recorder: StepRecorder, model: torch.nn.Module, state: dict[str, torch.Tensor],
    batch_items: list[tuple[str, torch.Tensor]],
) -> None:
    params = dict(model.named_parameters())
    for path, t in state.items():
        if t.layout == torch.strided:
            recorder.register(t, "parameter" if path in params else "buffer", path)
    for key, t in batch_items:
        if t.layout == torch.strided:
            recorder.register(t, "input", f"input:{key}")


def _has_padding(batch: Batch) -> bool:
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or isinstance(mask, FakeTensor):
        return mask is not None
    return not bool(mask.bool().all())


def _is_causal_lm(model: torch.nn.Module) -> bool:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return module_class(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _trace_analytic(
    model: torch.nn.Module, batch: Batch, loss_fn, name: str, kernels: str,
) -> tuple[StepRecorder, str]:
    state = model_state(model)
    fakes = [t for t in state.values() if isinstance(t, FakeTensor)]
    fake_mode = fakes[0].fake_mode if fakes else FakeTensorMode()
    if not fakes:  # a real model: trace it with fake copies of its weights
        def whole(shape: tuple, dtype: torch.dtype, device: torch.device,
                  grad: bool) -> torch.Tensor:
            with fake_mode:
                return torch.empty(shape, dtype=dtype, device=device, requires_grad=grad)

        # a model sharded with FSDP2 is traced as its unsharded self
        state = {k: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t)
                 for k, t in unsharded_state(state, whole).items()}
    elif len(fakes) != len(state):
        raise ProfileError(f"model '{name}' mixes fake and real parameters; build it one way")
    fake_batch = _map_batch(
        batch, lambda t: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t)
    )
    tracker = ModTracker()
    recorder = StepRecorder(module_path(tracker, type(model).__name__))
    _register_state(recorder, model, state, batch_tensors(fake_batch))
    causal = _is_causal_lm(model) and not _has_padding(batch)
    extra = TargetKernels(kernels, dense_masks_are_causal=causal)

    def call() -> Any:
        if fakes:
            return _call(model, fake_batch, name)
        return _call(_Functional(model, state), fake_batch, name)

    # a loss_fn may close over real tensors (the targets): they join the trace as fakes
    allowed, fake_mode.allow_non_fake_inputs = fake_mode.allow_non_fake_inputs, True
    try:
        with fake_mode, fsdp_hooks_off(model), saves_at_return(model, recorder):
            _run_step(call, loss_fn, name, recorder, tracker, extra, state.values())
    finally:
        fake_mode.allow_non_fake_inputs = allowed
    return recorder, str(next(iter(state.values())).device) if state else "cpu"


class _Functional:
    """Calls ``model`` with ``state`` swapped in for its parameters and buffers."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.model, self.state, args, kwargs, tie_weights=True)


def _map_batch(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return type(batch)(fn(v) if isinstance(v, torch.Tensor) else v for v in batch)


def _own_leaves(batch: Batch) -> Batch:
    """The batch with each tensor that requires grad replaced by a new leaf over the same
    storage: the profiled step's gradients and ``ModTracker``'s gradient hooks land on
    those, not on the caller's tensors (a hook left on a leaf breaks a later
    ``torch.autograd.grad`` through it)."""
    def own(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v.detach().requires_grad_()
        return v

    if isinstance(batch, Mapping):
        return {k: own(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):  # called as model(*batch): a tuple serves
        return tuple(own(v) for v in batch)
    return own(batch)


def _trace_measured(
    model: torch.nn.Module, batch: Batch, loss_fn, name: str, warmup: int,
    guard: StateGuard,
) -> tuple[StepRecorder, str]:
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    for _ in range(warmup):
        with guard:
            _loss(_call(model, batch, name), loss_fn, name).backward()
        if guard.cast_weights:  # NOTE [autocast's cache of weight casts]
            torch.clear_autocast_cache()
    model.zero_grad(set_to_none=True)
    clock = _CudaClock() if device.type == "cuda" else _wall_clock
    tracker = ModTracker()
    recorder = StepRecorder(module_path(tracker, type(model).__name__), clock)
    recorder.lifetimes = True  # NOTE [held until let go]
    _register_state(recorder, model, model_state(model), batch_tensors(batch))
    # the guard is entered after the recorder, so it sees each op first: its copies are
    # not in the op's measured time
    with saves_at_return(model, recorder):
        _run_step(lambda: _call(model, batch, name), loss_fn, name, recorder, tracker,
                  guard, params)
    model.zero_grad(set_to_none=True)
    if isinstance(clock, _CudaClock):
        for op, seconds in zip(recorder.ops, clock.durations(), strict=True):
            op.time_s = seconds
    return recorder, str(device)


def _wall_clock(run: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = run()
    return out, time.perf_counter() - start


class _CudaClock:
    """Times each op with a pair of CUDA events; read after one synchronize."""

    def __init__(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, run: Callable[[], Any]) -> tuple[Any, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run()
        end.record()
        self.events.append((start, end))
        return out, 0.0

    def durations(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in self.events]


def _name_activations(rec: StepRecorder) -> None:
    """Stable readable ids for forward activations: ``<module>:<op kind>:<k>``, the k-th
    tensor that module made with that op, in production order.

    Saved batch inputs are ``input:<key>``; other saved tensors from outside the step
    ``external:<k>``. Plans name saved activations (and unsaved ones to keep as
    checkpoints) by these ids.
    """
    namer = ActivationNamer()
    for t in rec.tensors:  # ids follow production order
        if t.kind != "activation" or t.producer is None:
            continue
        op = rec.ops[t.producer]
        if op.phase == "forward":
            t.name = namer(op.module, op.kind)
    external = 0
    for t in rec.tensors:
        if t.saved and t.name is None and not t.is_parameter:
            t.name = f"external:{external}"
            external += 1


def default_device() -> str:
    """Where a measured profile runs: CUDA when present, else CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"
