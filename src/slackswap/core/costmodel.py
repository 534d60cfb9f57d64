"""Roofline time of one op on a hardware preset, with size-dependent efficiency tables."""

from __future__ import annotations

from bisect import bisect_right

from slackswap.core.hardware import Hardware
from slackswap.core.profile import OpRecord

__all__ = ["op_time", "step_efficiency"]


def step_efficiency(table: list[tuple[float, float]], size: float) -> float:
    """Efficiency of the row with the largest threshold <= ``size`` (tables start at 0)."""
    return table[max(bisect_right([row[0] for row in table], size) - 1, 0)][1]


def op_time(op: OpRecord, hw: Hardware) -> float:
    """Seconds ``op`` takes on ``hw``: the slower of its compute and memory roofs.

    Every kernel takes at least the preset's minimum kernel time; views and bare
    allocations launch no kernel and take none.
    """
    if op.category == "free":
        return 0.0
    c, m = hw.compute, hw.memory
    moved = op.bytes_read + op.bytes_written
    memory_s = moved / (m.hbm_bandwidth * step_efficiency(m.bandwidth_efficiency, moved))
    if op.category == "matmul":
        eff = min(step_efficiency(c.matmul_efficiency, op.flops), c.matmul_efficiency_cap)
    elif op.category == "attention_forward":
        eff = c.attention_forward_efficiency
    elif op.category == "attention_backward":
        eff = c.attention_backward_efficiency
    else:  # memory-bound: elementwise and reductions are priced by bytes moved
        eff = 0.0
    compute_s = op.flops / (hw.peak(op.dtype) * eff) if eff > 0 else 0.0
    return max(compute_s, memory_s, c.min_kernel_time_s)
