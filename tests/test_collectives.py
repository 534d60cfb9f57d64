"""sim/collectives.py: the data-parallel collectives of a step (NOTE [data-parallel
collectives]) against timelines worked by hand."""

from __future__ import annotations

import pytest

from slackswap.sim.collectives import (
    NVLINK_BUSBW,
    OVERLAP_SLOWDOWN,
    DataParallel,
    Unit,
    all_reduce_s,
    data_parallel_step,
    gather_s,
    slowed,
)

# two ranks at 1 byte/s, one byte an element: a gather or reduce-scatter of P elements
# takes P / 2 s, an all-reduce P s
ROOT = (Unit(0.5, 0.25, 2), Unit(0.5, 0.5, 0))  # embeddings; norm, head and loss
BLOCKS = [Unit(1.0, 2.0, 1), Unit(1.0, 2.0, 1)]
WORK = 0.5 + 0.25 + 0.5 + 0.5 + 2 * (1.0 + 2.0)


def _dp(**kw: object) -> DataParallel:
    base: dict[str, object] = {"kind": "fsdp", "shard_ranks": 2, "intra_busbw": 1.0,
                               "gather_bytes": 1, "reduce_bytes": 1}
    return DataParallel(**{**base, **kw})  # type: ignore[arg-type]


def test_collectives_take_nccl_tests_bus_bandwidth_times() -> None:
    # 1 GB over 8 A100s: 7/8 of it at 200 GB/s = 4.375 ms; an all-reduce twice that
    assert gather_s(1e9, 8, NVLINK_BUSBW["a100-80gb"]) == pytest.approx(4.375e-3)
    assert all_reduce_s(1e9, 8, NVLINK_BUSBW["a100-80gb"]) == pytest.approx(8.75e-3)
    assert gather_s(1e9, 1, 1.0) == 0.0  # one rank: nothing moves


def test_compute_slows_only_while_a_collective_runs() -> None:
    assert slowed(10.0, 0.0, 1.189) == 10.0
    assert slowed(10.0, 100.0, 1.189) == pytest.approx(11.89)  # overlapped throughout
    # 5 s of it overlapped: 5 / 1.189 s of work done then, the rest at full speed
    assert slowed(10.0, 5.0, 1.189) == pytest.approx(5.0 + (10.0 - 5.0 / 1.189))


def test_fsdp_step_by_hand() -> None:
    # root gathered [0, 1]; embeddings [1, 1.5] (block 0 gathered [1, 1.5]); block 0
    # [1.5, 2.5] (block 1 gathered [1.5, 2]); block 1 [2.5, 3.5]; head, loss and its
    # backward [3.5, 4.5] (block 1 gathered [3.5, 4]); block 1 backward [4.5, 6.5]
    # (block 0 gathered [4.5, 5]), reduced [6.5, 7]; block 0 [6.5, 8.5], reduced [8.5, 9];
    # embeddings' backward [8.5, 8.75]; the root reduced [9, 10]
    step = data_parallel_step(ROOT, BLOCKS, _dp())
    assert step.step_s == pytest.approx(10.0)
    assert step.compute_s == pytest.approx(WORK)
    assert step.comm_s == pytest.approx(1.0 + 4 * 0.5 + 2 * 0.5 + 1.0)
    assert step.exposed_s == pytest.approx(1.0 + 1.25)  # the root's gather and reduction
    assert step.slowdown_s == 0.0


def test_hsdp_all_reduces_each_shard_across_replicas_after_its_reduction() -> None:
    # per rank 8 / 4 = 2 bytes/s across nodes; a block's shard is 0.5 bytes, all-reduced
    # over 2 replicas in 2 * 0.5 / 2 / 2 = 0.25 s; the root's (1 byte) in 0.5 s, after
    # its reduction ends at 10
    step = data_parallel_step(ROOT, BLOCKS, _dp(kind="hsdp", replicas=2, inter_busbw=8.0,
                                                ranks_per_node=4))
    assert step.step_s == pytest.approx(10.5)
    assert step.comm_s == pytest.approx(5.0 + 0.25 + 0.25 + 0.5)


def test_sharing_the_sms_slows_the_compute_under_a_collective() -> None:
    # twice as slow under a collective: block 0's forward has block 1's gather (0.5 s)
    # beside it, 1 + 0.5 * (1 - 1/2) = 1.25 s; the fsdp step grows, never shrinks
    alone = data_parallel_step(ROOT, BLOCKS, _dp())
    shared = data_parallel_step(ROOT, BLOCKS, _dp(overlap_slowdown=2.0))
    assert shared.slowdown_s >= 0.25
    assert shared.step_s >= alone.step_s + 0.25 - 1e-12
    assert shared.compute_s == pytest.approx(WORK)
    assert OVERLAP_SLOWDOWN == 1.189  # arXiv:2507.03114


def test_ddp_all_reduces_once_per_accumulation_and_zero1_gathers_after() -> None:
    # forward 2.5 s, head 1 s: [0, 3.5]; block 1 backward [3.5, 5.5], all-reduced
    # [5.5, 6.5]; block 0 [5.5, 7.5], [7.5, 8.5]; embeddings [7.5, 7.75]; the root's 2
    # elements [8.5, 10.5]; ZeRO-1 gathers all 4 [10.5, 12.5]. Two micro-batches, one
    # synchronising: (7.75 + 12.5) / 2 a micro-batch
    step = data_parallel_step(ROOT, BLOCKS, _dp(kind="ddp", sync_every=2, zero1=True))
    assert step.step_s == pytest.approx((WORK + 12.5) / 2)
    assert step.compute_s == pytest.approx(WORK)
    assert step.comm_s == pytest.approx((1 + 1 + 2 + 2) / 2)


def test_one_gpu_moves_nothing() -> None:
    step = data_parallel_step(ROOT, BLOCKS, _dp(shard_ranks=1))
    assert step.step_s == pytest.approx(WORK + 0.0)
    assert step.comm_s == 0.0


def test_fsdp2_copies_out_of_its_gathers_and_into_its_reductions() -> None:
    # at 1 byte/s a copy of P one-byte elements moves 2P bytes: 2P s. Root gathered
    # [0, 1], copied out [1, 5], embeddings [5, 5.5]; block 0 copied and run [5.5, 8.5];
    # block 1 [8.5, 11.5]; head, loss and its backward [11.5, 12.5]; block 1 backward
    # copied and run [12.5, 16.5], its gradients copied in and reduced [16.5, 19]; block 0
    # [16.5, 20.5], [20.5, 23]; embeddings' backward [20.5, 20.75]; the root's gradients
    # copied in (4 s) and reduced (1 s) [23, 28]
    step = data_parallel_step(ROOT, BLOCKS, _dp(copy_bandwidth=1.0, grad_bytes=1))
    assert step.step_s == pytest.approx(28.0)
    assert step.copy_out_s == pytest.approx(4.0 + 4 * 2.0)
    assert step.compute_s == pytest.approx(WORK)
    assert step.exposed_s == pytest.approx(28.0 - WORK - 12.0)
    assert step.comm_s == pytest.approx(5.0)  # the collectives themselves are unchanged
