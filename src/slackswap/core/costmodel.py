"""Roofline time of the ops of a step on a hardware preset, with size-dependent efficiency
tables, and the software stack that decides which memory-bound ops are separate kernels."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from slackswap.core.hardware import Compute, Hardware
from slackswap.core.profile import OpRecord, TensorRecord

__all__ = ["OpDetail", "op_time", "step_efficiency", "step_times", "unaligned", "attention_seq",
           "REDUCTIONS", "ATTENTION_BLOCK", "kernel_bytes", "unvectorized_elements",
           "random_elements"]


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


# NOTE [reductions]
#     A reduction kernel (a sum or mean over a dimension, LayerNorm and its backward)
#     reads a tensor to write a smaller one, and does not stream HBM as an elementwise
#     kernel does: each row or column is a dependent chain of loads, partial
#     sums and block-wide synchronisations, so fewer bytes are in flight at a time. On the
#     H200 trace of gpt2-xl@12 (docs/results-gpu/traces/, docs/fidelity.md "Op by op on
#     the H200") LayerNorm forward (vectorized_layer_norm_kernel, rows of 1600) ran at
#     1.77 TB/s and the bias gradients' column sums (reduce_kernel) at 1.35 TB/s (10-100
#     MB) and 2.52 TB/s (105 MB), where elementwise kernels of those sizes ran at 2.6 to
#     4.5 TB/s. A preset's ``reduction_bandwidth_efficiency`` (a step table by bytes moved,
#     as ``bandwidth_efficiency``) prices these ops; without one they are priced as
#     elementwise ops, as before.
#     Passes: LayerNorm's backward is two kernels on CUDA, one for the input's gradient
#     (layer_norm_grad_input_kernel) and one for the weight's and bias's
#     (GammaBetaBackwardCUDAKernel), and each reads the input and the output's gradient:
#     on the trace, 28.6 + 44.8 us for 52 MB read twice and 26 MB written, 1.79 TB/s
#     counted so, the rate of LayerNorm's forward. A reduction table's rates are per pass,
#     so with one such an op reads its inputs ``_PASSES`` times. Under the fused stack a
#     reduction inside a run of memory-bound ops is priced with its run (NOTE [stacks]).
#     Left out, priced as before: softmax and log-softmax (on the trace the loss's
#     log-softmax ran at 0.46 of HBM bandwidth forward and 0.59 backward, between this
#     table and the elementwise one: a row of 50257 streams as an elementwise op does),
#     and the embedding's backward (a sort and a scatter-add, not a reduction kernel).
REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "linalg_vector_norm",
    "var", "var_mean", "std", "std_mean", "native_layer_norm", "native_layer_norm_backward",
    "_fused_rms_norm", "_fused_rms_norm_backward"})
_PASSES = {"native_layer_norm_backward": 2}


def _reduction_s(op: OpRecord, hw: Hardware) -> float:
    """A reduction's memory time on a preset with a reduction table (NOTE [reductions])."""
    table = hw.memory.reduction_bandwidth_efficiency
    assert table is not None
    moved = op.bytes_read * _PASSES.get(op.kind, 1) + op.bytes_written
    return moved / (hw.memory.hbm_bandwidth * step_efficiency(table, moved))


# NOTE [kernel passes]
#     Some CUDA kernels move other bytes than the op's record, which counts each input
#     read and each output written once. Read from PyTorch's kernels and checked on the
#     H200 trace of gpt2-xl@12 (docs/results-gpu/traces/, docs/fidelity.md "Op by op on
#     the H200"); a preset prices them so where its ``kernel_passes`` is true (h200), by
#     the records' bytes elsewhere. The kernels are the same on other CUDA GPUs, but no
#     trace checked them there, and turning it on for a100-80gb or h100-sxm changes the
#     profiles that tests/test_exact.py's stored optima and tests/test_plan.py's plans
#     were made for (benchmarks/exact_gap.py regenerates the optima, for hours):
#     - Softmax and log-softmax over rows longer than a block's default shared memory
#       (48 KiB) run ``cunn_SoftMaxForward`` (aten/src/ATen/native/cuda/SoftMax.cu), one
#       block a row, which reads the row three times: for its maximum, for the sum of
#       exponentials, and to write the output. The backward (``cunn_SoftMaxBackward``)
#       reads the output's gradient twice, to sum it and to write the input's gradient.
#       On the trace, over rows of 50257 fp32: forward 1.49 ms for 4 x 1.65 GB (4.4 TB/s
#       counted so) and backward 1.75 ms for 4 x 1.65 GB (3.8 TB/s), where the
#       elementwise kernels of that size ran at 3.4 to 4.5 TB/s. Shorter rows stay in
#       registers or shared memory and are read once.
#     - ``nll_loss_forward`` reads one log-probability a row (a 32-byte sector of HBM)
#       and the targets, not the whole input: on the trace 19 us, where a full read of
#       its 1.65 GB was priced at 0.38 ms. Its kernel is one thread block
#       (``nll_loss_forward_reduce_cuda_kernel_2d``), slower than its bytes say; its
#       launch floor prices it, 18 us short.
#     - ``nll_loss_backward`` writes the input's gradient: a zero fill of all of it
#       (``FillFunctor``), then one value a row. It reads the targets, not the
#       log-probabilities: on the trace 0.37 ms for the 1.65 GB it writes (4.5 TB/s).
_SOFTMAX_SHARED = 48 * 1024  # bytes of shared memory a block gets without opting in
_SECTOR = 32  # bytes: the least HBM reads to fetch one scattered element
_ITEMSIZE = {"fp64": 8, "int64": 8, "fp32": 4, "int32": 4, "bf16": 2, "fp16": 2,
             "int16": 2, "bool": 1, "uint8": 1, "int8": 1}


