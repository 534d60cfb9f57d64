"""Data-parallel communication of a step whose ranks share the model: FSDP's all-gathers
and reduce-scatters, HSDP's all-reduce across replicas, DDP's gradient all-reduce, each
overlapped with the step's compute as the frameworks overlap them.

The product's simulation is one GPU's step and stays so: nothing here runs unless a
caller describes the ranks (:class:`DataParallel`), as ``benchmarks/fidelity.py`` does for
published runs whose configuration states it. Plain Python, no torch.

NOTE [data-parallel collectives]
    A collective's time is nccl-tests' convention (NVIDIA/nccl-tests doc/PERFORMANCE.md):
    over ``n`` ranks an all-gather or a reduce-scatter of a ``size``-byte (gathered)
    buffer takes ``size * (n - 1) / n / busbw``, an all-reduce twice that, where
    ``busbw`` is the bus bandwidth nccl-tests reports, the same for the three on a ring.
    Bus bandwidths, bytes/s, measured and published (no figure is solved from a run):
    - NVLink inside an 8-GPU A100 node (NVSwitch): 200e9. NVIDIA/nccl-tests issue #149
      (HPE Apollo 6500, 8x A100-SXM4-80GB over NVLink, NCCL 2.18): all_reduce_perf
      busbw "~200 GB/s" at 1 GB.
    - NVLink inside an 8-GPU H100 or H200 node (NVLink4, NVSwitch): 360e9. NVIDIA/nccl
      issue #1229 (H100 cluster): reduce-scatter busbw 360 GB/s at 4 nodes, falling
      with more (ring); the smallest scale reported, taken for the node (inside a node
      nothing slower than NVLink is crossed, so at least that).
    - Between nodes, per NIC: 46e9 for 400 Gb/s, 92e9 for 800 Gb/s. NVIDIA/nccl-tests
      issue #290, a maintainer (AddyLaddy): "For NDR @ 400Gbps you should see 46-48GB/s
      per NIC"; the low end, doubled for 800 Gb/s. A node's NICs are shared by its
      ranks, which all run their replica all-reduce at once (HSDP). A shard group across
      nodes with a NIC per GPU runs a ring a NIC, so its bus bandwidth is at most the
      node's NICs together (8 x 46e9) and NVLink's: #1229's 360 GB/s at 4 nodes of 8
      H100s with 400 Gb/s NICs is that bound.
    Overlap, as the frameworks schedule it (the model of :func:`sharded_step`):
    - FSDP gathers a unit's parameters before its forward and again before its backward,
      one unit ahead of the compute (forward prefetch; BACKWARD_PRE), and
      reduce-scatters its gradients after its backward. The collectives run in issue
      order on one channel; a unit's compute waits for its gather. The root unit
      (embeddings, final norm, head) is gathered once, before the forward, and
      reduce-scattered after the whole backward, both exposed. HSDP then all-reduces
      each reduce-scattered shard across the replicas on the network, a second channel
      (FSDP1 issues it on its reduce-scatter's stream, so the next reduce-scatter waits
      for it; taken apart here, which hides a little more where an all-reduce outlasts a
      block's backward).
    - All-gathers and reduce-scatters share one channel, in issue order (FSDP runs them on
      two streams, which then share NVLink's bandwidth: the same bytes in about the same
      time).
    - DDP all-reduces gradient buckets as the backward produces them (taken: one bucket
      a unit), on the micro-batch that synchronises (one per ``sync_every``: gradient
      accumulation skips the others, ``no_sync``); ZeRO-1 then gathers the updated
      parameters from their owners after the optimizer step, exposed.
    - NCCL's kernels run on SMs the compute would use: while a collective runs, compute
      is slowed by ``overlap_slowdown``. Published figure: Lee et al. 2025,
      "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
      Learning" (arXiv:2507.03114), abstract: overlapping computation and communication
      slows the computation by 18.9% on average (at most 40.0%) against the same
      computation alone, over GPT and LLaMA models on A100, H100, MI250 and MI210. An
      average of their runs, not a measurement of these GPUs' kernels.
    - FSDP2 (``fully_shard``) gathers into one flat buffer and copies each parameter out
      of it before the unit runs (``foreach_all_gather_copy_out``: ``split_with_sizes_copy``
      on the compute stream, reading and writing the unsharded parameters), and copies the
      gradients into the reduce-scatter's input, cast to the reduction's dtype, before
      reducing (``foreach_reduce``: ``torch._chunk_cat`` on the reduce-scatter stream):
      torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py. Both are memory-bound
      copies, priced at ``copy_bandwidth``; the copy-out delays the unit's compute, the
      copy-in its reduce-scatter. FSDP1's flat parameter is the gather's output itself
      (no copy-out), and its gradient is reduced in place where the dtypes agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["NVLINK_BUSBW", "NIC_BUSBW", "OVERLAP_SLOWDOWN", "Unit", "DataParallel",
           "CommStep", "gather_s", "all_reduce_s", "slowed", "sharded_step",
           "replicated_step", "data_parallel_step"]

# NOTE [data-parallel collectives]: nccl-tests bus bandwidth inside a node, by preset
NVLINK_BUSBW = {"a100-80gb": 200e9, "a100-40gb": 200e9, "dgx-a100": 200e9,
                "h100-sxm": 360e9, "h200": 360e9, "dgx-h200": 360e9}
NIC_BUSBW = {400: 46e9, 800: 92e9}  # Gb/s of a NIC -> bytes/s nccl reaches over it
OVERLAP_SLOWDOWN = 1.189  # compute while a collective runs (arXiv:2507.03114, average)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a transformer block, or the root: everything else) of the step: its
    compute, forward and backward, and the elements of its parameters."""

    forward_s: float
    backward_s: float
    params: int


