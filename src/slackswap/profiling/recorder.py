"""Records every aten op and every tensor autograd saves during one training step.

One :class:`StepRecorder` is the ``TorchDispatchMode`` (ops, inputs, outputs, FLOPs,
bytes), the ``saved_tensors_hooks`` pair (what is saved, which backward op first needs
it) and the clock (measured mode). Tensors are identified by storage, so a view resolves
to its base and each saved storage is counted once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from slackswap.core.costmodel import OpDetail
from slackswap.core.profile import OpCategory, OpRecord, TensorKind, TensorRecord
from slackswap.errors import NESTED_BACKWARD, InputError
from slackswap.profiling.kernels import attention_flops
from slackswap.profiling.naming import (
    byte_geometry,
    is_random,
    is_recorded,
    is_replayable,
    op_kind,
    overlap,
    strided_tensors,
    value_digest,
    written_arguments,
)

__all__ = ["StepRecorder", "dtype_name", "op_category", "op_flops"]

_DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "int64", torch.int32: "int32", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool", torch.uint64: "uint64",
}
# Ops that allocate or reinterpret memory without launching a kernel. ``_unsafe_view`` is
# a view that autograd does not track as one (matmul folds and unfolds batch dimensions
# with it): its output shares its input's storage, so it moves no bytes.
_FREE = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "resize_", "set_",
    "_unsafe_view",
}
# Fused attention kernels: kind -> positions of the query, ``is_causal`` and ``dropout_p``
# arguments (``None`` where a kernel takes no dropout).
_ATTENTION = {
    "fused_attention": (0, 5, 4),
    "fused_attention_backward": (1, 9, None),
    "_scaled_dot_product_flash_attention_for_cpu": (0, 4, 3),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (1, 7, None),
    "_scaled_dot_product_flash_attention": (0, 4, 3),
    "_scaled_dot_product_flash_attention_backward": (1, 11, None),
    "_scaled_dot_product_efficient_attention": (0, 6, 5),
    "_scaled_dot_product_efficient_attention_backward": (1, 11, None),
    "_scaled_dot_product_cudnn_attention": (0, 6, 5),
    "_scaled_dot_product_cudnn_attention_backward": (1, 14, None),
}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"}
# FlashAttention's backward recomputes q k^T and runs five matmuls to the forward's two.
_ATTENTION_BACKWARD_RATIO = 2.5


def _attention_dropout(kind: str, args: tuple) -> float:
    position = _ATTENTION[kind][2] if kind in _ATTENTION else None
    if position is None or len(args) <= position:
        return 0.0
    return float(args[position])


def _attention_causal(kind: str, args: tuple, kwargs: dict) -> bool:
    """An attention kernel's ``is_causal`` argument; False for any other op."""
    if kind not in _ATTENTION:
        return False
    position = _ATTENTION[kind][1]
    return bool(args[position]) if len(args) > position else bool(kwargs.get("is_causal"))


