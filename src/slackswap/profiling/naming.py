"""What counts as an op and how activations are named: shared by the profiler and the
runtime, so a plan made from a profile finds its tensors in a real step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_leaves

__all__ = ["is_recorded", "op_kind", "is_random", "is_attention", "name_kind",
           "strided_tensors", "module_path", "ForwardModules", "activation_name"]

_RANDOM = ("bernoulli", "rand", "randn", "randint", "normal", "uniform", "exponential",
           "multinomial", "native_dropout", "dropout", "randperm")
_RANDOM_OPS: dict[Any, bool] = {}  # op overload -> is_random, memoised: asked on every op


# Fused attention forward kernels: every backend returns (output, logsumexp, ...) in that
# order, so one name in ids lets a plan traced for the GPU (``fused_attention``) find the
# tensors a real step makes with whichever kernel SDPA picks there.
_ATTENTION_KERNELS = frozenset({
    "fused_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
})


def is_recorded(func: Any) -> bool:
    """Kernels, not metadata: views, detaches, aliases and prims are resolved to bases."""
    return not (func.namespace == "prim" or func.is_view
                or func.__name__.startswith(("detach", "alias")))


def op_kind(func: Any) -> str:
    """Short op name used in ids: ``aten.addmm.default`` -> ``addmm``."""
    return func.__name__.split(".")[0]


def is_random(func: Any) -> bool:
    """Draws from the RNG: takes a ``Generator`` argument, or is dropout-like by name."""
    random = _RANDOM_OPS.get(func)
    if random is None:
        takes_generator = any(str(a.type) == "Optional[Generator]" for a in func._schema.arguments)
        random = takes_generator or op_kind(func).rstrip("_").startswith(_RANDOM)
        _RANDOM_OPS[func] = random
    return random


def is_attention(kind: str) -> bool:
    """A fused attention forward kernel (it draws from the RNG when it has dropout)."""
    return kind in _ATTENTION_KERNELS


def name_kind(kind: str) -> str:
    """The op kind as activation ids spell it: ``attention`` for any fused attention."""
    return "attention" if kind in _ATTENTION_KERNELS else kind


def strided_tensors(tree: Any) -> list[torch.Tensor]:
    leaves = tree_leaves(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.layout == torch.strided]


def module_path(tracker: ModTracker, root: str) -> Callable[[], str]:
    """The innermost module running now, as a path below the root model ("" at the top)."""
    prefix = root + "."

    def innermost() -> str:
        names = [p for p in tracker.parents if p != "Global"]
        path = max(names, key=len, default="")
        return path[len(prefix):] if path.startswith(prefix) else ""

    return innermost


class ForwardModules:
    """The innermost module of ``model`` running in forward, by the same rule as
    :func:`module_path` over a ``ModTracker``: the longest path among the active ones.

    The runtime needs forward only. ``ModTracker`` also tracks backward, registering
    gradient hooks on every module's inputs and outputs: about 65 us a module call, where
    two global forward hooks cost a few. Modules are named as ``model.named_modules()``
    names them; a module reachable under two names takes the first.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(m): name for name, m in model.named_modules()}
        self._active: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ForwardModules:
        from torch.nn.modules import module as nn_module

        self._active.clear()
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._leave_module, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name:  # the root is the top ("")
            self._active.append(name)

    def _leave_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name and name in self._active:
            del self._active[len(self._active) - 1 - self._active[::-1].index(name)]

    def innermost(self) -> str:
        return max(self._active, key=len, default="")


def activation_name(module: str, kind: str, k: int) -> str:
    """``<module>:<op kind>:<k>``: the k-th tensor that module made with that op."""
    return f"{module or '(top)'}:{kind}:{k}"
