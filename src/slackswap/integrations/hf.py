"""SlackSwap in a Hugging Face ``Trainer``: ``Trainer(..., callbacks=[SlackSwapCallback(
budget=0.5)])``. Each training forward runs under the plan for its batch shape; the
evaluation loop (``no_grad``) runs without one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

import slackswap
from slackswap.compiled.attach import CompiledAttached
from slackswap.core.hardware import Hardware
from slackswap.errors import InputError
from slackswap.integrations.common import unplanned
from slackswap.runtime.attach import Attached

__all__ = ["SlackSwapCallback"]


class SlackSwapCallback(TrainerCallback):
    """Attaches SlackSwap to the trained model when training begins and detaches it when
    training ends. The arguments are :func:`slackswap.attach`'s; ``attached`` is what it
    returned (its ``plans`` and ``stats``), kept after training ends."""

    def __init__(self, budget: str | int | float = 0.5, hardware: str | Hardware | None = None,
                 strategy: str = "slackswap",
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                 compile: bool = False, backend: str = "inductor",  # noqa: A002
                 **compile_kwargs: Any) -> None:
        self.options = {"budget": budget, "hardware": hardware, "strategy": strategy,
                        "loss_fn": loss_fn, "compile": compile, "backend": backend,
                        **compile_kwargs}
        self.attached: Attached | CompiledAttached | None = None
        self._checked = True  # whether the first step's plan was looked for

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module,
                       **kwargs: Any) -> None:
        self._detach()  # an earlier train() that raised did not reach on_train_end
        if getattr(args, "torch_compile", False):
            # the Trainer compiled its wrapper of the model: dynamo traces through attach's
            # hooks (refused at the first forward) and through compile=True's own compiled
            # call (no plan ever made, silently), so neither could apply a plan
            raise InputError("SlackSwapCallback: TrainingArguments(torch_compile=True) "
                             "compiles the model around SlackSwap, where no plan reaches its "
                             "ops; set torch_compile=False (SlackSwapCallback(compile=True) "
                             "trains it compiled under the plan)")
        # the Trainer turns the model's own checkpointing on before this: refused at the
        # first forward with advice a Trainer user cannot take (it turns it on again)
        # (activation_checkpointing: transformers 5.2x's name; gradient_checkpointing: its
        # alias, and the name before it)
        for flag in ("activation_checkpointing", "gradient_checkpointing"):
            if getattr(args, flag, False) is True:
                raise InputError(f"SlackSwapCallback: TrainingArguments({flag}=True) "
                                 "checkpoints the model's blocks its own way; set it to False "
                                 "and let the plan decide what to recompute")
        self.attached = slackswap.attach(model, **self.options)
        self._checked = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._checked:
            self._checked = True
            unplanned(self.attached, "the Trainer's model: a compute_loss that calls a "
                      "submodule (model.transformer(...)) passes by its hooks")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    def _detach(self) -> None:
        if self.attached is not None:
            self.attached.detach()