@dataclass(frozen=True)
class DataParallel:
    """How a run's ranks share the model (NOTE [data-parallel collectives]).

    ``kind``: ``fsdp`` (every unit sharded over ``shard_ranks``), ``hsdp`` (sharded over
    ``shard_ranks`` inside a node, replicated ``replicas`` times across nodes) or ``ddp``
    (replicated over ``shard_ranks`` ranks; ``zero1``: the optimizer state sharded, the
    parameters gathered after each update). ``gather_bytes``: bytes a parameter element
    moves when gathered; ``reduce_bytes``: a gradient element when reduced.
    ``intra_busbw``: the shard group's bus bandwidth; ``inter_busbw``: the network's per
    node, shared by ``ranks_per_node`` ranks (hsdp). ``sync_every``: micro-batches per
    gradient reduction (ddp with gradient accumulation). ``copy_bandwidth``: FSDP2's
    copies around its collectives, at this rate (0: FSDP1, which makes none)."""

    kind: Literal["fsdp", "hsdp", "ddp"]
    shard_ranks: int
    intra_busbw: float
    gather_bytes: int = 2
    reduce_bytes: int = 2
    replicas: int = 1
    inter_busbw: float = 0.0
    ranks_per_node: int = 8
    sync_every: int = 1
    zero1: bool = False
    overlap_slowdown: float = 1.0
    copy_bandwidth: float = 0.0  # FSDP2's copy-out and copy-in, bytes/s; 0: FSDP1, none
    grad_bytes: int = 2  # bytes of a gradient element as the backward makes it


@dataclass(frozen=True)
class CommStep:
    """A step with its communication: ``step_s`` in all; ``compute_s`` the compute alone
    (the simulated step); ``comm_s`` the collectives' own time, summed; ``slowdown_s`` what
    sharing the SMs added to the compute; ``copy_out_s`` FSDP2's copies out of its
    gathers, on the compute stream; ``exposed_s`` what the collectives (with FSDP2's
    copies into its reductions) added to the step beyond those."""

    step_s: float
    compute_s: float
    comm_s: float
    slowdown_s: float
    copy_out_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s - self.slowdown_s - self.copy_out_s


def gather_s(size: float, ranks: int, busbw: float) -> float:
    """An all-gather or reduce-scatter of a ``size``-byte buffer over ``ranks`` ranks."""
    return 0.0 if ranks <= 1 else size * (ranks - 1) / ranks / busbw


def all_reduce_s(size: float, ranks: int, busbw: float) -> float:
    """An all-reduce of ``size`` bytes over ``ranks`` ranks."""
    return 2 * gather_s(size, ranks, busbw)


def slowed(work: float, busy: float, slowdown: float) -> float:
    """How long ``work`` seconds of compute take when a collective keeps running for
    ``busy`` seconds from its start, compute running ``slowdown`` times slower meanwhile."""
    if busy <= 0 or slowdown <= 1:
        return work
    if busy >= work * slowdown:
        return work * slowdown
    return work + busy * (1 - 1 / slowdown)


