"""Profile and plan in one call, for the model as it will train; or once per batch shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slackswap.core.plan import Plan
from slackswap.planners import plan
from slackswap.profiling import profile
from slackswap.profiling.step import fingerprint
from slackswap.runtime.block import apply

__all__ = ["plan_model", "AutoPlan"]


def plan_model(
    model: torch.nn.Module,
    batch: Any,
    budget: str | int | float = 0.5,
    hardware: str | None = None,
    strategy: str = "slackswap",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Plan:
    """A plan whose activation ids match what ``model`` runs on its own device.

    On CUDA the step is measured (real kernels, real times); elsewhere one real step is
    traced (so data-dependent branches, such as a mask checked for padding, take the
    path training takes) and priced on ``hardware`` (default ``a100-80gb``). The plan keeps
    the profile in memory, so ``slackswap.apply(model, plan)`` reloads at its prefetch
    points; a plan read back from a file needs ``profile=`` for that.
    """
    params = list(model.parameters())
    on_cuda = bool(params) and params[0].device.type == "cuda"
    step = profile(model, batch, hardware or "a100-80gb",
                   mode="measured" if on_cuda else "traced", loss_fn=loss_fn)
    result = plan(step, budget, hardware, strategy)
    result._profile = step  # so that apply checks it and prefetches without being told
    return result


class AutoPlan:
    """Plans the step for each batch shape the model meets, once, and applies it:

        step = slackswap.auto(model, budget=0.5)
        for batch in loader:
            with step(batch):
                loss = model(**batch).loss
            loss.backward()

    Each new shape is profiled and planned (seconds on a small model), so pad batches to
    a few lengths rather than to each batch's longest sequence. ``plans`` holds them, by
    the fingerprint of model and batch.
    """

    def __init__(self, model: torch.nn.Module, budget: str | int | float = 0.5,
                 hardware: str | None = None, strategy: str = "slackswap",
                 loss_fn: Callable[[Any], torch.Tensor] | None = None) -> None:
        self.model, self.budget, self.hardware = model, budget, hardware
        self.strategy, self.loss_fn = strategy, loss_fn
        self.plans: dict[str, Plan] = {}

    def __call__(self, batch: Any) -> apply:
        key = fingerprint(self.model, batch)
        if key not in self.plans:
            self.plans[key] = plan_model(self.model, batch, self.budget, self.hardware,
                                         self.strategy, self.loss_fn)
        return apply(self.model, self.plans[key])