def _numel(t: TensorRecord) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def _long_rows(t: TensorRecord) -> bool:
    """A softmax over ``t``'s last dimension runs the multi-pass kernel (NOTE [kernel
    passes])."""
    return bool(t.shape) and t.shape[-1] * _ITEMSIZE.get(t.dtype, 4) > _SOFTMAX_SHARED


def kernel_bytes(op: OpRecord, tensors: Sequence[TensorRecord]) -> float | None:
    """Bytes ``op``'s CUDA kernels move where they are not its record's (NOTE [kernel
    passes]); None where they are."""
    ins = [tensors[i] for i in op.inputs]
    if op.kind in ("_softmax", "_log_softmax") and ins and _long_rows(ins[0]):
        return 3 * op.bytes_read + op.bytes_written
    if op.kind in ("_softmax_backward_data", "_log_softmax_backward_data") \
            and ins and _long_rows(ins[0]):
        return op.bytes_read + ins[0].bytes + op.bytes_written
    targets = [t for t in ins if t.dtype == "int64"]
    if op.kind == "nll_loss_forward" and targets:
        return _numel(targets[0]) * (_SECTOR + 8) + op.bytes_written
    if op.kind == "nll_loss_backward" and targets:
        return targets[0].bytes + op.bytes_written
    return None


# NOTE [unvectorized kernels]
#     PyTorch's elementwise kernels (TensorIterator, aten/src/ATen/native/cuda/
#     CUDALoops.cuh) load 16 bytes a thread at a time only where every operand is
#     contiguous and of the kernel's own dtype. Otherwise they run
#     ``unrolled_elementwise_kernel`` (a cast on load) or ``elementwise_kernel`` (an
#     offset computed per element and operand, for a broadcast operand), one element a
#     load, bound by the per-element work rather than by HBM. Two such ops, both priced
#     here:
#     - a copy that changes dtype, except fp32 to bf16 or fp16, which Copy.cu
#       special-cases with a vectorized kernel (``bfloat16_copy_kernel_cuda``): a bf16 to
#       fp32 upcast, as of the logits before the loss and inside Llama's RMSNorm;
#     - a pointwise op with a broadcast operand (an input with fewer elements than the
#       output: GPT-2's position embedding added over the batch, Llama's RMSNorm scales
#       and rotary embedding).
#     On the H200 trace of gpt2-xl@12 (docs/results-gpu/traces/) the logits' upcast (412
#     M elements, 2.47 GB) ran in 1.20 ms, 2.05 TB/s, where the fp32 to bf16 copy back of
#     the same size ran the vectorized kernel in 0.56 ms, 4.42 TB/s; the position
#     embedding's broadcast add (13.1 M elements, 56 MB) in 35 us, 1.58 TB/s, where the
#     residual adds ran at 4.0 TB/s. Counted in elements, both ran at the same rate, 342
#     and 371 G elements/s: a preset's ``unvectorized_elements_per_s`` (pooled, 343e9
#     on h200) prices such an op at the slower of its bytes and its elements at that
#     rate; without one it is priced by its bytes, as before. A non-contiguous operand
#     that is not a broadcast (a slice's view) also runs the slow kernels; the profile
#     resolves views to their bases and cannot see it, so it is priced by its bytes.
_CASTS_VECTORIZED = {("fp32", "bf16"), ("fp32", "fp16")}
_COPIES = ("_to_copy", "copy", "copy_")
POINTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh",
    "sigmoid", "silu", "silu_backward", "gelu", "gelu_backward", "relu", "where",
    "masked_fill", "maximum", "minimum", "clamp", "reciprocal", "sigmoid_backward",
    "tanh_backward", "threshold_backward", "eq", "ne", "lt", "le", "gt", "ge",
    "bitwise_and", "bitwise_or", "logical_and", "logical_or"})