class _Channels:
    """The step's clocks: compute, the shard group's collectives, the network's."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp, self.now, self.intra, self.inter = dp, 0.0, 0.0, 0.0
        self.comm = self.slow = self.work = self.copies = 0.0

    def issue(self, seconds: float, at: float, network: bool = False,
              prelude: float = 0.0) -> float:
        """Queue a collective issued at ``at``, after ``prelude`` seconds of copying on its
        stream; when it ends."""
        self.comm += seconds
        if network:
            self.inter = max(self.inter, at) + prelude + seconds
            return self.inter
        self.intra = max(self.intra, at) + prelude + seconds
        return self.intra

    def compute(self, work: float, ready: float = 0.0, copy: float = 0.0) -> float:
        """Run ``copy`` (FSDP2's copy-out) then ``work`` once ``ready``; when it starts."""
        start = max(self.now, ready)
        took = slowed(work, max(self.intra, self.inter) - start - copy,
                      self.dp.overlap_slowdown)
        self.now, self.work, self.slow = start + copy + took, self.work + work, \
            self.slow + took - work
        self.copies += copy
        return start

    def done(self) -> CommStep:
        end = max(self.now, self.intra, self.inter)
        return CommStep(end, self.work, self.comm, self.slow, self.copies)

    def copy_s(self, moved: float) -> float:
        """An FSDP2 copy moving ``moved`` bytes, read and written (0 under FSDP1)."""
        bw = self.dp.copy_bandwidth
        return moved / bw if bw > 0 else 0.0

    def copy_out_s(self, params: int) -> float:
        """FSDP2's copy of ``params`` gathered elements out of the gather's buffer."""
        return self.copy_s(2 * params * self.dp.gather_bytes)


def _reduce(ch: _Channels, params: int, at: float) -> None:
    """A unit's gradients reduce-scattered at ``at``; under HSDP, the shard all-reduced
    across the replicas after."""
    dp = ch.dp
    # FSDP2's copy-in: the gradients read as the backward made them, written in the
    # reduction's dtype
    copy_in = ch.copy_s(params * (dp.grad_bytes + dp.reduce_bytes))
    end = ch.issue(gather_s(params * dp.reduce_bytes, dp.shard_ranks, dp.intra_busbw), at,
                   prelude=copy_in)
    if dp.kind == "hsdp" and dp.replicas > 1:
        per_rank = dp.inter_busbw / dp.ranks_per_node
        shard = params * dp.reduce_bytes / dp.shard_ranks
        ch.issue(all_reduce_s(shard, dp.replicas, per_rank), end, network=True)


def sharded_step(root: tuple[Unit, Unit], blocks: list[Unit], dp: DataParallel) -> CommStep:
    """One micro-batch's step under FSDP or HSDP (NOTE [data-parallel collectives]).
    ``root``: the root unit's work before the blocks and after them (forward: embeddings,
    then norm, head and loss; backward: the head's, then the embeddings'), its
    parameters on the first; ``blocks``: the transformer blocks in order."""
    ch = _Channels(dp)
    params = root[0].params + root[1].params

    def gather(unit: Unit, at: float) -> float:
        return ch.issue(gather_s(unit.params * dp.gather_bytes, dp.shard_ranks,
                                 dp.intra_busbw), at)

    began = ch.compute(root[0].forward_s, gather(Unit(0, 0, params), 0.0),
                       ch.copy_out_s(params))
    _prefetched(ch, blocks, began, gather, backward=False)
    began = ch.compute(root[1].forward_s + root[1].backward_s)
    _prefetched(ch, list(reversed(blocks)), began, gather, backward=True)
    ch.compute(root[0].backward_s)
    _reduce(ch, params, ch.now)
    return ch.done()


def _prefetched(ch: _Channels, units: list[Unit], began: float,
                gather: Callable[[Unit, float], float], backward: bool) -> None:
    """Each of ``units`` computed in turn (its backward, then its gradients' reduction,
    where ``backward``), the next one's gather issued as it starts, the first's at
    ``began``."""
    nxt = gather(units[0], began) if units else 0.0
    for k, unit in enumerate(units):
        start = max(ch.now, nxt)
        if k + 1 < len(units):
            nxt = gather(units[k + 1], start)
        ch.compute(unit.backward_s if backward else unit.forward_s, start,
                   ch.copy_out_s(unit.params))
        if backward:
            _reduce(ch, unit.params, ch.now)


def replicated_step(root: tuple[Unit, Unit], blocks: list[Unit],
                    dp: DataParallel) -> CommStep:
    """One micro-batch's step under DDP, averaged over ``sync_every`` micro-batches of
    which the last all-reduces the gradients (NOTE [data-parallel collectives])."""
    ch = _Channels(dp)
    for unit in (root[0], *blocks):
        ch.compute(unit.forward_s)
    ch.compute(root[1].forward_s + root[1].backward_s)
    for unit in reversed(blocks):
        ch.compute(unit.backward_s)
        ch.issue(all_reduce_s(unit.params * dp.reduce_bytes, dp.shard_ranks,
                              dp.intra_busbw), ch.now)
    ch.compute(root[0].backward_s)
    params = root[0].params + root[1].params
    end = ch.issue(all_reduce_s(params * dp.reduce_bytes, dp.shard_ranks, dp.intra_busbw),
                   ch.now)
    if dp.zero1:
        total = params + sum(u.params for u in blocks)
        ch.issue(gather_s(total * dp.gather_bytes, dp.shard_ranks, dp.intra_busbw), end)
    synced = ch.done()
    n = max(dp.sync_every, 1)
    return CommStep(synced.compute_s + (synced.step_s - synced.compute_s) / n,
                    synced.compute_s, synced.comm_s / n, synced.slowdown_s / n)


def data_parallel_step(root: tuple[Unit, Unit], blocks: list[Unit],
                       dp: DataParallel) -> CommStep:
    """:func:`sharded_step` or :func:`replicated_step`, by ``dp.kind``."""
    if dp.kind == "ddp":
        return replicated_step(root, blocks, dp)
    return sharded_step(root, blocks, dp)
