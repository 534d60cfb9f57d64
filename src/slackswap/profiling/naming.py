"""What counts as an op and how activations are named: shared by the profiler and the
runtime, so a plan made from a profile finds its tensors in a real step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_leaves

__all__ = ["is_recorded", "op_kind", "is_random", "is_attention", "is_replayable", "name_kind",
           "strided_tensors", "module_path", "ForwardModules", "activation_name",
           "ActivationNamer", "module_events", "written_arguments", "byte_geometry",
           "overlap", "value_digest"]

_RANDOM = ("bernoulli", "rand", "randn", "randint", "normal", "uniform", "exponential",
           "multinomial", "native_dropout", "dropout", "randperm")
_RANDOM_OPS: dict[Any, bool] = {}  # op overload -> is_random, memoised: asked on every op


# Fused attention forward kernels: every backend returns (output, logsumexp, ...) in that
# order, so one name in ids lets a plan traced for the GPU (``fused_attention``) find the
# tensors a real step makes with whichever kernel SDPA picks there.
_ATTENTION_KERNELS = frozenset({
    "fused_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
})


# Not the model's computation: profiler ranges, and the collectives and copy-in/copy-out
# ops of DDP and FSDP2 (issued by the wrappers, never saved for backward or replayed).
_NOT_RECORDED_NAMESPACES = frozenset({"prim", "profiler", "c10d", "_c10d_functional",
                                      "_c10d_functional_autograd", "fsdp"})


def is_recorded(func: Any) -> bool:
    """Kernels, not metadata: views, detaches, aliases and prims are resolved to bases;
    profiler ranges and collectives are not the model's ops."""
    return not (func.namespace in _NOT_RECORDED_NAMESPACES or func.is_view
                or func.__name__.startswith(("detach", "alias")))


def op_kind(func: Any) -> str:
    """Short op name used in ids: ``aten.addmm.default`` -> ``addmm``."""
    return func.__name__.split(".")[0]


def is_random(func: Any) -> bool:
    """Draws from the RNG: takes a ``Generator`` argument, or is dropout-like by name."""
    random = _RANDOM_OPS.get(func)
    if random is None:
        takes_generator = any(str(a.type) == "Optional[Generator]" for a in func._schema.arguments)
        random = takes_generator or op_kind(func).rstrip("_").startswith(_RANDOM)
        _RANDOM_OPS[func] = random
    return random


# NOTE [replayable ops]
#     Recompute replays recorded ops and must get the same bits back. Only ops known to be
#     pure functions of their inputs (and of the RNG state, which the runtime replays) are
#     replayed; anything else (RNN kernels whose outputs and workspaces depend on grad mode,
#     ops whose CUDA kernels accumulate with atomics, custom ops nobody has vetted) is kept.
#     Pointwise ops (by their schema tag) and random ops are pure; the rest are listed.
_REPLAYABLE = frozenset({
    # activations whose kernels lack the pointwise tag, and fused recurrent cells
    "hardswish", "gelu", "mish", "log_sigmoid_forward", "glu", "_prelu_kernel",
    "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
    # outputs over the input's storage
    "unsafe_chunk", "unsafe_split", "unsafe_split_with_sizes", "split", "split_with_sizes",
    "nonzero",
    # matmuls and convolutions
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "matmul", "linear",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "mkldnn_convolution", "cudnn_convolution",
    "_slow_conv2d_forward", "slow_conv3d_forward", "slow_conv_transpose2d",
    "cudnn_convolution_transpose", "_nnpack_spatial_convolution",
    # attention (fused kernels draw their dropout from the replayed RNG state)
    *_ATTENTION_KERNELS, "_safe_softmax", "_softmax", "_log_softmax", "softmax",
    "log_softmax",
    # normalisations
    "native_layer_norm", "layer_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "cudnn_batch_norm", "native_group_norm", "group_norm", "_fused_rms_norm", "rms_norm",
    "_batch_norm_with_update", "_batch_norm_no_update",
    # reductions and scans
    "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "std_mean",
    "prod", "cumsum", "cumprod", "logsumexp", "norm", "linalg_vector_norm", "all", "any",
    "argmax", "argmin", "_log_softmax_backward_data",
    # data movement, indexing, construction
    "clone", "_to_copy", "copy", "copy_", "contiguous", "_unsafe_view", "cat", "stack",
    "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replicate_pad2d",
    "repeat", "repeat_interleave", "roll", "flip", "tril", "triu", "index", "index_select",
    "gather", "masked_fill", "masked_fill_", "embedding", "one_hot", "where",
    "fill", "fill_", "zero_", "arange", "ones", "zeros", "full", "ones_like", "zeros_like",
    "full_like", "new_ones", "new_zeros", "new_full", "scalar_tensor", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh_copy",
    "_unsafe_index", "expand_copy", "linspace", "eye",
    # pooling and resampling
    "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_linear1d",
    "im2col", "col2im", "pixel_shuffle", "pixel_unshuffle",
    # losses
    "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "huber_loss",
    "cross_entropy_loss", "kl_div",
    # complex numbers and dtype views that copy
    "view_as_complex_copy", "view_as_real_copy", "polar", "complex", "resolve_conj",
    "resolve_neg", "_conj_physical", "conj_physical",
})
_REPLAYABLE_OPS: dict[Any, bool] = {}  # op overload -> replayable, memoised


