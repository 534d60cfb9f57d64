"""``slackswap.attach(model, compile=True)``: the model compiled in place, as
``model.compile()`` compiles it, by ``slackswap.compile``'s planned partition; the training
loop is left as it is.

NOTE [compiled in place]
    PyTorch's own ``nn.Module.compile()`` compiles a module in place: it sets the module's
    ``_compiled_call_impl`` to ``torch.compile(module._call_impl)``, which
    ``Module.__call__`` runs in its place (torch 2.2 and later). Attaching with
    ``compile=True`` does the same with ``slackswap.compile``'s backend (its partitioner,
    NOTE [compiled recompute]), so every caller of the model (a plain loop, a Hugging Face
    ``Trainer``, Lightning's ``training_step``) runs the compiled step, and ``detach``
    puts ``None`` back. The first call of each batch shape compiles: Dynamo traces one
    graph (``fullgraph=True``, static shapes) and AOTAutograd hands the joint
    forward-backward graph to the partitioner, which profiles it, plans it and cuts it as
    planned; later calls of that shape run the cut graphs. A forward that needs no
    backward (``no_grad``, ``inference_mode``) compiles an inference graph, which has no
    partition and no plan. A transformers model's loss is resolved before the graph (NOTE
    [a loss resolved before the graph]) on each call of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slackswap.compiled.api import (
    CompiledPlan,
    PlannedGraph,
    check_compile_args,
    planned_compile,
    with_losses_resolved,
    with_one_line_errors,
)
from slackswap.core.hardware import Hardware
from slackswap.core.plan import Plan
from slackswap.errors import InputError
from slackswap.profiling.machine import resolve_hardware
from slackswap.profiling.step import ATTACHED, check_attach

__all__ = ["CompiledAttached", "attach_compiled"]


def attach_compiled(model: torch.nn.Module, budget: str | int | float = 0.5,
                    hardware: str | Path | Hardware | None = None,
                    strategy: str = "slackswap", backend: str = "inductor",
                    **compile_kwargs: Any) -> CompiledAttached:
    """Compile ``model`` in place with ``slackswap.compile``'s planned partition (NOTE
    [compiled in place]): each batch shape's joint graph is planned on the model's first
    call with that shape. The arguments are ``slackswap.compile``'s, less the batch."""
    check_attach(model, budget, strategy)
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) \
            or model._compiled_call_impl is not None:
        raise InputError("slackswap.attach(..., compile=True): the model is compiled already "
                         "(torch.compile or model.compile()); attach the model itself")
    check_compile_args(backend, compile_kwargs)
    return CompiledAttached(model, CompiledPlan(budget, resolve_hardware(hardware), strategy,
                                                model), backend, compile_kwargs)


class CompiledAttached:
    """What ``slackswap.attach(..., compile=True)`` returns: ``compiled``, the plans of
    the graphs compiled so far and what each applied (``slackswap.compile``'s
    ``compiled.slackswap``), and :meth:`detach`."""

    def __init__(self, model: torch.nn.Module, state: CompiledPlan, backend: str,
                 compile_kwargs: dict[str, Any]) -> None:
        self.model, self.compiled = model, state
        model._compiled_call_impl = with_one_line_errors(with_losses_resolved(
            planned_compile(model._call_impl, state, backend, compile_kwargs), model),
            "slackswap.attach(compile=True)")
        ATTACHED.add(model)

    @property
    def graphs(self) -> list[PlannedGraph]:
        """Each compiled graph's profile, plan and what its partition applied."""
        return self.compiled.graphs

    @property
    def plans(self) -> list[Plan]:
        """The plans of the graphs compiled so far, one per batch shape, in order."""
        return [g.plan for g in self.compiled.graphs]

    def detach(self) -> None:
        """Put the model's own call back: it runs eagerly, without SlackSwap."""
        if self.model in ATTACHED:
            self.model._compiled_call_impl = None
            ATTACHED.discard(self.model)

    def __enter__(self) -> CompiledAttached:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()
