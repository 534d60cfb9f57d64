"""``slackswap.attach``: plan each new batch shape once and apply the plan to every
training forward of a model, with no change to the training loop.

NOTE [a block opened inside the model's call]
    ``attach`` opens a ``slackswap.apply`` block in the model's forward pre-hook and
    closes it in a forward hook. PyTorch reads a module's forward pre-hooks (its own and
    the global ones) when its call starts, so the pre-hooks the block registers as it
    opens would miss this call: the block's check of the batch, and the module event that
    begins the first segment of ops (the profiler counted it: its hooks were in place
    before it called the model). ``_open`` runs exactly those hooks, in the order PyTorch
    would have (global ones first). The forward hook that closes the block is registered
    after the block's own, so it is the model's last: when forward raises, PyTorch calls
    the always-called forward hooks while iterating the model's dict of them, and only
    the last one may remove entries from it. A forward stopped by a BaseException
    (Ctrl-C) runs no forward hook: its block stays open, and the block's pre-hook on
    the model, read at the next call's start, would run after attach's, on a closed
    block. So that call closes the block and is refused before it runs.

NOTE [a copied model]
    ``copy.deepcopy`` of an attached model (an EMA's ``AveragedModel``, a teacher or a
    best-model snapshot) copies its dicts of hooks, and with them the ``Attached`` the
    hooks are bound to: the copy was attached with no handle to detach it (the original's
    ``detach()`` left it attached), and ``slackswap.attach(copy)`` was accepted and then
    refused at the first forward, which opened two blocks, as saved-tensor hooks of the
    program's own. The copy is not attached: ``Attached.__reduce__`` gives a ``_Copied``,
    to which ``copy`` binds the copied hooks (``Attached._before`` and ``_after``): they
    remove themselves (and the copy's forward guard) at the copy's first call, and
    ``attach`` removes them before attaching the copy. A model pickled whole
    (``torch.save(model)``) is such a copy too: the ``Attached`` pickles as a ``_Copied``
    (its plans and profiles stay out of the file), the hooks as that copy's methods, and
    the forward guard as the model's own forward (NOTE [a guard pickled by name] in
    ``runtime/block.py``); before, the file held the plans and would not load
    (``'Module' object has no attribute '_guarded'``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils import _pytree

from slackswap.core.hardware import Hardware
from slackswap.core.plan import Plan
from slackswap.errors import InputError, SlackSwapError
from slackswap.profiling.machine import resolve_hardware
from slackswap.profiling.step import (
    ATTACHED,
    check_attach,
    eager_module,
    own_loss,
    refuse_functorch,
)
from slackswap.runtime.block import apply, guard_forward, unguard, walk_model
from slackswap.runtime.oneshot import autocast_state, plan_model
from slackswap.runtime.stats import RuntimeStats

__all__ = ["Attached", "attach"]

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


def attach(model: torch.nn.Module, budget: str | int | float = 0.5,
           hardware: str | Hardware | None = None, strategy: str = "slackswap",
           loss_fn: Callable[[Any], torch.Tensor] | None = None, group: Any = None,
           ) -> Attached:
    """Apply a plan to every forward of ``model`` that records a graph for backward: with
    grad enabled, in training mode, or in eval mode with a parameter or input that
    requires grad (training with dropout off); other forwards (``no_grad``,
    ``inference_mode``, a frozen model in eval mode) run as they would without it.

    The first forward with a new batch shape (tensor shapes and dtypes, other arguments,
    autocast state) profiles one step of the model on that batch and plans it, as
    ``slackswap.plan(model, batch, budget, hardware, strategy)`` does (``budget="fit"``:
    what the device's memory leaves once the model states are out); every forward with
    that shape then runs under ``slackswap.apply(model, plan)``. Gradients are
    bit-identical to training without it. A model or batch that cannot be planned
    exactly is refused with the one-line ``SlackSwapError`` that profiling or ``apply``
    raises; it never runs without its plan. ``loss_fn`` is the loss to profile with
    when the model's output carries none (default: the sum of its floating-point
    tensors; a loss computed outside the model runs outside the block either way).
    Attach a ``torch.compile``'d model as compiled (its forward then runs eagerly); one
    called from compiled code is refused. ``.detach()`` (or leaving ``with
    slackswap.attach(...):``) undoes it.

    ``group``: a ``torch.distributed`` process group whose ranks train ``model``
    together (``torch.distributed.group.WORLD`` for all); each batch shape is then
    planned once, by the group's first rank, and every rank runs that plan, as
    ``slackswap.plan(..., group=)`` does: on GPUs each rank measures its own profile,
    which may differ from another's, and ranks that ran different plans under FSDP2
    could rebuild at different points (a rebuild may gather parameters, a collective).
    Every rank must then make its first call with each new batch shape together.
    """
    check_attach(model, budget, strategy)
    # once, here: None (said) or "auto" names one hardware for every batch shape
    return Attached(model, budget, resolve_hardware(hardware), strategy, loss_fn, group)


# NOTE [the model's call as it was made]
#     Attach's pre-hook plans a new batch shape by calling the model on the call's
#     arguments, and opens the block. Registered after the user's own pre-hooks on the
#     model, it saw the arguments as they had changed them, and the profiled call ran
#     them again: an input changed twice (a hook that concatenates, or reshapes, was
#     refused as a forward that raised; one that scales profiled other values), and the
#     block opened after their ops. It runs first of the model's pre-hooks: it plans the
#     call as it was made, keyed by its shapes, and the user's pre-hooks run inside the
#     block, as they ran inside the profiled call. Global pre-hooks
#     (``register_module_forward_pre_hook``) still run before it.


class Attached:
    """What :func:`attach` returns: the plans made so far, by batch shape (``plans``),
    what the last planned step did (``stats``), and :meth:`detach`."""

    def __init__(self, model: torch.nn.Module, budget: str | int | float,
                 hardware: str | Hardware | None, strategy: str,
                 loss_fn: Callable[[Any], torch.Tensor] | None, group: Any = None) -> None:
        self.model, self.group = model, group
        self.budget, self.hardware, self.strategy = budget, hardware, strategy
        # the loop trains on the model's own loss where it returns one (as Trainer and
        # Lightning do): profiled first, loss_fn only where the output carries none
        fallback = loss_fn if loss_fn is not None else _output_sum
        self.loss_fn = functools.partial(_own_loss_or, fallback=fallback)
        self.plans: dict[tuple, Plan] = {}
        self.stats: RuntimeStats | None = None  # what the last planned step did
        self._block: apply | None = None  # open between the model's pre-hook and hook
        self._closer: Any = None
        self._planning = False
        _drop_copied_hooks(model)  # a copy of a model attached before (NOTE [a copied model])
        # NOTE [the model's call as it was made]: first of the model's own pre-hooks
        self._pre = model.register_forward_pre_hook(self._before, with_kwargs=True,
                                                    prepend=True)
        # the block opens inside the model's call, after its forward was looked up: the
        # guard goes on now (NOTE [a step off the profiled path])
        guard_forward(eager_module(model), None)
        ATTACHED.add(model)

    def detach(self) -> None:
        """Remove the hooks; the model trains as it would without SlackSwap."""
        if self._pre is not None:
            self._pre.remove()
            self._pre = None
            unguard(eager_module(self.model))
        self._close()
        ATTACHED.discard(self.model)

    def __enter__(self) -> Attached:
        return self

    def __reduce__(self) -> tuple[type, tuple]:
        # NOTE [a copied model]: a model deep-copied (``copy`` reduces it so too) or
        # pickled whole holds a copy's hooks, not attached
        return _Copied, ()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # -- the hooks -----------------------------------------------------------------------
    @torch.compiler.disable  # run as they are, even when compiled code calls the model
    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if isinstance(self, _Copied):  # bound so by a deep copy (NOTE [a copied model])
            self.drop(module)
            return
        if self._block is not None and not self._planning:
            # NOTE [a block opened inside the model's call]: the last forward was stopped
            self._close()
            raise InputError("slackswap.attach: the model was called before its last "
                             "training forward ended (stopped by Ctrl-C, or a call inside "
                             "its own forward); that forward's block is closed now: call "
                             "the model again")
        if self._planning or not _records_graph(module, args, kwargs):
            return
        if _in_compiled_code():
            raise InputError("slackswap.attach: the model is called from code torch.compile "
                             "runs, whose ops a plan cannot reach; attach the compiled module "
                             "(slackswap.attach(torch.compile(model))), or train without "
                             "torch.compile")
        # NOTE [a step inside a torch.func transform]: before the batch is copied to plan
        refuse_functorch("slackswap.attach: ")
        # NOTE [the model checked in one walk]: the plan's key and the block's checks
        # read one walk of the model
        eager = eager_module(module)
        walked = walk_model(eager)
        key = self._key(walked[1].digest, args, kwargs, module)
        plan = self.plans.get(key)
        block = apply(module, plan) if plan is not None else None
        if block is None:  # (the profiled step may resize buffers: the block walks again)
            plan = self.plans[key] = self._plan(module, args, kwargs)
            block = apply(module, plan)
        else:  # (``block.model`` is ``eager``: the model the block checks)
            block.use_walk(walked)
        self._open(block, module, args, kwargs)

    def _open(self, block: apply, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Open ``block`` inside the model's call (NOTE [a block opened inside the
        model's call])."""
        global_hooks, own_hooks = nn_module._global_forward_pre_hooks, module._forward_pre_hooks
        had_global, had_own = set(global_hooks), set(own_hooks)
        block.__enter__()
        try:
            # the block's hooks return nothing: they check and count, they change no input
            for key, hook in list(global_hooks.items()):
                if key not in had_global:
                    hook(module, args)
            for key, hook in list(own_hooks.items()):
                if key not in had_own:
                    if key in module._forward_pre_hooks_with_kwargs:
                        hook(module, args, kwargs)
                    else:
                        hook(module, args)
            self._closer = module.register_forward_hook(self._after, always_call=True)
        except BaseException:
            block.__exit__(None, None, None)
            raise
        self._block, self.stats = block, block.stats  # (backward adds to these stats)

    @torch.compiler.disable
    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if isinstance(self, _Copied):  # (copied in the model's forward)
            self.drop(module)
            return
        self._close()

    def _close(self) -> None:
        block, closer, self._block, self._closer = self._block, self._closer, None, None
        if closer is not None:
            closer.remove()
        if block is not None:
            block.__exit__(None, None, None)

    # -- plans by batch shape ------------------------------------------------------------
    def _key(self, digest: str, args: tuple, kwargs: dict, module: torch.nn.Module) -> tuple:
        """What a plan is made for: the model (``digest``: its fingerprint), every
        tensor's shape and dtype (inside containers too), the other arguments, and the
        autocast state."""
        def leaf(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype, x.device, x.requires_grad)
            return x if isinstance(x, _SCALARS) else type(x).__qualname__

        leaves, spec = _pytree.tree_flatten((args, kwargs))
        return (digest, str(spec), tuple(map(leaf, leaves)), autocast_state(module),
                _config_flags(module))

    def _plan(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Plan:
        # the profiled step runs on copies: a model that changes its inputs in place
        # changes only the copies, and the training step sees the batch as it was given
        batch = _pytree.tree_map_only(torch.Tensor, _copy, _as_batch(module, args, kwargs))
        self._planning = True  # the profiled step calls the model: its forwards pass by
        try:
            # the loss runs after the block, which covers the model's call: what only it
            # saves stays as autograd saved it
            return plan_model(module, batch, self.budget, self.hardware, self.strategy,
                              self.loss_fn, group=self.group, loss_outside=True)
        except SlackSwapError as e:  # which batch could not be planned
            shapes = [list(t.shape) for t in _pytree.tree_leaves(batch)
                      if isinstance(t, torch.Tensor)]
            raise type(e)(f"slackswap.attach, planning a batch of shapes {shapes}: {e}") from e
        finally:
            self._planning = False


class _Copied:
    """What a deep copy of an attached model holds in place of the :class:`Attached` its
    hooks are bound to (NOTE [a copied model]): those hooks remove themselves, and the
    copy's forward guard, at the copy's first call."""

    def drop(self, module: torch.nn.Module) -> None:
        _drop_copied_hooks(module)
        if module not in ATTACHED:  # (attached since: the guard is its attachment's)
            unguard(eager_module(module))

    # a pickled hook is found again by its name on what it is bound to
    _before = Attached._before
    _after = Attached._after


def _drop_copied_hooks(module: torch.nn.Module) -> None:
    """Remove from ``module`` the hooks a deep copy bound to a :class:`_Copied`."""
    for hooks, extra in ((module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
                         (module._forward_hooks, module._forward_hooks_always_called)):
        for key in [k for k, hook in hooks.items()
                    if isinstance(getattr(hook, "__self__", None), _Copied)]:
            del hooks[key]
            extra.pop(key, None)


def _config_flags(module: torch.nn.Module) -> tuple:
    """The scalar settings of a ``transformers`` model's config (its ``config``
    attribute), which its forward reads: ``output_attentions`` set after planning made
    the model return, and so hold, attention maps the plan offloads (the step went 10%
    over its budget, its saves and their sizes as profiled); a plan per setting. About
    8 us a step on a CPU."""
    config = vars(eager_module(module)).get("config")
    if config is None or not hasattr(config, "__dict__"):
        return ()
    return tuple((k, v) for k, v in vars(config).items() if type(v) in _SCALARS)


def _records_graph(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this call of the model records a graph for backward: grad enabled, and the
    model in training mode or, in eval mode, with a parameter or input that requires grad
    (a model trained in eval mode, to keep dropout off, runs training steps all the same:
    passed by, they would hold every activation unplanned)."""
    if not torch.is_grad_enabled():
        return False
    if module.training:
        return True
    return (any(p.requires_grad for p in module.parameters())
            or any(isinstance(t, torch.Tensor) and t.requires_grad
                   for t in _pytree.tree_leaves((args, kwargs))))


def _in_compiled_code() -> bool:
    """Whether torch.compile's wrapper is on the stack: the model is called from compiled
    code (its hooks run before the wrapper when the compiled module itself is attached)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    frame = sys._getframe(1) if dynamo is not None else None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename == dynamo.__file__:
            return True
        frame = frame.f_back
    return False


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def _as_batch(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The call's inputs as a batch ``profile`` calls the model with the same way."""
    if not kwargs:
        return tuple(args)
    if not args:
        return dict(kwargs)
    # the model's own forward: ``module.forward`` is attach's guard, ``(*args, **kwargs)``
    # (NOTE [a step off the profiled path] in ``runtime/block.py``)
    eager = eager_module(module)
    forward = vars(eager).get("_slackswap_own_forward") or type(eager).forward.__get__(eager)
    params = list(inspect.signature(forward).parameters.values())[:len(args)]
    if len(params) < len(args) or any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        raise InputError("slackswap.attach: the model was called with positional and "
                         "keyword arguments its forward cannot take all by name; call it "
                         "with keywords only, or positionally only")
    return {**{p.name: a for p, a in zip(params, args, strict=True)}, **kwargs}


def _own_loss_or(output: Any, fallback: Callable[[Any], torch.Tensor | None],
                 ) -> torch.Tensor | None:
    """The model's own loss where it returns one, else ``fallback(output)``."""
    loss = own_loss(output)
    return loss if loss is not None else fallback(output)


def _output_sum(output: Any) -> torch.Tensor | None:
    """A loss to profile with when the model returns none: every floating-point output
    gets a gradient, so backward runs through the whole model as a real loss drives it."""
    if isinstance(output, Mapping):
        output = list(output.values())
    parts = [t.sum() for t in _pytree.tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum(parts[1:], parts[0]) if parts else None