def _by_tensor(ids: list[int], nbytes: list[int]) -> dict[int, int]:
    """Bytes per tensor id (a tensor passed twice counts once, at its larger size)."""
    out: dict[int, int] = {}
    for tid, n in zip(ids, nbytes, strict=True):
        out[tid] = max(out.get(tid, 0), n)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class StepRecorder(TorchDispatchMode):
    """Collects ``OpRecord`` and ``TensorRecord`` entries for one step.

    ``module_path`` returns the innermost module running now; ``clock``, when given, times
    one op call (measured mode) and returns ``(output, seconds)``.
    """

    def __init__(
        self,
        module_path: Callable[[], str],
        clock: Callable[[Callable[[], Any]], tuple[Any, float]] | None = None,
    ) -> None:
        super().__init__()
        self.module_path = module_path
        self.clock = clock
        self.lifetimes = False  # NOTE [held until let go]
        self.phase = "forward"
        self.ops: list[OpRecord] = []
        self.tensors: list[TensorRecord] = []
        self.details: list[OpDetail] = []  # one per op, for the cost model
        self._ids: dict[int, tuple[StorageWeakRef, int]] = {}
        self._unpacked: list[int] = []
        # forward only: the tensor saved at each pack with the ops run before it, and the
        # ops run before each module hook fired (StepProfile.saves, .module_events)
        self.saves: list[tuple[int, int]] = []
        self.model_saves: int | None = None  # saves made by when the model returned
        self.module_events: list[int] = []
        # NOTE [written after it was saved]: saves not yet read back, by storage
        self._live: dict[int, list[_LiveSave]] = {}
        self._digests: list[tuple[_LiveSave, torch.Tensor]] = []
        # NOTE [held until let go]: activations an op made that are still alive
        self._alive: dict[int, StorageWeakRef] = {}
        # NOTE [dropped by the program]: saved storage -> (its activations, our aliases)
        self._held: dict[int, list[Any]] = {}

    def module_event(self, *args: Any) -> None:
        """A global module forward pre- or post-hook: how many ops ran before it."""
        if self.phase == "forward":
            self.module_events.append(len(self.ops))

    # -- tensor identity -------------------------------------------------------------
    def register(self, tensor: torch.Tensor, kind: TensorKind, name: str) -> int:
        """Name ``tensor``'s storage up front: parameters, buffers and batch inputs."""
        tid = self._id(tensor, kind, None)
        if self.tensors[tid].name is None:  # tied weights keep their first name
            self.tensors[tid].name = name
        return tid

    def _id(self, t: torch.Tensor, kind: TensorKind, producer: int | None) -> int:
        storage = t.untyped_storage()
        key = storage._cdata
        known = self._ids.get(key)
        if known is not None and not known[0].expired():
            return known[1]
        tid = len(self.tensors)
        # NOTE: holding the weak reference keeps the StorageImpl's address from being reused
        # while the trace runs, so ``_cdata`` keys never collide.
        self._ids[key] = (StorageWeakRef(storage), tid)
        self.tensors.append(
            TensorRecord(
                id=tid, kind=kind, bytes=storage.nbytes(), dtype=dtype_name(t.dtype),
                shape=list(t.shape), producer=producer,
            )
        )
        return tid

    def mark_gradient(self, grad: torch.Tensor, param: torch.Tensor) -> None:
        """``grad`` is a weight gradient of ``param`` (arriving at, or stored as, its
        ``.grad``): model state, so it leaves activation memory. A storage larger than the
        parameter (a gradient that is a view into an activation gradient) stays as it is.
        A sparse gradient (``nn.Embedding(sparse=True)``) has no storage of its own: its
        indices and values do; other layouts are left as they are."""
        if grad.layout == torch.sparse_coo:
            parts = [grad._indices(), grad._values()]
        elif grad.layout == torch.strided:
            parts = [grad]
        else:
            return
        limit = param.untyped_storage().nbytes()
        for part in parts:
            known = self._ids.get(part.untyped_storage()._cdata)
            if known is not None and not known[0].expired():
                self._mark_gradient(known[1], limit)

    def _mark_gradient(self, tid: int, limit: int) -> None:
        record = self.tensors[tid]
        if record.kind != "activation" or record.producer is None or record.bytes > limit:
            return
        if self.ops[record.producer].phase != "backward":
            return
        record.kind = "gradient"
        # the gradients autograd summed into it: a parameter used twice (tied weights)
        for index in (record.producer, *record.backward_consumers):
            op = self.ops[index]
            if op.kind in ("add", "add_") and tid in op.outputs:
                for other in op.inputs:
                    self._mark_gradient(other, limit)

    # -- saved_tensors_hooks ------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> tuple[int | None, torch.Tensor]:
        if t.layout != torch.strided:  # sparse and other layouts: no storage to plan
            if self.phase == "forward":
                self.saves.append((-1, len(self.ops)))
            return None, t
        tid = self._id(t, "input", None)
        self.tensors[tid].saved = True
        if self.phase == "forward":
            self.saves.append((tid, len(self.ops)))
        storage = t.untyped_storage()
        live = _LiveSave(tid, byte_geometry(t), storage._cdata, value_digest(t))
        self._live.setdefault(storage._cdata, []).append(live)
        if self.lifetimes and self.phase == "forward":
            # NOTE [dropped by the program]: autograd's hold is an alias of our own, so
            # the storage's other holders are the program's
            with torch.utils._python_dispatch._disable_current_modes():
                alias = t.detach()
            held = self._held.setdefault(storage._cdata, [[], 0])
            held[0].append(tid)
            held[1] += 1
            return tid, alias, live, weakref.ref(t)
        return tid, t, live

    def unpack(self, packed: tuple[int | None, torch.Tensor, Any]) -> torch.Tensor:
        if packed[0] is not None:
            self._unpacked.append(packed[0])
            live, t = packed[2], packed[1]
            if len(packed) > 3 and (program := packed[3]()) is not None:
                t = program  # as autograd holds it (``.data = ...`` changes it)
            if not live.read:
                live.read = True
                if t.untyped_storage()._cdata != live.storage:  # ``.data = ...``
                    self.tensors[live.tensor].written_after_save = True
                elif live.digest is not None:
                    self._digests.append((live, value_digest(t)))
            return t
        return packed[1]

    def _let_go(self) -> None:
        """NOTE [held until let go]
            Memory is freed when the step lets go of a storage, not after the last op
            that reads it: autograd holds what a backward node unpacked until the node
            is done (BmmBackward reads one input in each of its two matmuls and lets go
            of both after the second), and the zero gradient it makes for an output
            that has none (a custom Function's integer output) until the node's backward
            returns, though no op reads it. So before each op the recorder looks at
            which activations have died since the last one, and one that outlived its
            last read is marked ``released_after`` the op before. Real steps only
            (measured, traced) for now: the analytic profiles of the presets are what the
            exact model's stored optima were solved for (``tests/data/exact_optima.json``),
            and solving them again takes hours."""
        dead = [tid for tid, ref in self._alive.items() if ref.expired()]
        if dead:
            self._released(dead, len(self.ops) - 1)

    def dropped(self) -> None:
        """NOTE [dropped by the program]
            A plan that offloads or drops a saved activation frees its memory only once
            the program lets go of it too: a forward that keeps a tensor in a local
            variable (the CPU GRU keeps its initial hidden state until it returns) holds
            it whatever autograd does. In a real step the recorder packs an alias of
            each saved tensor, so a storage held by more than those aliases is held by
            the program; before each forward op, and once as backward begins, a storage
            the program has let go of marks its saved activations ``dropped_after`` the
            op before. One still held when backward begins has no such op: a plan's
            device memory for it lasts through forward."""
        use_count = torch._C._storage_Use_Count
        # our aliases, and the storage's Python object (kept while the storage lives,
        # once ``untyped_storage()`` has made it, as ``pack`` did)
        gone = [key for key, (_, aliases) in self._held.items()
                if use_count(key) <= aliases + 1]
        last = len(self.ops) - 1
        for key in gone:
            for tid in self._held.pop(key)[0]:
                self.tensors[tid].dropped_after = max(last, self.tensors[tid].producer or 0)

    def end_forward(self) -> None:
        """Backward begins: what the program let go of by now is marked, the rest held
        through forward (NOTE [dropped by the program])."""
        self.dropped()
        self._held.clear()
        self.phase = "backward"

    def _released(self, tids: list[int], last: int) -> None:
        for tid in tids:
            del self._alive[tid]
            t = self.tensors[tid]
            read = max([t.producer or 0, *t.forward_consumers, *t.backward_consumers,
                        *(() if t.first_backward_use is None else (t.first_backward_use,))])
            if last > read:
                t.released_after = last

    def finish(self) -> None:
        """After backward: a saved tensor whose bytes changed between its save and its
        first read back, by no op the step recorded (NumPy's writes through a shared
        buffer), is marked too (NOTE [written after it was saved]). One comparison for
        the whole step, so backward is not stopped at every read."""
        if self.lifetimes:  # NOTE [held until let go]: held to the step's end
            self._released([tid for tid in self._alive if self.tensors[tid].kind
                            == "activation"], len(self.ops) - 1)
        pairs, self._digests = self._digests, []
        if not pairs:
            return
        with torch.utils._python_dispatch._disable_current_modes():
            by_device: dict[torch.device, list[tuple[_LiveSave, torch.Tensor]]] = {}
            for live, now in pairs:
                by_device.setdefault(now.device, []).append((live, now))
            for group in by_device.values():
                before = torch.stack([live.digest for live, _ in group])
                after = torch.stack([now for _, now in group])
                changed_rows = (before != after).any(dim=1).tolist()
                for (live, _), changed in zip(group, changed_rows, strict=True):
                    if changed:
                        self.tensors[live.tensor].written_after_save = True

    def _before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """NOTE [written after it was saved]
            Autograd reads a saved tensor's storage as it is when backward unpacks it. A
            write to it after the save either makes backward fail (autograd's version
            check) or, when autograd cannot see it (through ``.data``, ``set_``, an
            unsafe view, a NumPy array over the storage), changes what backward reads.
            Moved, the tensor would come back as it was at the save: no error, or another
            gradient. So the profile marks every saved activation that an op writes
            (bytes of it, exactly: :func:`overlap`) after its save and before backward
            first reads it back, and no plan moves it: kept, it fails or reads what
            plain PyTorch does. Writes by no op at all (NumPy's, after forward) are not
            seen here; see NOTE [inputs read by rebuilds] for the batch."""
        written = written_arguments(func)
        for position, x in (*enumerate(args), *kwargs.items()):
            if position not in written or not isinstance(x, torch.Tensor) \
                    or x.layout != torch.strided:
                continue
            saves = self._live.get(x.untyped_storage()._cdata)
            if not saves:
                continue
            # ``set_`` and ``resize_`` change which bytes the tensor is: all of it counts
            where = None if op_kind(func) in ("set_", "resize_") else byte_geometry(x)
            for live in saves:
                if not live.read and (where is None or overlap(where, live.geometry)):
                    self.tensors[live.tensor].written_after_save = True

    # -- dispatch --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_recorded(func):
            return func(*args, **kwargs)
        if self.phase == "forward" and torch._C._current_graph_task_id() != -1:
            raise InputError(NESTED_BACKWARD)
        if self.lifetimes:
            if self._alive:
                self._let_go()
            if self._held and self.phase == "forward":
                self.dropped()
        inputs = strided_tensors((args, kwargs))
        in_ids = [self._id(t, "input", None) for t in inputs]
        if self._live and func._schema.is_mutable:
            self._before_write(func, args, kwargs)
        if self.clock is None:
            out, seconds = func(*args, **kwargs), 0.0
        else:
            out, seconds = self.clock(lambda: func(*args, **kwargs))
        index = len(self.ops)
        kind = op_kind(func)
        outputs = strided_tensors(out)
        out_ids = [self._id(t, "activation", index) for t in outputs]
        if self.lifetimes:
            for t, tid in zip(outputs, out_ids, strict=True):
                if self.tensors[tid].producer == index and tid not in self._alive:
                    self._alive[tid] = StorageWeakRef(t.untyped_storage())
        random = is_random(func) or _attention_dropout(kind, args) > 0
        floats = [t.dtype for t in inputs + outputs if t.is_floating_point()]
        read = [min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                for t in inputs]
        written = [t.numel() * t.element_size() for t in outputs]
        self.ops.append(
            OpRecord(
                index=index, name=str(func), kind=kind, phase=self.phase,
                module=self.module_path(), category=op_category(kind),
                dtype=dtype_name(floats[0]) if floats else "fp32",
                flops=op_flops(func, kind, args, kwargs, out),
                bytes_read=sum(read), bytes_written=sum(written),
                time_s=seconds, inputs=in_ids, outputs=out_ids, random=random,
                inplace=func._schema.is_mutable, replayable=is_replayable(func),
            )
        )
        self.details.append(OpDetail(reads=_by_tensor(in_ids, read),
                                     writes=_by_tensor(out_ids, written),
                                     causal=_attention_causal(kind, args, kwargs)))
        consumers = "forward_consumers" if self.phase == "forward" else "backward_consumers"
        for tid in dict.fromkeys(in_ids):
            getattr(self.tensors[tid], consumers).append(index)
        if random:
            for tid in out_ids:
                self.tensors[tid].random = True
        for tid in self._unpacked:
            record = self.tensors[tid]
            if record.first_backward_use is None:
                record.first_backward_use = index
        self._unpacked.clear()
        return out


