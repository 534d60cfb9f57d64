"""What a plan does, in numbers a person reads: bytes kept, offloaded, recomputed."""

from __future__ import annotations

from collections import defaultdict

from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile

__all__ = ["decision_bytes", "checkpoint_bytes"]


def decision_bytes(profile: StepProfile, plan: Plan, by: str = "kind") -> dict[str, dict[str, int]]:
    """Bytes per decision, grouped by producer op kind (``by="kind"``), by layer
    (``"layer"``), or in total (``"total"``)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {Decision.KEEP: 0, Decision.OFFLOAD: 0,
                                                          Decision.RECOMPUTE: 0})
    for t in profile.saved_activations:
        decision = plan.decisions.get(t.name, Decision.KEEP)
        op = profile.ops[t.producer] if t.producer is not None else None
        if by == "kind":
            key = op.kind if op else "input"
        elif by == "layer":
            idx = profile.layer_index(op.module) if op else None
            key = str(idx) if idx is not None else "outside blocks"
        else:
            key = "total"
        out[key][decision] += t.bytes
    return dict(out)


def checkpoint_bytes(profile: StepProfile, plan: Plan) -> dict[str, int]:
    """Bytes of the tensors autograd does not save that the plan keeps or offloads as
    checkpoints for rebuilds (the rest are rebuilt when a rebuild needs them)."""
    out = {Decision.KEEP: 0, Decision.OFFLOAD: 0}
    for name, decision in plan.decisions.items():
        t = profile.checkpointable.get(name)
        if t is not None and decision in out:
            out[decision] += t.bytes
    return out
