"""The host-buffer pool (NOTE [buffers held by events]): reuse without sharing."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap.runtime.copies import HostCopies
from slackswap.runtime.stats import RuntimeStats

SIZES = [250, 500, 1000]  # fp32 elements: 1000, 2000 and 4000 bytes


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 99)), max_size=40),
       capacity=st.integers(0, 12000))
def test_the_pool_never_hands_out_a_held_buffer(steps: list, capacity: int) -> None:
    """Offloads and give-backs in any order: a host copy keeps its bytes until it is
    given back, the pool keeps no more than its capacity or the most bytes held at once,
    and an offload allocates only when no free buffer of its size is pooled."""
    copies, stats = HostCopies(capacity), RuntimeStats()
    held: list[tuple[torch.Tensor, float]] = []
    most_held = 0  # the pool may keep as much as was held at once
    for n, (offload, pick) in enumerate(steps):
        if offload or not held:
            size = SIZES[pick % len(SIZES)]
            pooled = copies.pooled_bytes
            before = stats.host_buffers_allocated
            host = copies.offload(torch.full((size,), float(n)), stats)
            assert host.numel() == 4 * size
            reused = stats.host_buffers_allocated == before
            assert reused == (copies.pooled_bytes == pooled - 4 * size)
            assert all(host.data_ptr() != other.data_ptr() for other, _ in held)
            held.append((host, float(n)))
        else:
            copies.give_back(held.pop(pick % len(held))[0])
        most_held = max(most_held, sum(host.numel() for host, _ in held))
        assert copies.pooled_bytes <= max(capacity, most_held)
        for host, value in held:
            assert torch.all(host.view(torch.float32) == value)