class _LiveSave:
    """One save of the step: which tensor, where in its storage (and which storage), a
    digest of its bytes then, and whether backward has read it back yet (NOTE [written
    after it was saved])."""

    __slots__ = ("tensor", "geometry", "storage", "digest", "read")

    def __init__(self, tensor: int, geometry: Any, storage: int,
                 digest: torch.Tensor | None) -> None:
        self.tensor, self.geometry, self.storage, self.digest = tensor, geometry, storage, digest
        self.read = False


def op_category(kind: str) -> OpCategory:
    """How the cost model prices an op of this kind (its short name)."""
    if kind in _FREE:
        return "free"
    if kind in _ATTENTION:
        return "attention_backward" if kind.endswith("backward") else "attention_forward"
    if kind in _MATMUL or "convolution" in kind:
        return "matmul"
    return "memory"


def op_flops(func: Any, kind: str, args: Any, kwargs: Any, out: Any) -> float:
    """FLOPs of one op from its (real or fake) arguments and output."""
    if kind in _ATTENTION:
        qi = _ATTENTION[kind][0]
        q, k, v = args[qi:qi + 3]
        causal = _attention_causal(kind, args, kwargs)
        flops = attention_flops(q.shape, k.shape, v.shape, causal)
        return flops * _ATTENTION_BACKWARD_RATIO if kind.endswith("backward") else flops
    counter = flop_registry.get(func.overloadpacket)
    if counter is None:
        return 0.0
    try:
        return float(counter(*args, **kwargs, out_val=out))
    except Exception:  # a counter that cannot read these arguments counts nothing
        return 0.0
