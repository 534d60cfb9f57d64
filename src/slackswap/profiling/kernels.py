"""CUDA kernel semantics for tracing on a CPU-only machine.

The analytic profiler traces on the fake CPU device, where PyTorch picks CPU kernels that
save different tensors than the GPU ones would. :class:`TargetKernels` with ``"cuda"``
rewrites the two calls where that matters, so the trace describes what the *target GPU*
runs and saves:

- ``F.scaled_dot_product_attention`` becomes one fused attention kernel (the CUDA flash
  kernel, or the memory-efficient one when a mask is passed) that saves query, key, value,
  output, logsumexp and an RNG state, even with attention dropout; its output is laid out
  ``[batch, seq, heads, dim]`` as the CUDA kernels return it, so a following
  ``transpose(1, 2).reshape(...)`` is a view, not a copy;
- ``F.dropout`` becomes ``aten.native_dropout``, the fused CUDA kernel that saves a
  1-byte boolean mask (CPU dropout saves a mask in the input dtype).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["TargetKernels", "attention_flops", "fused_attention", "fused_attention_backward"]

Tensor = torch.Tensor


def attention_flops(q: torch.Size, k: torch.Size, v: torch.Size, causal: bool) -> float:
    """Forward FLOPs of ``softmax(q k^T) v``: two batched matmuls; causal skips half."""
    *batch, sq, d = q
    sk, dv = k[-2], v[-1]
    flops = 2.0 * math.prod(batch) * sq * sk * (d + dv)
    return flops / 2 if causal else flops


@torch.library.custom_op("slackswap::fused_attention", mutates_args=())
def fused_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
    dropout_p: float, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Stand-in for the CUDA fused attention kernel; exists for tracing only."""
    raise NotImplementedError("slackswap::fused_attention only runs under FakeTensorMode")


@fused_attention.register_fake
def _(q, k, v, bias, dropout_p, is_causal, scale):
    b, h, s, _ = q.shape
    out = q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)  # CUDA layout [b, s, h, d]
    lse = q.new_empty(b, h, s, dtype=torch.float32)
    rng_state = q.new_empty(2, dtype=torch.int64)  # philox seed and offset
    return out, lse, rng_state


@torch.library.custom_op("slackswap::fused_attention_backward", mutates_args=())
def fused_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
    out: Tensor, lse: Tensor, rng_state: Tensor,
    dropout_p: float, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Stand-in for the CUDA fused attention backward kernel; exists for tracing only."""
    raise NotImplementedError("slackswap::fused_attention_backward only runs under FakeTensorMode")


@fused_attention_backward.register_fake
def _(grad_out, q, k, v, bias, out, lse, rng_state, dropout_p, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, ctx.dropout_p, ctx.is_causal, ctx.scale = inputs
    out, lse, rng_state = output
    ctx.has_bias = bias is not None
    saved = (q, k, v, out, lse, rng_state) + ((bias,) if bias is not None else ())
    ctx.save_for_backward(*saved)


def _backward(ctx, grad_out, _grad_lse, _grad_rng):
    q, k, v, out, lse, rng_state, *rest = ctx.saved_tensors
    bias = rest[0] if ctx.has_bias else None
    dq, dk, dv = fused_attention_backward(
        grad_out, q, k, v, bias, out, lse, rng_state, ctx.dropout_p, ctx.is_causal, ctx.scale
    )
    return dq, dk, dv, None, None, None, None


fused_attention.register_autograd(_backward, setup_context=_setup_context)


class TargetKernels(TorchFunctionMode):
    """Trace with the target's kernel semantics for attention and dropout.

    ``kernels="cuda"`` applies the rewrites in the module docstring; ``"native"`` keeps
    the local kernels and only applies the mask rule below.

    ``dense_masks_are_causal``: treat a dense square mask passed to SDPA as ``is_causal``.
    NOTE [value-dependent masks]: Hugging Face decides from tensor *values* whether a
    causal mask can be dropped in favour of SDPA's ``is_causal`` (no padding, no packed
    sequences). Fake tensors have no values, so it materialises a ``[b, 1, s, s]`` mask the
    real GPU run would not build. The profiler sets this flag when the real example batch
    shows no padding and the model is a causal LM; the mask ops stay in the trace, only the
    kernel choice changes.
    """

    def __init__(self, kernels: str = "cuda", dense_masks_are_causal: bool = False) -> None:
        super().__init__()
        self.cuda = kernels == "cuda"
        self.dense_masks_are_causal = dense_masks_are_causal

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func is F.dropout and self.cuda:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or p == 0.0:
            return input
        out, _mask = torch.ops.aten.native_dropout(input, p, True)
        return input.copy_(out) if inplace else out

    def _attention(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        bias = attn_mask
        square = bias is not None and bias.shape[-1] == bias.shape[-2] == query.shape[-2]
        if square and bias.dim() == 4 and self.dense_masks_are_causal:
            bias, is_causal = None, True
        if not self.cuda:
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa,
            )
        scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        if bias is not None and bias.dtype == torch.bool:
            # CUDA SDPA turns a boolean mask into an additive bias in the query dtype.
            bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(~bias, -math.inf)
        out, _lse, _rng = fused_attention(query, key, value, bias, dropout_p, is_causal, scale)
        return out
