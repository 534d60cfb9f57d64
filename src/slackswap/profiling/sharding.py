"""FSDP2 (``fully_shard``) seen from the step: its own work is not the model's.

NOTE [FSDP2's hooks are not the step]
    FSDP2 does its work in module hooks: before a unit's forward it all-gathers the unit's
    parameters, copies them out and registers them as plain ``nn.Parameter``s; after it,
    it frees them (``resize_(0)``) and registers the sharded ``DTensor``s again; with a
    ``MixedPrecisionPolicy`` it also casts the unit's inputs and outputs. None of that is
    an activation: the hooks run with the recorder quiet (no op counted, named, recorded
    or replayed; no tensor saved there is planned), and the parameters each unit gathers
    are marked as from outside the step, as any parameter is. A sharded model then runs
    the ops, in the order, of its unsharded self, which is what its plan was made for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["rank_prefix", "fsdp_module_class", "module_class", "fsdp_units", "unsharded",
           "fsdp_hooks_apart", "fsdp_hooks_off", "unsharded_state", "local_bytes",
           "gather_again"]

_FSDP = "torch.distributed.fsdp."


def fsdp_units(model: torch.nn.Module,
               modules: list[torch.nn.Module] | None = None) -> list[torch.nn.Module]:
    """The modules of ``model`` (or of ``modules``, its modules when the caller has them)
    that ``fully_shard`` was applied to."""
    classes = fsdp_module_class()
    if classes is None:
        return []
    return [m for m in (model.modules() if modules is None else modules)
            if isinstance(m, classes)]


@functools.cache
def fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule``, the base ``fully_shard`` adds to a module's class (None
    without ``torch.distributed``)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def module_class(module: torch.nn.Module) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps it for a subclass made on the
    fly (``FSDPLinear`` for ``Linear``) and keeps the module's path, so a plan made before
    sharding stays valid after."""
    cls = type(module)
    fsdp = fsdp_module_class()
    if fsdp is not None and len(cls.__bases__) == 2 and cls.__bases__[0] is fsdp:
        return cls.__bases__[1]
    return cls


@contextlib.contextmanager
def fsdp_hooks_apart(model: torch.nn.Module, quiet: Callable[[], Any],
                     gathered: Callable[[torch.Tensor, torch.nn.Module], None],
                     units: list[torch.nn.Module] | None = None) -> Iterator[None]:
    """Every FSDP2 forward hook in ``model`` runs inside ``quiet()``; after a unit's
    pre-forward hook, ``gathered(parameter, unit)`` is called for each parameter it
    registered (NOTE [FSDP2's hooks are not the step]). The hooks are put back on exit.
    ``units``: ``fsdp_units(model)``, when the caller has them."""
    with _fsdp_hooks_swapped(model, lambda hook, unit, pre: _apart(
            hook, unit, quiet, gathered if pre else None), units):
        yield


