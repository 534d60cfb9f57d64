"""``SimResult``: what a simulated step costs under one plan."""

from __future__ import annotations

from typing import Any

import pydantic

from slackswap.core.jsonio import JsonFile

__all__ = ["SimResult"]


class SimResult(JsonFile, pydantic.BaseModel):
    """Outcome of simulating one step; times in seconds, memory in bytes."""

    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)

    # 2: adds ``gradient_bytes``; version-1 files still load.
    schema_version: int = 2
    fingerprint: str
    strategy: str
    feasible: bool
    infeasible_reason: str | None = None
    shortfall_bytes: int = 0  # when infeasible: what the blocked allocation lacked
    step_time_s: float
    # keep-all, no limit, as plain eager PyTorch runs it (each op dispatched by the host)
    ideal_step_time_s: float
    retention: float  # throughput retained: ideal step time / step time (0 if infeasible)
    peak_bytes: int
    peak_time_s: float
    keep_all_peak_bytes: int = 0
    # weight gradients made in backward: model state, not in the activation peak
    gradient_bytes: int = 0
    memory_limit_bytes: int | None = None
    # compute stream idle by cause ("reload", "memory", "host": not yet issued by the
    # host) and the time spent recomputing ("recompute")
    stall_s: dict[str, float] = {}
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    recompute_s: float = 0.0
    busy_fraction: dict[str, float] = {}  # by stream: "compute", "d2h", "h2d", and "host"

    # The schedule and timeline behind this result (set by ``simulate``; not serialized).
    _run: Any = pydantic.PrivateAttr(default=None)

    @property
    def run(self) -> Any:
        return self._run
