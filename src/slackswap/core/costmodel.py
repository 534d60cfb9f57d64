"""Roofline time of the ops of a step on a hardware preset, with size-dependent efficiency
tables, and the software stack that decides which memory-bound ops are separate kernels."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from slackswap.core.hardware import Hardware
from slackswap.core.profile import OpRecord, TensorRecord

__all__ = ["OpDetail", "op_time", "step_efficiency", "step_times", "unaligned"]


def step_efficiency(table: list[tuple[float, float]], size: float) -> float:
    """Efficiency of the row with the largest threshold <= ``size`` (tables start at 0)."""
    return table[max(bisect_right([row[0] for row in table], size) - 1, 0)][1]


@dataclass(frozen=True)
class OpDetail:
    """What the profiler saw of one op beyond its record: the bytes it read of each input
    tensor and wrote of each output (by tensor id), and whether an attention kernel ran
    with a causal mask. The fused stack prices runs of ops from it (NOTE [stacks])."""

    reads: dict[int, int] = field(default_factory=dict)
    writes: dict[int, int] = field(default_factory=dict)
    causal: bool = False


def _memory_s(moved: float, hw: Hardware) -> float:
    m = hw.memory
    return moved / (m.hbm_bandwidth * step_efficiency(m.bandwidth_efficiency, moved))


# NOTE [unaligned matmuls]
#     cuBLAS runs its fast tensor-core GEMMs only when each dimension of the product (M,
#     N, K) is a multiple of 16 bytes of elements (8 in bf16 or fp16); otherwise it falls
#     back to kernels that load as many elements at a time as the dimensions allow.
#     GPT-2's vocabulary, 50257, is odd, so the LM head's three GEMMs load one: on the
#     H200 trace of gpt2-xl@12 (docs/results-gpu/traces/, docs/fidelity.md "Op by op on
#     the H200") they ran CUTLASS's Turing kernels (``cutlass_75_tensorop_bf16_s1688gemm_
#     *_align1``) at 95 to 141 TFLOP/s, where every other GEMM of the step ran Hopper
#     kernels at 630 to 820. A preset's ``matmul_unaligned_efficiency`` caps such a
#     matmul: mm, addmm, bmm or baddbmm in a 2-byte dtype (the measurement is bf16) with
#     an odd dimension (the alignment the measurement saw). A dimension even but not a
#     multiple of 8 (BERT's vocabulary, 30522) gets kernels of two or four elements a
#     load, not measured, and is priced as aligned; so is every matmul on a preset
#     without the figure. The dimensions are the output's last two and K from the FLOPs.
_GEMMS = ("mm", "addmm", "bmm", "baddbmm")


def unaligned(op: OpRecord, tensors: Sequence[TensorRecord]) -> bool:
    """A 2-byte GEMM with M, N or K odd (NOTE [unaligned matmuls])."""
    if op.kind not in _GEMMS or op.dtype not in ("bf16", "fp16") or not op.outputs:
        return False
    shape = tensors[op.outputs[0]].shape
    if len(shape) < 2 or not all(shape):
        return False
    batch = 1
    for d in shape[:-2]:
        batch *= d
    m, n = shape[-2], shape[-1]
    k = op.flops / (2 * batch * m * n)
    if k < 1 or k != int(k):  # not a plain product: leave it as it was priced
        return False
    return any(d % 2 for d in (m, n, int(k)))


def op_time(op: OpRecord, hw: Hardware, *, causal: bool = False,
            aligned: bool = True) -> float:
    """Seconds ``op`` takes on ``hw`` as a kernel of its own: the slower of its compute and
    memory roofs. ``causal``: an attention kernel ran with a causal mask (its FLOPs are
    already halved; the preset says how much of the peak such a kernel reaches).
    ``aligned``: false for a matmul :func:`unaligned` finds so, which runs at most at the
    preset's ``matmul_unaligned_efficiency`` where it has one.

    Every kernel takes at least the preset's minimum kernel time; views and bare
    allocations launch no kernel and take none.
    """
    if op.category == "free":
        return 0.0
    c = hw.compute
    memory_s = _memory_s(op.bytes_read + op.bytes_written, hw)
    if op.category == "matmul":
        eff = min(step_efficiency(c.matmul_efficiency, op.flops), c.matmul_efficiency_cap)
        if not aligned and c.matmul_unaligned_efficiency is not None:
            eff = min(eff, c.matmul_unaligned_efficiency)
    elif op.category == "attention_forward":
        eff = (c.attention_causal_forward_efficiency if causal else None) or (
            c.attention_forward_efficiency)
    elif op.category == "attention_backward":
        eff = (c.attention_causal_backward_efficiency if causal else None) or (
            c.attention_backward_efficiency)
    else:  # memory-bound: elementwise and reductions are priced by bytes moved
        eff = 0.0
    compute_s = op.flops / (hw.peak(op.dtype) * eff) if eff > 0 else 0.0
    return max(compute_s, memory_s, c.min_kernel_time_s)


# NOTE [stacks]
#     Which memory-bound ops run as kernels of their own depends on the software stack,
#     ``Hardware.stack``:
#     - ``eager`` (the default; the product's runtime runs models eagerly): every aten op
#       the profiler records is one kernel that reads its inputs from HBM and writes its
#       outputs back.
#     - ``fused``: each run of consecutive memory-bound ops of one phase, between two
#       compute kernels (matmul, attention), is one kernel, as a fusing compiler
#       (TorchInductor, nvFuser) generates for pointwise and reduction ops. It reads each
#       tensor that comes from outside the run once, and writes only what outlives it:
#       tensors autograd saves, tensors read by an op outside the run, model state
#       (gradients, parameters, buffers) and tensors it changes in place that were made
#       before it. Intermediates used only inside the run never reach HBM. It is the
#       most a compiler can fuse between compute kernels: a stack that fuses only some
#       patterns by hand lies between the two. Saved tensors stay as eager autograd saves
#       them (a compiler may recompute some instead).
#     The run's time is one kernel's (its bytes at the preset's bandwidth for that size,
#     at least one minimum kernel time), shared among its ops in proportion to their
#     eager memory times, so a plan that recomputes part of a run pays its share. Views
#     and allocations take no time in either stack.
def step_times(ops: Sequence[OpRecord], tensors: Sequence[TensorRecord], hw: Hardware,
               details: Sequence[OpDetail] | None = None) -> list[float]:
    """Seconds each op of a step takes on ``hw`` under its stack (NOTE [stacks]);
    ``details`` (one per op, from the profiler) give the causal flag of attention kernels
    and the per-tensor bytes the fused stack needs; without them ops are priced eagerly
    and attention as non-causal."""
    if details is not None and len(details) != len(ops):
        raise ValueError(f"{len(details)} op details for {len(ops)} ops")
    causal = [d.causal for d in details] if details is not None else [False] * len(ops)
    times = [op_time(op, hw, causal=c, aligned=hw.compute.matmul_unaligned_efficiency is None
                     or not unaligned(op, tensors))
             for op, c in zip(ops, causal, strict=True)]
    if hw.stack == "eager" or details is None:
        return times
    for run in _memory_runs(ops):
        _price_run(run, ops, tensors, hw, details, times)
    return times


def _memory_runs(ops: Sequence[OpRecord]) -> list[list[int]]:
    """Maximal runs of memory-bound ops (views and allocations inside them) of one phase
    between compute kernels; only runs of two or more kernels fuse anything."""
    runs: list[list[int]] = []
    current: list[int] = []
    for i, op in enumerate(ops):
        if op.category in ("memory", "free") and (not current
                                                  or ops[current[0]].phase == op.phase):
            current.append(i)
            continue
        runs.append(current)
        current = [i] if op.category in ("memory", "free") else []
    runs.append(current)
    return [r for r in runs if sum(ops[i].category == "memory" for i in r) > 1]


_STATE = ("gradient", "parameter", "buffer")  # model state: always written


def _price_run(run: list[int], ops: Sequence[OpRecord], tensors: Sequence[TensorRecord],
               hw: Hardware, details: Sequence[OpDetail], times: list[float]) -> None:
    inside = set(run)
    reads: dict[int, int] = {}
    writes: dict[int, int] = {}
    for i in run:
        if ops[i].category == "free":
            continue
        for tid, nbytes in details[i].reads.items():
            if tensors[tid].producer not in inside:
                reads[tid] = max(reads.get(tid, 0), nbytes)
        for tid, nbytes in details[i].writes.items():
            t = tensors[tid]
            outlives = (t.producer not in inside or t.saved or t.kind in _STATE
                        or any(c not in inside
                               for c in (*t.forward_consumers, *t.backward_consumers)))
            if outlives:
                writes[tid] = max(writes.get(tid, 0), nbytes)
    kernel_s = max(_memory_s(sum(reads.values()) + sum(writes.values()), hw),
                   hw.compute.min_kernel_time_s)
    members = [i for i in run if ops[i].category == "memory"]
    weights = [_memory_s(ops[i].bytes_read + ops[i].bytes_written, hw) for i in members]
    total = sum(weights)
    for i, w in zip(members, weights, strict=True):
        times[i] = kernel_s * (w / total if total > 0 else 1 / len(members))