@contextlib.contextmanager
def fsdp_hooks_off(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's forward hooks skipped: with full-shape parameters swapped in (see
    :func:`unsharded_state`), the model runs as its unsharded self, with no collective."""
    with _fsdp_hooks_swapped(model, lambda hook, unit, pre: _skipped):
        yield


@contextlib.contextmanager
def _fsdp_hooks_swapped(model: torch.nn.Module,
                        swap: Callable[[Any, torch.nn.Module, bool], Any],
                        units: list[torch.nn.Module] | None = None) -> Iterator[None]:
    """Each FSDP2 forward hook of each unit replaced by ``swap(hook, unit, is_pre_hook)``
    for the duration."""
    swapped: list[tuple[dict, int, Any]] = []
    try:
        for unit in fsdp_units(model) if units is None else units:
            for hooks, pre in ((unit._forward_pre_hooks, True), (unit._forward_hooks, False)):
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__module__", "").startswith(_FSDP):
                        swapped.append((hooks, key, hook))
                        hooks[key] = swap(hook, unit, pre)
        yield
    finally:
        for hooks, key, hook in swapped:
            hooks[key] = hook


_WHOLE: set[int] = set()  # models gathered whole by :func:`unsharded` now


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """A model sharded with FSDP2 as its unsharded self: every unit's parameters gathered
    (a collective: every rank must enter) and FSDP2's forward hooks skipped, so one real
    step runs as it would without sharding, on this rank alone; sharded again on exit.
    It holds the whole model on each rank for that long. Re-entering is a no-op."""
    units = fsdp_units(model)
    if not units or id(model) in _WHOLE:
        yield
        return
    # NOTE [units gathered before the profile]: a unit FSDP2 has gathered already (the
    # root, whose pre-forward hook ran before attach's) stays gathered on exit
    sharded = [unit for unit in units if not _gathered(unit)]
    for unit in units:
        unit.unshard()
    _WHOLE.add(id(model))
    try:
        with fsdp_hooks_off(model):
            yield
    finally:
        _WHOLE.discard(id(model))
        for unit in sharded:
            unit.reshard()


# NOTE [units gathered before the profile]
#     ``slackswap.attach`` profiles inside the model's call, in a forward pre-hook that
#     runs after FSDP2's own (``fully_shard`` prepends its hook): the root unit's
#     parameters are gathered and registered for the forward about to run. Resharding
#     every unit after the profiled step registered the root's sharded ``DTensor``s again
#     under that forward, which then failed in its first op ("mixed torch.Tensor and
#     DTensor"). Only the units that were sharded before the profile are sharded after.
def _gathered(unit: torch.nn.Module) -> bool:
    """Whether every parameter group of the FSDP2 unit is gathered (unsharded) now."""
    state = unit._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # releases with one group a unit
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return bool(groups) and all(g.is_unsharded for g in groups)


def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


def unsharded_state(state: dict[str, torch.Tensor], make: Callable[..., torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """``state`` with each sharded ``DTensor`` replaced by ``make(shape, dtype, device,
    requires_grad)``: a tensor of the whole parameter's shape on this rank's device."""
    out = {}
    for name, t in state.items():
        if hasattr(t, "to_local") and hasattr(t, "device_mesh"):
            t = make(tuple(t.shape), t.dtype, t.to_local().device, t.requires_grad)
        out[name] = t
    return out


def _apart(hook: Any, unit: torch.nn.Module, quiet: Callable[[], Any],
           gathered: Callable[[torch.Tensor, torch.nn.Module], None] | None) -> Any:
    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with quiet():
            out = hook(*args, **kwargs)
        if gathered is not None:
            for p in unit.parameters():
                if type(p) in (torch.Tensor, torch.nn.Parameter):  # not a sharded DTensor
                    gathered(p, unit)
        return out

    return run


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``: a ``DTensor``'s local shard, else its storage."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    return t.untyped_storage().nbytes()


# NOTE [rebuilds across FSDP2 units]
#     With ``reshard_after_forward=True`` FSDP2 frees a unit's gathered parameters after
#     its forward and gathers them again when its backward starts. A rebuild can need them
#     earlier: the input of a later unit, saved there and rebuilt from this unit's ops,
#     is unpacked in the later unit's backward. The rebuild then gathers the unit again
#     (FSDP2's own ``unshard``; the unit's backward finds it gathered and frees it after,
#     as usual). Values are those forward read, bit for bit. No collective is added: it is
#     the unit's own backward all-gather, issued earlier (tests count them). What it costs
#     is the unit's parameters held from the rebuild on, which the simulator, planning
#     activation memory only, does not count.
def gather_again(unit: torch.nn.Module) -> None:
    """All-gather ``unit``'s parameters again, as its backward would (NOTE [rebuilds
    across FSDP2 units]): every rank runs the same plan, so every rank calls this at the
    same point, as a collective needs."""
    unit.unshard()  # FSDPModule.unshard: gathers, and registers the gathered parameters


def rank_prefix() -> str:
    """``"rank N: "`` in a process group of more than one rank, so that an error says
    which rank refused; otherwise empty."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()}: "
    return ""
