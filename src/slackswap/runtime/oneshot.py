"""Profile and plan in one call, for the model as it will train."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slackswap.core.plan import Plan
from slackswap.planners import plan
from slackswap.profiling import profile

__all__ = ["plan_model"]


def plan_model(
    model: torch.nn.Module,
    batch: Any,
    budget: str | int | float = 0.5,
    hardware: str | None = None,
    strategy: str = "slackswap",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Plan:
    """A plan whose activation ids match what ``model`` runs on its own device.

    On CUDA the step is measured (real kernels, real times); elsewhere it is traced with
    the local kernels and priced on ``hardware`` (default ``a100-80gb``). The plan keeps
    the profile in memory, so ``slackswap.apply(model, plan)`` reloads at its prefetch
    points; a plan read back from a file needs ``profile=`` for that.
    """
    params = list(model.parameters())
    on_cuda = bool(params) and params[0].device.type == "cuda"
    step = profile(model, batch, hardware or "a100-80gb",
                   mode="measured" if on_cuda else "analytic", loss_fn=loss_fn,
                   kernels=None if on_cuda else "native")
    result = plan(step, budget, hardware, strategy)
    result._profile = step  # so that apply checks it and prefetches without being told
    return result
