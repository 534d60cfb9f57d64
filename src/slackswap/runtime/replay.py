"""Rebuilds in backward: a recipe replayed bit for bit.

Inputs come first (recursively, when they were dropped too), random ops run under the RNG
state they first ran with, in-place ops write the storage in their original order, and
an op runs in the grad mode it first ran in (kernels may differ by it), on inputs that
need no grad, so no graph is built and nothing is packed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from slackswap.core.plan import Decision
from slackswap.errors import InputError
from slackswap.profiling.naming import is_replayable, value_digest
from slackswap.profiling.sharding import gather_again
from slackswap.runtime.recipes import (
    GeneratorState,
    Node,
    Outside,
    Ref,
    Scratch,
    Step,
    geometry,
    map_args,
    no_autocast,
    op_tensors,
    rng_state,
    set_rng_state,
    storage_key,
    view_of,
    view_or_base,
)
from slackswap.runtime.values import Rebuilt

__all__ = ["Replayer"]


class Replayer:
    """Rebuilds the values a plan recomputes, and the inputs they need, for ``values``."""

    def __init__(self, values: Rebuilt) -> None:
        self.values = values
        self.active = False  # a rebuild is running (its inputs' rebuilds are part of it)

    def rebuild(self, node: Node, upto: int) -> torch.Tensor:
        """The node's storage as it was after ``upto`` steps, as a tensor over it."""
        alive = node.alive(upto)
        if alive is not None:
            return alive
        if self.active:  # an input of the rebuild in progress: timed with it
            return self._replay(node, upto)
        values, recorder = self.values, self.values.recorder
        # The recorded ops already carry autocast's casts: replay them as they ran. The
        # block may still be open: its recorder must not take them for the model's.
        with (no_autocast(), values.stats.recompute_section(node.device),
              recorder.quieted() if recorder is not None else contextlib.nullcontext()):
            self.active = True
            grad = torch.is_grad_enabled()
            try:
                return self._replay(node, upto)
            finally:
                self.active = False
                torch._C._set_grad_enabled(grad)

    def _replay(self, node: Node, upto: int) -> torch.Tensor:
        current: torch.Tensor | None = None
        stats = self.values.stats

        def resolve(x: Any) -> Any:
            if type(x) is Ref:
                if x.node is node:
                    return view_of(current, x.geometry)  # written in place: as recorded
                return view_or_base(self._materialize(x.node, x.upto), x.geometry)
            if type(x) is Outside:
                return self._outside(x, node)
            if type(x) is GeneratorState:
                return x.generator()
            if type(x) is Scratch:
                return x.tensor.detach().clone()
            return x


        for step in node.steps[:upto]:
            if step.func is None or not is_replayable(step.func):
                raise InputError(
                    f"cannot rebuild '{node.name}': {node.unreplayable()} is not known to "
                    "replay bit for bit; keep or offload the activations it depends on"
                )
            args = map_args(resolve, step.args)
            kwargs = {k: map_args(resolve, v) for k, v in step.kwargs.items()}
            if step.rng is not None:
                saved = rng_state(node.device)
                set_rng_state(step.rng, node.device)
            if torch.is_grad_enabled() != step.grad:
                torch._C._set_grad_enabled(step.grad)  # restored by ``rebuild``
            out = step.func(*args, **kwargs)
            if step.rng is not None:
                set_rng_state(saved, node.device)
            stats.recomputed_ops += 1
            if current is None:
                made = op_tensors(out)
                current = made[step.output]
                self._keep_siblings(step, made)
        assert current is not None
        return current

    def _outside(self, x: Outside, node: Node) -> torch.Tensor:
        """An outside tensor as the recorded op read it: as it is, or as forward saw it
        before changing it in place; changed since by anything else, the rebuild stops."""
        t = x.tensor
        state = x.step
        writes = state.outside_writes.get(storage_key(t), 0) if state is not None else 0
        if t._version == x.version and writes == x.writes:
            if state is not None:
                self._unchanged(t, x, state, node)  # NOTE [inputs read by rebuilds]
            if t.numel() and not t.untyped_storage().nbytes():
                self._gather(t, state, node)
            return t.detach()
        if state is not None:
            snapshot = state.snapshots.get((storage_key(t), x.writes))
            if snapshot is not None:
                return view_of(snapshot, geometry(t))
        raise InputError(
            f"cannot rebuild '{node.name}': a tensor from outside the step (parameter, "
            f"buffer or batch input of shape {list(t.shape)}) it was made from was changed "
            "in place after forward read it; keep or offload that activation, or change "
            "the tensor only after backward"
        )

    @staticmethod
    def _unchanged(t: torch.Tensor, x: Outside, state: Any, node: Node) -> None:
        value = (storage_key(t), x.writes, x.version, t.size(), t.stride(), t.storage_offset(),
                 t.dtype)
        frozen = state.frozen.get(value)
        if frozen is None or value in state.unchanged:
            return
        now = value_digest(t)
        if now is not None and not torch.equal(now, frozen):
            raise InputError(
                f"cannot rebuild '{node.name}': a batch tensor of shape {list(t.shape)} "
                "it was made from changed after forward, by a write PyTorch does not see "
                "(a NumPy array or buffer it shares memory with, refilled by a data "
                "loader?); give the model a batch of its own (torch.tensor(array), or "
                ".clone()) or change it only after backward"
            )
        state.unchanged.add(value)

    @staticmethod
    def _gather(t: torch.Tensor, state: Any, node: Node) -> None:
        """NOTE [rebuilds across FSDP2 units]: a rebuild in a later unit's backward (its
        input, made by this unit) reads a parameter FSDP2 freed after forward: gather
        that parameter's unit, or say why the rebuild cannot run now."""
        unit = state.units.get(storage_key(t)) if state is not None else None
        unit = unit() if unit is not None else None
        if unit is not None:
            gather_again(unit)
        if not t.untyped_storage().nbytes():
            raise InputError(
                f"cannot rebuild '{node.name}' now: a parameter it reads (shape "
                f"{list(t.shape)}) is not gathered; FSDP2 frees a unit's parameters after "
                "forward (reshard_after_forward=True) and gathers them again in that "
                "unit's backward; keep or offload that activation, or shard with "
                "reshard_after_forward=False"
            )

    def _keep_siblings(self, step: Step, made: list[torch.Tensor]) -> None:
        """A re-run producer makes its other outputs too (attention's logsumexp beside its
        output): as in the simulator, this op's rebuilds have them, and one planned for
        recompute that backward will unpack stays instead of being rebuilt again."""
        values = self.values
        for j, sibling in enumerate(step.outputs):
            if sibling is None or j == step.output or sibling.alive(1) is not None:
                continue
            if len(sibling.steps) == 1:  # not changed in place later in forward
                vkey = (sibling.key, 1)
                values.group[vkey] = made[j]
                # one planned for recompute stays till backward unpacks it; an offloaded
                # one is reloaded then, as the simulator schedules it
                planned = values.decisions.get(sibling.name) == Decision.RECOMPUTE
                if (planned and values.pending.get(vkey, 0) > 0
                        and vkey not in values.back):
                    values.bring_back(vkey, made[j])

    def _materialize(self, node: Node, upto: int) -> torch.Tensor:
        """An input of a rebuild: back already, still alive, on the host, or rebuilt."""
        values = self.values
        vkey = (node.key, upto)
        back = values.back.get(vkey)
        if back is not None:  # a prefetched reload may still be in flight
            return values.copies.ready(back, values.stats)
        alive = node.alive(upto)
        if alive is not None:
            return alive
        # made already for this backward op (NOTE [rebuild groups]): an input read twice
        # (a residual, say) is made once
        base = values.group.get(vkey)
        if base is not None:
            return base
        if vkey in values.host:
            # backward unpacks it later, or it is an offloaded checkpoint: read it now
            base = values.copies.ready(values.reload(vkey, node.name, node.device), values.stats)
            if vkey in values.host_checkpoints:  # back until its release, as simulated
                values.bring_back(vkey, base)
        else:
            base = self.rebuild(node, upto)
        values.group[vkey] = base
        if values.pending.get(vkey, 0) > 0:
            # a saved activation backward will unpack later: keep it, as the simulator does
            values.bring_back(vkey, base)
        return base
