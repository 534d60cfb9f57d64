"""``--budget fit``: the activation budget a device leaves once the model states and what
else the device holds during a step are taken out of its memory.

    budget = device memory (the hardware preset's ``memory.capacity_bytes``)
             - model states: weights and buffers as held, gradients, fp32 master weights,
               optimizer states (``OPTIMIZERS``, ``PRECISIONS``)
             - reserve: the CUDA context and the cuBLAS workspaces (``RESERVE``)
             - a sharded model's gather buffers (``FSDP2_UNITS_HELD``)

and the optimizer step's temporaries, made after backward has freed the activations,
must fit what the states leave (``OPTIMIZER_TEMPORARIES``: a warning when they do not).
Each figure cites its source below. Not counted, for want of a figure that holds across
machines: the caching allocator's fragmentation (reserved above allocated), kernels the
CUDA context loads lazily during the step, NCCL buffers of a sharded run; every parameter
is taken to be trained (the profile does not record ``requires_grad``). ``--probe``
(:mod:`slackswap.runtime.probe`) checks the answer with real steps on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slackswap.core.hardware import Hardware
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes
from slackswap.errors import InputError

__all__ = ["FSDP2_UNITS_HELD", "OPTIMIZERS", "OPTIMIZER_TEMPORARIES", "PRECISIONS", "RESERVE",
           "DeviceBudget", "device_budget", "is_fit", "resolve_fit"]

# Optimizer state tensors per parameter, each the parameter's size: torch/optim/adam.py
# (torch 2.13, ``_init_group``) makes ``exp_avg`` and ``exp_avg_sq`` with
# ``torch.zeros_like(p)`` (AdamW is Adam with decoupled weight decay; ``amsgrad`` would add
# a third); torch/optim/sgd.py keeps one ``momentum_buffer`` (a clone of the gradient) per
# parameter when momentum is set, none without.
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd-momentum": "SGD momentum",
                   "sgd": "SGD"}

# Temporaries of one optimizer step, per parameter, in the optimizer states' dtype: the
# foreach implementation PyTorch picks by default on CUDA (``_default_to_fused_or_foreach``)
# makes ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` for every parameter
# at once (torch/optim/adam.py, ``_multi_tensor_adam``, torch 2.13); SGD without weight
# decay or Nesterov updates in place (torch/optim/sgd.py, ``_multi_tensor_sgd``).
OPTIMIZER_TEMPORARIES = {"adamw": 1, "adam": 1, "sgd-momentum": 0, "sgd": 0}

# A model sharded with FSDP2 holds whole, beside its shards, the parameters of the unit
# running and of the next one, whose all-gather is issued ahead (implicit prefetch in
# forward and backward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, torch 2.13),
# and in backward one unit's unsharded gradients, the reduce-scatter's input. Units are
# taken to be the transformer blocks (as FSDP2 is usually applied), the largest one.
FSDP2_UNITS_HELD = 2

# ``mixed``: 16-bit weights and gradients, an fp32 master copy of the weights and fp32
# optimizer states. ZeRO (Rajbhandari et al., SC 2020, section 3.1): mixed-precision Adam
# holds 2 B of fp16 parameters, 2 B of fp16 gradients and 12 B of fp32 parameters,
# momentum and variance per parameter, 16 B in all. Parameters already in fp32 need no
# master copy. ``pure``: gradients and optimizer states in the parameters' own dtype
# (plain ``torch.optim`` on bf16 parameters), no master copy.
PRECISIONS = {"mixed": "mixed precision, fp32 master weights and states",
              "pure": "states in the parameters' dtype"}
FP32 = 4

# What else the device holds during a step: (bytes, short source, source).
RESERVE: dict[str, tuple[int, str, str]] = {
    "CUDA context": (426 * 2**20, "unsloth-zoo PR #1053, pytorch issue #109888", (
        "unslothai/unsloth-zoo PR #1053 (2026): torch.cuda.mem_get_info creates a context "
        "that nvidia-smi shows as 426 MiB (PyTorch 2.10+cu130, RTX 6000 Ada); "
        "pytorch/pytorch issue #109888: ptrblck, around 400 MB with CUDA >= 11.7's lazy "
        "module loading, PyTorch's default (pytorch/pytorch PR #86509 measured 287 MB "
        "lazy, 667 MB eager, CUDA 11.7)")),
    "cuBLAS and cuBLASLt workspaces": (64 * 2**20, "pytorch CublasHandlePool.cpp, PR #120925", (
        "pytorch/pytorch aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize: "
        "32 MiB per handle and stream on Hopper and Blackwell (8.125 MiB, :4096:2:16:8, "
        "before); pytorch/pytorch PR #120925: the cuBLASLt workspace 32 MiB on Hopper (4 "
        "MiB on Ampere); one compute stream, the larger figures")),
}


@dataclass(frozen=True)
class DeviceBudget:
    """Device memory, what a step's model states and reserve take of it, and the rest:
    the activation budget."""

    hardware: str
    capacity: int
    capacity_source: str  # where the device memory figure comes from
    parameters: int  # parameter elements, as held
    weights: int  # parameters and buffers, as held (the profile's model_state_bytes)
    gradients: int
    master: int  # fp32 master weights (mixed precision, 16-bit parameters)
    optimizer_states: int
    optimizer: str
    precision: str
    reserve: dict[str, int]
    gather: int = 0  # FSDP2: unsharded parameters and gradients of the units held whole
    temporaries: int = 0  # the optimizer step's, after backward (not with activations)

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.master + self.optimizer_states

    @property
    def budget_bytes(self) -> int:
        return self.capacity - self.model_states - sum(self.reserve.values()) - self.gather

    def _states(self) -> str:
        per = self.model_states / self.parameters if self.parameters else 0.0
        return (f"model states {format_bytes(self.model_states)} ({per:.3g} B/param for "
                f"{self.parameters:,} parameters: {OPTIMIZER_NAMES[self.optimizer]}, "
                f"{self.precision} precision)")

    def lines(self) -> list[str]:
        """The breakdown, one figure a line with its source, then what is not counted."""
        rows = [(f"{self.hardware} device memory", self.capacity, self.capacity_source),
                ("weights and buffers, as held", -self.weights, "the profile"),
                ("gradients", -self.gradients, "one per parameter, in its dtype"),
                ("fp32 master weights", -self.master, "ZeRO, SC 2020, section 3.1"),
                (f"{OPTIMIZER_NAMES[self.optimizer]} states", -self.optimizer_states,
                 f"{OPTIMIZERS[self.optimizer]} per parameter, torch.optim")]
        rows += [(what, -n, RESERVE[what][1]) for what, n in self.reserve.items()]
        if self.gather:
            rows.append(("FSDP2 units gathered whole", -self.gather,
                         f"{FSDP2_UNITS_HELD} blocks' parameters, one's gradients"))
        rows.append(("activation budget", self.budget_bytes, ""))
        width = max(len(r[0]) for r in rows)
        signs = [" "] + ["-"] * (len(rows) - 2) + ["="]
        out = [f"budget fit: {self._states()}"]
        out += [f"  {what:<{width}} {sign}{format_bytes(abs(n)):>11}" + (f"  {src}" if src
                else "") for (what, n, src), sign in zip(rows, signs, strict=True)]
        if self.temporaries:
            out.append(f"  optimizer step temporaries {format_bytes(self.temporaries)} (after "
                       "backward, in place of activations: torch/optim/adam.py foreach)")
        if self.temporaries > self.budget_bytes + self.gather:
            out.append(f"  warning: the {OPTIMIZER_NAMES[self.optimizer]} step's temporaries do "
                       "not fit what the states leave: use its fused=True (no temporaries) or "
                       "shard the states")
        out.append("  not counted: allocator fragmentation, kernels loaded during the step, "
                   "NCCL buffers")
        return out


def is_fit(budget: object) -> bool:
    """Whether ``budget`` asks for the budget the device leaves (``"fit"``)."""
    return isinstance(budget, str) and budget.strip().lower() == "fit"


def device_budget(profile: StepProfile, hardware: Hardware, optimizer: str = "adamw",
                  precision: str = "mixed", capacity: int | None = None,
                  capacity_source: str = "the hardware preset") -> DeviceBudget:
    """What ``hardware``'s memory (or ``capacity`` bytes, read from the device) leaves for
    activations when it trains ``profile``'s step with ``optimizer`` at ``precision``; a
    one-line InputError, with the numbers and the GPUs that would hold the states
    sharded, when the model states and the reserve leave nothing."""
    if optimizer not in OPTIMIZERS:
        raise InputError(f"unknown optimizer '{optimizer}'; use {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision '{precision}'; use {' or '.join(PRECISIONS)}")
    params = [t for t in profile.tensors if t.kind == "parameter"]
    listed = sum(t.bytes for t in profile.tensors if t.is_parameter)
    # the profile lists the tensors as traced; model_state_bytes is what this rank holds
    held = profile.model_state_bytes / listed if listed else 1.0
    elements = gradients = master = states = 0.0
    for t in params:
        count = math.prod(t.shape)
        size = t.bytes / count if count else 0.0  # the dtype's bytes
        elements += count
        gradients += count * size
        wide = precision == "mixed"
        master += count * FP32 if wide and size < FP32 else 0
        states += count * OPTIMIZERS[optimizer] * (FP32 if wide else size)
    per_state = states / OPTIMIZERS[optimizer] if OPTIMIZERS[optimizer] else 0.0
    result = DeviceBudget(
        hardware=hardware.name,
        capacity=int(hardware.memory.capacity_bytes if capacity is None else capacity),
        capacity_source=capacity_source,
        parameters=round(elements * held), weights=profile.model_state_bytes,
        gradients=round(gradients * held), master=round(master * held),
        optimizer_states=round(states * held), optimizer=optimizer, precision=precision,
        reserve={what: n for what, (n, _, _) in RESERVE.items()},
        gather=_gather(profile) if held < 1 else 0,
        temporaries=round(per_state * held * OPTIMIZER_TEMPORARIES[optimizer]))
    capacity = format_bytes(result.capacity)
    reserve = sum(result.reserve.values())
    if result.model_states + reserve >= result.capacity:
        # sharded over n ranks (FSDP2, ZeRO-3) each holds 1/n of the states
        room = result.capacity - reserve
        shards = math.floor(result.model_states / room) + 1 if room > 0 else None
        shard = (f"; sharded over {shards} or more GPUs (FSDP2 fully_shard, ZeRO-3) each "
                 f"holds {format_bytes(result.model_states // shards)}, leaving activations "
                 "the rest" if shards is not None else "")
        what = (f"the {result._states()} do not fit" if result.model_states > result.capacity
                else f"the {result._states()} and the {format_bytes(reserve)} reserve (CUDA "
                "context, cuBLAS workspaces) leave nothing of")
        raise InputError(f"{what} {hardware.name}'s {capacity} of device memory{shard}")
    if result.budget_bytes <= 0:
        raise InputError(f"the {result._states()}, the reserve and FSDP2's gathered units "
                         f"({format_bytes(result.gather)}) leave nothing of {hardware.name}'s "
                         f"{capacity} of device memory for activations")
    return result


def _gather(profile: StepProfile) -> int:
    """Bytes a sharded model holds whole beside its shards: ``FSDP2_UNITS_HELD`` units'
    parameters and one unit's gradients, of its largest unit."""
    params = [t for t in profile.tensors if t.kind == "parameter"]
    units = [sum(t.bytes for t in params if (t.name or "").startswith(layer + "."))
             for layer in profile.layers] or [sum(t.bytes for t in params)]
    return (FSDP2_UNITS_HELD + 1) * max(units)


def resolve_fit(budget: str | int | float, profile: StepProfile, hardware: Hardware
                ) -> str | int | float:
    """``budget``, with ``"fit"`` replaced by the bytes :func:`device_budget` leaves (for
    AdamW in mixed precision)."""
    return device_budget(profile, hardware).budget_bytes if is_fit(budget) else budget
