"""Profile and plan in one call, for the model as it will train; or once per batch shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slackswap.core.hardware import Hardware
from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile
from slackswap.device_budget import device_budget, is_fit
from slackswap.errors import InputError
from slackswap.planners import plan
from slackswap.profiling import profile
from slackswap.profiling.machine import resolve_hardware
from slackswap.profiling.step import fingerprint, gathered
from slackswap.runtime.block import apply

__all__ = ["plan_model", "AutoPlan"]


def plan_model(
    model: torch.nn.Module,
    batch: Any,
    budget: str | int | float = 0.5,
    hardware: str | Hardware | None = None,
    strategy: str = "slackswap",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    group: Any = None,
    loss_outside: bool = False,
) -> Plan:
    """A plan whose activation ids match what ``model`` runs on its own device.

    On CUDA the step is measured (real kernels, real times); elsewhere one real step is
    traced (so data-dependent branches, such as a mask checked for padding, take the
    path training takes) and priced on ``hardware``: a preset, a hardware file,
    ``"auto"`` (the preset of the GPU this process sees), or None for ``a100-80gb``,
    said once in a :class:`~slackswap.HardwareNotice` warning; such a
    step is the same on every run, and its plan is cached on disk by content
    (``$SLACKSWAP_CACHE``, or ``~/.cache/slackswap``: NOTE [plan cache]). A model
    sharded with FSDP2's ``fully_shard`` is profiled as its unsharded self: every rank
    must call this, since its parameters are gathered whole for the profiled step. The
    plan keeps the profile in memory, so ``slackswap.apply(model, plan)`` reloads at its
    prefetch points; a plan read back from a file needs ``profile=`` for that.
    ``budget="fit"``: what the device's memory (``torch.cuda.mem_get_info`` on CUDA, the
    preset's elsewhere) leaves once AdamW's mixed-precision model states and the CUDA
    context are taken out (:mod:`slackswap.device_budget`). ``loss_fn(output)``
    returns the scalar loss of a model whose output carries none (see
    :func:`slackswap.profile`). ``loss_outside``: the loss runs after the block that will
    apply the plan (``slackswap.attach``'s covers the model's call), so what only the loss
    saves is not moved (``StepProfile.out_of_reach``).

    ``group``: a ``torch.distributed`` process group (``torch.distributed.group.WORLD``
    for all ranks). Its first rank profiles and plans, every rank receives that plan
    (measured profiles differ from rank to rank, and all ranks must run the same plan:
    a rebuild may gather FSDP2 parameters, a collective), and each checks it against its
    own model and batch. Every rank of the group must call it.
    """
    if group is not None:
        return _broadcast_plan(model, batch, group,
                               lambda: plan_model(model, batch, budget, hardware, strategy,
                                                  loss_fn, loss_outside=loss_outside))
    params = list(model.parameters())
    on_cuda = bool(params) and params[0].device.type == "cuda"
    hw = resolve_hardware(hardware)  # NOTE [assumed hardware]
    step = profile(model, batch, hw, mode="measured" if on_cuda else "traced",
                   loss_fn=loss_fn)
    if loss_outside and step.model_saves is not None and step.model_saves < len(step.saves):
        step = StepProfile.model_validate({**step.model_dump(), "loss_outside": True})
    if on_cuda and is_fit(budget):  # the device's own memory, not the preset's
        total = torch.cuda.mem_get_info(params[0].device)[1]
        budget = device_budget(step, hw, capacity=total,
                               capacity_source="torch.cuda.mem_get_info").budget_bytes
    # a traced step is the same on every run: its plan is cached (NOTE [plan cache])
    result = plan(step, budget, hw, strategy, cached=not on_cuda)
    result._profile = step  # so that apply checks it and prefetches without being told
    return result


def _broadcast_plan(model: torch.nn.Module, batch: Any, group: Any,
                    make: Callable[[], Plan]) -> Plan:
    dist = torch.distributed
    src = dist.get_global_rank(group, 0)
    made: list[Any] = [None, None]
    failed: Exception | None = None
    # every rank gathers a sharded model whole (a collective); the first one profiles it
    with gathered(model):
        if dist.get_rank() == src:
            # an error on the planning rank reaches the others as a message, not a hang
            try:
                result = make()
                made = [result, result._profile]
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
                failed = e
                made = [None, f"rank {src} could not plan: {e}"]
    dist.broadcast_object_list(made, src=src, group=group)
    if failed is not None:
        raise failed
    result, step = made
    if result is None:
        raise InputError(step)
    result._profile = step
    if fingerprint(model, batch) != result.fingerprint:
        raise InputError(
            f"rank {dist.get_rank()}: the plan from rank {src} was made for another model "
            "or batch shapes than this rank's; every rank must hold the same model and "
            "batch shapes (pad the batch, or plan on each rank without group=)"
        )
    return result


def autocast_state(model: torch.nn.Module) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for the model's device, and its dtype: a plan made under
    one state saves other tensors than a step run under another."""
    device = next((p.device.type for p in model.parameters()), "cpu")
    return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


class AutoPlan:
    """Plans the step for each batch shape the model meets, once, and applies it:

        step = slackswap.auto(model, budget=0.5)
        for batch in loader:
            with step(batch):
                loss = model(**batch).loss
            loss.backward()

    Each new shape is profiled and planned (seconds on a small model), so pad batches to
    a few lengths rather than to each batch's longest sequence. ``plans`` holds them, by
    the fingerprint of model and batch and the autocast state. ``group``: each shape is
    planned by the group's first rank and run by all (see :func:`plan_model`).
    """

    def __init__(self, model: torch.nn.Module, budget: str | int | float = 0.5,
                 hardware: str | None = None, strategy: str = "slackswap",
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 group: Any = None) -> None:
        self.model, self.budget, self.hardware = model, budget, hardware
        self.strategy, self.loss_fn, self.group = strategy, loss_fn, group
        self.plans: dict[str, Plan] = {}

    def __call__(self, batch: Any) -> apply:
        key = fingerprint(self.model, batch) + repr(autocast_state(self.model))
        if key not in self.plans:
            self.plans[key] = plan_model(self.model, batch, self.budget, self.hardware,
                                         self.strategy, self.loss_fn, group=self.group)
        return apply(self.model, self.plans[key])
