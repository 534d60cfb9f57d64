"""SlackSwap in Lightning: ``Trainer(callbacks=[SlackSwapCallback(budget=0.5)])``. Each
training forward of the module runs under the plan for its batch shape; validation and
prediction (``no_grad``, ``inference_mode``) run without one.

The callback subclasses the ``Callback`` of ``lightning`` when it is installed, else of
``pytorch_lightning``: a Trainer accepts callbacks of its own package only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError:
    from pytorch_lightning import Callback

import slackswap
from slackswap.compiled.attach import CompiledAttached
from slackswap.core.hardware import Hardware
from slackswap.errors import InputError
from slackswap.integrations.common import unplanned
from slackswap.runtime.attach import Attached

__all__ = ["SlackSwapCallback"]


class SlackSwapCallback(Callback):
    """Attaches SlackSwap when training starts and detaches it when training ends or
    raises. ``module``: the submodule to attach to, by its path in the
    ``LightningModule`` (``"model"`` for ``self.model``); the default is the
    ``LightningModule`` itself, whose ``forward`` then must be what ``training_step``
    calls (``self(batch)``). The other arguments are :func:`slackswap.attach`'s;
    ``attached`` is what it returned (its ``plans`` and ``stats``)."""

    def __init__(self, budget: str | int | float = 0.5, module: str = "",
                 hardware: str | Hardware | None = None, strategy: str = "slackswap",
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                 compile: bool = False, backend: str = "inductor",  # noqa: A002
                 **compile_kwargs: Any) -> None:
        self.module = module
        self.options = {"budget": budget, "hardware": hardware, "strategy": strategy,
                        "loss_fn": loss_fn, "compile": compile, "backend": backend,
                        **compile_kwargs}
        self.attached: Attached | CompiledAttached | None = None
        self._checked = True  # whether the first step's plan was looked for

    def on_train_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._detach()
        if getattr(pl_module, "_compiler_ctx", None) is not None:
            # trainer.fit(torch.compile(module)) compiles training_step: dynamo traces
            # through attach's hooks (refused at the first forward) and through
            # compile=True's own compiled call (no plan ever made, silently)
            raise InputError("SlackSwapCallback: the LightningModule was compiled "
                             "(trainer.fit(torch.compile(module))), so no plan reaches its "
                             "ops; fit the module itself (SlackSwapCallback(compile=True) "
                             "trains it compiled under the plan)")
        self.attached = slackswap.attach(pl_module.get_submodule(self.module), **self.options)
        self._checked = False

    def on_train_batch_end(self, trainer: Any, pl_module: torch.nn.Module, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self._checked:
            self._checked = True
            which = f"module {self.module!r}" if self.module else "the LightningModule"
            unplanned(self.attached, f"{which} (training_step calls another module: name "
                      "it with module=, as module='model' for self.model)")

    def on_train_end(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: torch.nn.Module,
                     exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        if self.attached is not None:
            self.attached.detach()