_WRITTEN: dict[Any, frozenset] = {}
# Batch norms whose schemas do not mark the running statistics they update (3 and 4).
_UNMARKED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4),
                    "miopen_batch_norm": (3, 4)}


def written_arguments(func: Any) -> frozenset:
    """Positions and names of the arguments an op writes, from its schema (memoised)."""
    written = _WRITTEN.get(func)
    if written is None:
        arguments = func._schema.arguments
        marked = [i for i, a in enumerate(arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        marked += _UNMARKED_WRITES.get(op_kind(func), ())
        written = frozenset(marked) | {arguments[i].name for i in marked}
        _WRITTEN[func] = written
    return written


ByteGeometry = tuple[int, tuple[int, ...], tuple[int, ...], int]
# Two views whose byte spans overlap, not both dense, are compared byte for byte over the
# union of their spans (a boolean mask); over this many bytes they are taken to overlap.
_EXACT_OVERLAP_BYTES = 1 << 28


def byte_geometry(t: torch.Tensor) -> ByteGeometry:
    """Where a view lies in its storage, in bytes: offset, sizes, strides, item size."""
    size = t.element_size()
    return (t.storage_offset() * size, tuple(t.shape), tuple(s * size for s in t.stride()),
            size)


def _span(g: ByteGeometry) -> tuple[int, int, bool]:
    offset, sizes, strides, item = g
    low = offset + sum(min(0, (n - 1) * s) for n, s in zip(sizes, strides, strict=True))
    high = offset + sum(max(0, (n - 1) * s) for n, s in zip(sizes, strides, strict=True)) + item
    count = 1
    for n in sizes:
        count *= n
    return low, high, count * item == high - low


def overlap(a: ByteGeometry, b: ByteGeometry) -> bool:
    """Whether two views of one storage share a byte. Exact (a mask over the union of
    their spans, built on the CPU whatever the views' device or mode) unless that union
    is over ``_EXACT_OVERLAP_BYTES``, where it answers yes; rare in practice: it is asked
    only of an in-place write to a storage with a saved tensor not yet read back."""
    if 0 in a[1] or 0 in b[1]:
        return False
    (la, ha, dense_a), (lb, hb, dense_b) = _span(a), _span(b)
    if ha <= lb or hb <= la:
        return False
    if dense_a or dense_b:
        return True
    low, high = min(la, lb), max(ha, hb)
    if high - low > _EXACT_OVERLAP_BYTES:
        return True
    with torch.utils._python_dispatch._disable_current_modes():
        mask = torch.zeros(high - low, dtype=torch.bool)
        marks = []
        for offset, sizes, strides, item in (a, b):
            marks.append(mask.as_strided((*sizes, item), (*strides, 1), offset - low))
        marks[0].fill_(True)
        return bool(marks[1].any())


# feature detection, not a version check: PyTorch 2.9 and later have it
_HASH = getattr(torch, "hash_tensor", None)


def value_digest(t: torch.Tensor) -> torch.Tensor | None:
    """A digest of a real tensor's values, left on the device and outside the step's
    record: ``torch.hash_tensor`` (an XOR of their bits, blind to a change that flips the
    same bits in an even number of them, as scaling all by 2 can) beside their sum in
    float64 (blind to changes that cancel), as bits. None for fake and meta tensors,
    which hold no values, and where PyTorch has no hash op."""
    if isinstance(t, FakeTensor) or t.device.type == "meta" or _HASH is None or not t.numel():
        return None
    with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
        try:
            t = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
            total = t.sum(dtype=torch.float64)
            return torch.stack([_HASH(t).view(torch.int64), total.view(torch.int64)])
        except (RuntimeError, TypeError, NotImplementedError):  # a dtype without them
            return None


def is_replayable(func: Any) -> bool:
    """Recompute may replay this op: a pure function of its inputs and the RNG state, and
    deterministic bit for bit on its device (NOTE [replayable ops])."""
    replayable = _REPLAYABLE_OPS.get(func)
    if replayable is None:
        tags = func.tags
        if func._overloadname == "out" and hasattr(func.overloadpacket, "default"):
            tags = func.overloadpacket.default.tags  # the out= variant computes the same
        replayable = (torch.Tag.pointwise in tags or is_random(func)
                      or op_kind(func).rstrip("_") in _REPLAYABLE
                      or op_kind(func) in _REPLAYABLE)
        _REPLAYABLE_OPS[func] = replayable
    return replayable


def is_attention(kind: str) -> bool:
    """A fused attention forward kernel (it draws from the RNG when it has dropout)."""
    return kind in _ATTENTION_KERNELS


def name_kind(kind: str) -> str:
    """The op kind as activation ids spell it: ``attention`` for any fused attention."""
    return "attention" if kind in _ATTENTION_KERNELS else kind


def strided_tensors(tree: Any) -> list[torch.Tensor]:
    leaves = tree_leaves(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.layout == torch.strided]


def module_path(tracker: ModTracker, root: str) -> Callable[[], str]:
    """The innermost module running now, as a path below the root model ("" at the top)."""
    prefix = root + "."

    def innermost() -> str:
        # (a set: in backward, sibling modules of equal path length can be active at
        # once, Q's and V's projections; ties go to the later name, not to hash order.
        # Only the model's own modules, as ``ForwardModules`` counts them: a module the
        # model calls but does not register, named by its class, is not a place)
        names = [p for p in tracker.parents if p.startswith(prefix)]
        path = max(names, key=lambda p: (len(p), p), default=prefix)
        return path[len(prefix):]

    return innermost


class ForwardModules:
    """The innermost module of ``model`` running in forward, by the same rule as
    :func:`module_path` over a ``ModTracker``: the longest path among the active ones.

    The runtime needs forward only. ``ModTracker`` also tracks backward, registering
    gradient hooks on every module's inputs and outputs: about 65 us a module call, where
    two global forward hooks cost a few. Modules are named as ``model.named_modules()``
    names them; a module reachable under two names takes the first.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(m): name for name, m in model.named_modules()}
        self._active: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ForwardModules:
        from torch.nn.modules import module as nn_module

        self._active.clear()
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._leave_module, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name:  # the root is the top ("")
            self._active.append(name)

    def _leave_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name and name in self._active:
            del self._active[len(self._active) - 1 - self._active[::-1].index(name)]

    def innermost(self) -> str:
        return max(self._active, key=len, default="")


@contextlib.contextmanager
def module_events(callback: Callable[..., None]) -> Iterator[None]:
    """``callback`` runs at every module call's forward pre-hook and forward hook (global
    hooks, the first of each to run): the profiler and the runtime count the same
    events, which split a forward pass into the same segments of ops."""
    from torch.nn.modules import module as nn_module

    handles = [nn_module.register_module_forward_pre_hook(callback),
               nn_module.register_module_forward_hook(callback, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def activation_name(module: str, kind: str, k: int) -> str:
    """``<module>:<op kind>:<k>``: the k-th tensor that module made with that op."""
    return f"{module or '(top)'}:{kind}:{k}"


class ActivationNamer:
    """Names each new storage of a forward pass, in production order, by
    :func:`activation_name`: the one rule the profiler and the runtime both follow, so a
    plan names what the step makes. ``kind`` is the op's short name (:func:`op_kind`)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    def __call__(self, module: str, kind: str) -> str:
        kind = name_kind(kind)
        k = self._counts.get((module, kind), 0)
        self._counts[module, kind] = k + 1
        return activation_name(module, kind, k)
