"""``--probe``: check a ``--budget fit`` plan with real training steps on the GPU, as
accelerate's ``find_executable_batch_size`` checks a batch size by running it.

The model is built on the GPU with its weights, profiled there (measured), planned under
what the device's memory leaves (``budget="fit"``, from ``torch.cuda.mem_get_info``), and
trained for a few AdamW steps under the plan; the device's allocation peak is read back
against the device's memory. Out of memory, the budget is lowered by a tenth and tried
again, a few times, as accelerate lowers the batch size.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from slackswap.core.plan import Plan
from slackswap.core.units import format_bytes
from slackswap.errors import InputError
from slackswap.runtime.block import apply
from slackswap.runtime.oneshot import plan_model

__all__ = ["Probe", "probe", "require_gpu"]

STEPS = 3  # the first step warms the allocator and the optimizer states are made in it
TRIES = 4  # each one a tenth lower than the last


@dataclass(frozen=True)
class Probe:
    """What real steps under a plan held on the device."""

    device: str
    capacity: int  # the device's memory (torch.cuda.mem_get_info)
    budget: int  # the activation budget the steps ran under
    peak_allocated: int  # torch.cuda.max_memory_allocated over the steps
    peak_reserved: int  # ... and what the caching allocator reserved
    tries: int  # plans tried, the last one ran

    def lines(self) -> list[str]:
        share = self.peak_reserved / self.capacity if self.capacity else 0.0
        lowered = (f" (the budget lowered {self.tries - 1} time(s) after running out of "
                   "memory)" if self.tries > 1 else "")
        return [f"probe: {STEPS} AdamW steps on {self.device} under a budget of "
                f"{format_bytes(self.budget)}{lowered}: peak allocated "
                f"{format_bytes(self.peak_allocated)}, reserved {format_bytes(self.peak_reserved)}"
                f" of {format_bytes(self.capacity)} ({share:.0%})"]


def require_gpu() -> None:
    """A one-line InputError unless a CUDA GPU is here."""
    if not torch.cuda.is_available():
        raise InputError("--probe runs real training steps on a CUDA GPU and none is here; "
                         "plan without it, or run it where the model will train")


def probe(model_name: str, hardware: str | None, strategy: str) -> Probe:
    """Run :data:`STEPS` real steps of preset ``model_name`` on the GPU under its
    ``budget="fit"`` plan, lowering the budget out of memory; a one-line InputError when
    no GPU is here or no try runs."""
    require_gpu()
    from slackswap.models import load_workload

    model, batch = load_workload(model_name, fake=False, device="cuda")
    capacity = torch.cuda.mem_get_info()[1]
    plan = plan_model(model, batch, "fit", hardware, strategy)
    for tries in range(1, TRIES + 1):
        try:
            peak = _steps(model, batch, plan)
            return Probe(torch.cuda.get_device_name(), capacity, plan.budget_bytes, *peak,
                         tries)
        except torch.cuda.OutOfMemoryError:
            budget = int(plan.budget_bytes * 0.9)
            gc.collect()
            torch.cuda.empty_cache()
            if tries == TRIES:
                break
            plan = plan_model(model, batch, budget, hardware, strategy)
    raise InputError(f"--probe: out of memory {TRIES} times on {torch.cuda.get_device_name()}, "
                     "the budget lowered by a tenth each time; the model states and the "
                     "step's temporaries do not leave what the plan needs")


def _steps(model: torch.nn.Module, batch: dict, plan: Plan) -> tuple[int, int]:
    """Peak allocated and reserved bytes over :data:`STEPS` AdamW steps under ``plan``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(STEPS):
            with apply(model, plan):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    finally:
        optimizer.state.clear()
        model.zero_grad(set_to_none=True)