def unvectorized_elements(op: OpRecord, tensors: Sequence[TensorRecord]) -> int:
    """The elements ``op`` writes one a load (NOTE [unvectorized kernels]); 0 where its
    kernel is vectorized."""
    if op.category != "memory" or not op.outputs or not op.inputs:
        return 0
    kind = op.kind.rstrip("_")  # in place as out of place
    out = tensors[op.outputs[0]]
    n = _numel(out)
    if kind in _COPIES:
        src = tensors[op.inputs[-1]]
        cast = src.dtype != out.dtype and (src.dtype, out.dtype) not in _CASTS_VECTORIZED
        return n if cast else 0
    if kind in POINTWISE and any(_numel(tensors[i]) < n for i in op.inputs):
        return n
    return 0


# NOTE [random kernels]
#     Dropout's forward (``fused_dropout_kernel_vec``) draws a Philox random number for
#     every element it writes, ten rounds of 32-bit multiplies and xors for four numbers,
#     and is bound by that arithmetic rather than by HBM: on the H200 trace of gpt2-xl@12
#     (docs/results-gpu/traces/, docs/fidelity.md "Op by op on the H200") its 25 kernels
#     wrote 25 x 13.1 M elements (with their masks, 65.5 MB each) in 0.62 ms, 528 G
#     elements/s and 2.64 TB/s, where the elementwise kernels of that size ran at 4.0 to
#     4.5 TB/s. A preset's ``random_elements_per_s`` prices a memory-bound op that draws
#     random numbers (the profile marks it) at the slower of its bytes and its output's
#     elements at that rate; without one, by its bytes as before. Its backward draws
#     nothing (it reads the saved mask) and is priced by its bytes.


def random_elements(op: OpRecord, tensors: Sequence[TensorRecord]) -> int:
    """The random numbers ``op`` draws, one an output element (NOTE [random kernels]); 0
    for an op that draws none."""
    if not op.random or op.category != "memory" or not op.outputs \
            or op.kind.endswith("_backward"):
        return 0
    return _numel(tensors[op.outputs[0]])


# NOTE [causal attention by sequence]
#     A fused attention kernel (FlashAttention, cuDNN's) splits the queries into blocks of
#     ``ATTENTION_BLOCK`` rows; each block walks the key blocks it sees, and pays a fixed
#     cost besides: loading its queries, the pipeline's fill and drain, the last rescale,
#     writing its output and log-sum-exp. With a causal mask a block sees on average
#     (n + 1) / 2 of the n key blocks, the diagonal one computed in full and masked, for
#     n / 2 of useful work, so the fixed cost, c key blocks' worth, weighs more as the
#     sequence shortens: a kernel reaches n / (n + 1 + 2c) of its rate over long
#     sequences. A preset that gives c for forward and backward prices a causal kernel
#     at sequence S at its causal figure times g(S) / g(reference), the figure being
#     measured at ``attention_reference_seq``. h200's c is this project's trace: the
#     figures are FlashAttention-2's at 8192 tokens and head dimension 128 (28.7% and
#     29.0% of peak), and cuDNN's kernels on gpt2-xl@12 (1024 tokens, head dimension 64)
#     reached 13.6% forward and 19.9% backward (docs/fidelity.md "Op by op on the H200"),
#     so c = 5.54 forward and 1.75 backward. One point cannot tell sequence from head
#     dimension (64 here, 128 in the figures; FlashAttention's tables show both lower
#     the rate): c holds both, and a kernel at head dimension 128 and a short sequence
#     may run faster than priced. Non-causal kernels keep their figures at any sequence
#     (no measurement of them).
ATTENTION_BLOCK = 128


