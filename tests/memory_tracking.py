"""The activation memory of a real training step, measured with ``MemTracker``.

Activation memory as the simulator counts it: forward activations and backward
temporaries (``MemTracker``'s ``ACT`` and ``TEMP``). Not counted: parameters, buffers and
the batch (tracked up front as the model's and as external tensors), the runtime's host
copies (on a CPU they are plain CPU tensors, so the tracker is told to skip the copy), and
weight gradients. A weight gradient is made in backward as a temporary and becomes a
parameter's ``.grad`` (``GRAD``) only when autograd hands it over, after the op that made
it; ``MemTracker``'s own peak is taken in between. So this records every change the tracker
makes and replays them afterwards, leaving out every storage that ever became a gradient,
and the gradients autograd summed into one (a tied weight's two), as the profile does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType
from torch.utils._pytree import tree_flatten

from slackswap.runtime.copies import HostCopies

__all__ = ["ActivationMemory"]

_ACTIVATION = (_MemRefType.ACT, _MemRefType.TEMP)
_SUMS = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}


class ActivationMemory(MemTracker):
    """``with ActivationMemory(model, batch) as memory:`` around forward and backward;
    then ``memory.peak`` is the highest activation memory of the step, in bytes."""

    def __init__(self, model: torch.nn.Module, batch: Any = ()) -> None:
        super().__init__()
        self._events: list[tuple[_UpdateType, int, int, Any]] = []
        self._serial: dict[int, int] = {}  # id of a live _WeakRefInfo -> its serial
        self._host_copy = False
        self._sums: list[tuple[list[int], list[int]]] = []  # (outputs, inputs) of sums
        self.track_external(model, *_tensors(batch))

    def __enter__(self) -> ActivationMemory:
        # the runtime's copies into host memory: offloads, and the snapshot of the
        # model's buffers a refusal puts back (on CUDA, pinned host buffers)
        self._originals = {name: getattr(HostCopies, name) for name in ("offload", "snapshot")}
        for name, original in self._originals.items():
            setattr(HostCopies, name, self._on_host(original))
        super().__enter__()
        return self

    def _on_host(self, original: Any) -> Any:
        def copy(copies: HostCopies, t: torch.Tensor, *args: Any) -> torch.Tensor:
            self._host_copy = True
            try:
                return original(copies, t, *args)
            finally:
                self._host_copy = False

        return copy

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        for name, original in self._originals.items():
            setattr(HostCopies, name, original)

    def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        """``MemTracker``'s, with the gradient hooks only on parameters that train: it
        hooks every parameter, and a frozen one (LoRA's base weights) takes no hook, nor
        a tensor ``torch.func.functional_call`` puts in a parameter's place, made in
        forward (no leaf: it has no ``.grad``)."""
        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if not install_grad_hooks:
            return memory

        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        handles = self._param_to_grad_hook_handles
        for param in module.parameters():
            if param.requires_grad and param.is_leaf and handles.get(param) is None:
                handles[param] = (param.register_hook(grad_hook),
                                  param.register_post_accumulate_grad_hook(
                                      lambda p: grad_hook(p.grad)))
        return memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._host_copy:
            return func(*args, **(kwargs or {}))
        # a storage an op reads that the tracker has not seen was made before the step
        # (a constant a module-level cache holds, as BEiT's relative position index):
        # not activation memory, though a view of it (an op's output) would be counted
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided \
                    and t.untyped_storage() not in self._WINFO:
                self._update_and_maybe_create_winfos(t, _MemRefType.OTH)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _SUMS and self._mod_tracker.is_bw:  # how autograd sums gradients
            self._sums.append((self._serials(out), self._serials(args)))
        return out

    def _serials(self, x: Any) -> list[int]:
        tensors = [x] if isinstance(x, torch.Tensor) else [
            t for t in x if isinstance(t, torch.Tensor)]
        serials = []
        for t in tensors:
            winfo = self._WINFO.get(t.untyped_storage(), (None, None))[0]
            if winfo is not None and id(winfo) in self._serial:
                serials.append(self._serial[id(winfo)])
        return serials

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        key = id(winfo)
        if u_type == _UpdateType.ADD or key not in self._serial:
            self._serial[key] = len(self._events)
        serial = self._serial[key]
        if u_type == _UpdateType.DEL:
            del self._serial[key]
        self._events.append((u_type, serial, winfo.mem_consumed, winfo.reftype))
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    @property
    def peak(self) -> int:
        gradients = {s for _, s, _, ref in self._events if ref == _MemRefType.GRAD}
        for outputs, inputs in reversed(self._sums):  # the last sum made the .grad
            if set(outputs) & gradients:
                gradients.update(inputs)
        size: dict[int, int] = {}
        used = peak = 0
        for u_type, serial, mem, ref in self._events:
            if serial in gradients:
                continue
            if u_type == _UpdateType.DEL:
                used -= size.pop(serial, 0)
            elif u_type in (_UpdateType.ADD, _UpdateType.SIZE) and ref in _ACTIVATION:
                used += mem - size.get(serial, 0)
                size[serial] = mem
            peak = max(peak, used)
        return peak


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [t for t in values if isinstance(t, torch.Tensor)]
