"""SlackSwap: fit training activations in GPU memory by offloading what is expensive to
rebuild within the transfer time computation hides, and recomputing the rest."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slackswap.core.hardware import Hardware, hardware_presets, load_hardware
from slackswap.core.plan import Plan
from slackswap.core.profile import OpRecord, StepProfile, TensorRecord
from slackswap.core.result import SimResult
from slackswap.errors import InputError, PathNotice, ProfileError, SlackSwapError
from slackswap.planners import STRATEGIES
from slackswap.planners import plan as _plan_profile
from slackswap.sim import simulate

if TYPE_CHECKING:  # torch is imported only when profiling or a runtime is used
    import torch

    from slackswap.compiled.attach import CompiledAttached
    from slackswap.runtime.attach import Attached

__all__ = [
    "Hardware", "OpRecord", "Plan", "SimResult", "StepProfile", "TensorRecord",
    "InputError", "PathNotice", "ProfileError", "SlackSwapError",
    "STRATEGIES", "apply", "attach", "auto", "checkpoint_policy", "compile", "hardware_presets",
    "load_hardware", "plan", "profile", "simulate",
]


def plan(profile_or_model, *args, **kwargs) -> Plan:
    """``plan(profile, budget, hardware=None, strategy="slackswap")``, or in one call
    ``plan(model, batch, budget=0.5, hardware=None, strategy="slackswap", loss_fn=None)``:
    profile the step as the model's device runs it, then plan."""
    if hasattr(profile_or_model, "named_parameters"):
        from slackswap.runtime.oneshot import plan_model

        return plan_model(profile_or_model, *args, **kwargs)
    return _plan_profile(profile_or_model, *args, **kwargs)


def attach(model: torch.nn.Module, budget: str | int | float = 0.5,
           hardware: str | Hardware | None = None, strategy: str = "slackswap",
           loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
           group: Any = None, compile: bool = False, backend: str = "inductor",  # noqa: A002
           **compile_kwargs: Any) -> Attached | CompiledAttached:
    """Plan and apply SlackSwap to every training forward of ``model``, with no change to
    the training loop; ``.detach()`` (or leaving ``with slackswap.attach(...):``) undoes it.

    Eager (``compile=False``, the default): the first training forward of each batch
    shape profiles one step and plans it, and each such forward runs under
    ``slackswap.apply`` (``slackswap.runtime.attach.attach``: ``loss_fn`` is the loss
    profiled with when the model returns none; ``group``: a ``torch.distributed``
    process group whose first rank plans each batch shape for all its ranks, as
    ``slackswap.plan(..., group=)`` does).

    Compiled (``compile=True``): the model is compiled in place, as ``model.compile()``
    compiles it, by ``slackswap.compile``'s partitioner: the first call of each batch
    shape traces the joint forward-backward graph, profiles and plans it, and every call
    runs the compiled step cut as planned (``backend``: ``"inductor"`` or ``"aot_eager"``;
    other keywords go to ``torch.compile``; ``slackswap.compiled.attach``). Under
    ``aot_eager`` the gradients are bit-identical to ``torch.compile(model)``'s.

    ``budget`` is a fraction of the keep-all activation peak, bytes, a string such as
    ``"24GiB"``, or ``"fit"`` (what the device's memory leaves once the model states
    are out); ``hardware`` and ``strategy`` are ``slackswap.plan``'s.
    """
    if compile:
        if group is not None:
            raise InputError("slackswap.attach(..., compile=True) plans the graph each "
                             "rank compiles; group= is for the eager runtime: leave it out")
        if loss_fn is not None:
            raise InputError("slackswap.attach(..., compile=True) plans the graph the model "
                             "compiles to, whose backward is your loss's; loss_fn is for "
                             "the eager runtime's profiled step: leave it out")
        from slackswap.compiled.attach import attach_compiled

        return attach_compiled(model, budget, hardware, strategy, backend, **compile_kwargs)
    if backend != "inductor" or compile_kwargs:
        raise InputError("backend and torch.compile's keywords are for "
                         "slackswap.attach(..., compile=True)")
    from slackswap.runtime.attach import attach as attach_eager

    return attach_eager(model, budget, hardware, strategy, loss_fn, group)


def __getattr__(name: str):
    # Torch is imported only when profiling or the runtime is used: the core stays torch-free.
    if name == "profile":
        from slackswap.profiling import profile

        return profile
    if name == "apply":
        from slackswap.runtime.block import apply

        return apply
    if name == "checkpoint_policy":
        from slackswap.runtime.checkpoint_policy import checkpoint_policy

        return checkpoint_policy
    if name == "compile":
        from slackswap.compiled import compile

        return compile
    if name == "auto":
        from slackswap.runtime.oneshot import AutoPlan

        return AutoPlan
    raise AttributeError(f"module 'slackswap' has no attribute {name!r}")