def _causal_scale(seq: int, overhead: float, reference: int) -> float:
    """g(seq) / g(reference) of NOTE [causal attention by sequence]."""
    def g(s: int) -> float:
        n = max(-(-s // ATTENTION_BLOCK), 1)
        return n / (n + 1 + 2 * overhead)
    return g(seq) / g(reference)


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


def op_time(op: OpRecord, hw: Hardware, *, causal: bool = False,  # noqa: PLR0913
            aligned: bool = True, seq: int | None = None, moved: float | None = None,
            unvectorized: int = 0, drawn: int = 0) -> float:
    """Seconds ``op`` takes on ``hw`` as a kernel of its own: the slower of its compute and
    memory roofs. ``causal``: an attention kernel ran with a causal mask (its FLOPs are
    already halved; the preset says how much of the peak such a kernel reaches).
    ``aligned``: false for a matmul :func:`unaligned` finds so, which runs at most at the
    preset's ``matmul_unaligned_efficiency`` where it has one. ``seq``: a causal attention
    kernel's query sequence, which scales its figure on a preset that says how (NOTE
    [causal attention by sequence]); reductions are priced by the preset's reduction
    table where it has one (NOTE [reductions]). ``moved``: the bytes its kernels move
    where they are not its record's (:func:`kernel_bytes`). ``unvectorized``: the
    elements it writes one a load (:func:`unvectorized_elements`), at most the preset's
    ``unvectorized_elements_per_s`` (NOTE [unvectorized kernels]). ``drawn``: the random
    numbers it draws (:func:`random_elements`), at most the preset's
    ``random_elements_per_s`` (NOTE [random kernels]).

    Every kernel takes at least the preset's minimum kernel time; views and bare
    allocations launch no kernel and take none.
    """
    if op.category == "free":
        return 0.0
    c = hw.compute
    if op.kind in REDUCTIONS and hw.memory.reduction_bandwidth_efficiency is not None:
        memory_s = _reduction_s(op, hw)
    else:
        memory_s = _memory_s(op.bytes_read + op.bytes_written if moved is None else moved, hw)
    if unvectorized and hw.memory.unvectorized_elements_per_s is not None:
        memory_s = max(memory_s, unvectorized / hw.memory.unvectorized_elements_per_s)
    if drawn and hw.memory.random_elements_per_s is not None:
        memory_s = max(memory_s, drawn / hw.memory.random_elements_per_s)
    if op.category == "matmul":
        eff = min(step_efficiency(c.matmul_efficiency, op.flops), c.matmul_efficiency_cap)
        if not aligned and c.matmul_unaligned_efficiency is not None:
            eff = min(eff, c.matmul_unaligned_efficiency)
    elif op.category in ("attention_forward", "attention_backward"):
        eff = _attention_efficiency(op.category == "attention_forward", c, causal, seq)
    else:  # memory-bound: elementwise and reductions are priced by bytes moved
        eff = 0.0
    compute_s = op.flops / (hw.peak(op.dtype) * eff) if eff > 0 else 0.0
    return max(compute_s, memory_s, c.min_kernel_time_s)


def _attention_efficiency(forward: bool, c: Compute, causal: bool, seq: int | None) -> float:
    """The fraction of peak an attention kernel reaches (NOTE [causal attention by
    sequence])."""
    if forward:
        figure = c.attention_causal_forward_efficiency if causal else None
        eff, overhead = figure or c.attention_forward_efficiency, \
            c.attention_causal_forward_overhead
    else:
        figure = c.attention_causal_backward_efficiency if causal else None
        eff, overhead = figure or c.attention_backward_efficiency, \
            c.attention_causal_backward_overhead
    if not causal or seq is None or overhead is None or c.attention_reference_seq is None:
        return eff
    return min(eff * _causal_scale(seq, overhead, c.attention_reference_seq), 1.0)


def attention_seq(op: OpRecord, tensors: Sequence[TensorRecord]) -> int | None:
    """An attention kernel's query sequence: its first output's second-to-last dimension
    (the output [batch, heads, seq, dim] forward, the query's gradient backward)."""
    if not op.category.startswith("attention") or not op.outputs:
        return None
    shape = tensors[op.outputs[0]].shape
    return shape[-2] if len(shape) >= 2 and shape[-2] > 0 else None


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
    cuda = hw.kernels == "cuda"
    passes = cuda and bool(hw.memory.kernel_passes)
    times = [op_time(op, hw, causal=c, aligned=hw.compute.matmul_unaligned_efficiency is None
                     or not unaligned(op, tensors), seq=attention_seq(op, tensors),
                     moved=kernel_bytes(op, tensors) if passes else None,
                     unvectorized=unvectorized_elements(op, tensors) if cuda else 0,
                     drawn=random_elements(op, tensors) if cuda else 0)
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
