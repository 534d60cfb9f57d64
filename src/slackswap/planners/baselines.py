"""The alternatives a practitioner would otherwise pick, each faithful to its idea."""

from __future__ import annotations

from slackswap.planners.context import Candidate, PlanContext
from slackswap.planners.memory import pressure_points
from slackswap.planners.recompute import choose_recompute, rebuild_cost
from slackswap.planners.search import Attempt, fit_margin, smallest_fitting

__all__ = ["recompute_only", "checkpoint_blocks", "offload_only", "capuchin", "module_policy"]


def recompute_only(ctx: PlanContext) -> Attempt | None:
    """Least-cost recompute set covering the excess (PyTorch's memory-budget knapsack)."""
    cands = ctx.candidates

    def make(margin: int):
        chosen = choose_recompute(ctx, cands, pressure_points(ctx, margin))
        if chosen is None:
            return None
        return ctx.plan("recompute-only", {n: "recompute" for n in chosen})

    return fit_margin(ctx, make)


def _block_outputs(ctx: PlanContext) -> set[str]:
    """Activations a block hands to the next one: kept by block checkpointing."""
    p = ctx.profile
    out = set()
    for c in ctx.candidates:
        if c.layer is None:
            continue
        for consumer in p.tensors[c.tensor].forward_consumers:
            layer = p.layer_index(p.ops[consumer].module)
            if layer is not None and layer > c.layer:
                out.add(c.name)
    return out


def checkpoint_blocks(ctx: PlanContext) -> Attempt | None:
    """Recompute whole transformer blocks from their kept inputs, first blocks first,
    as few as fit (Hugging Face ``gradient_checkpointing_enable`` on a prefix)."""
    keep = _block_outputs(ctx)
    layers = len(ctx.profile.layers)
    if not layers:
        return None

    def make(k: int):
        return ctx.plan("checkpoint-blocks", {
            c.name: "recompute" for c in ctx.candidates
            if c.layer is not None and c.layer < k and c.name not in keep})

    return smallest_fitting(ctx, make, 0, layers)


def offload_only(ctx: PlanContext) -> Attempt | None:
    """Offload in production order, as many as fit; reloads prefetched in backward order
    (torchtune's ``OffloadActivations``, vDNN)."""
    cands = ctx.candidates

    def make(n: int):
        return ctx.plan("offload-only", {c.name: "offload" for c in cands[:n]})

    return smallest_fitting(ctx, make, 0, len(cands))


def _swap_time(ctx: PlanContext, c: Candidate) -> float:
    link = ctx.hw.host_link
    return 2 * link.latency_s + c.bytes / link.d2h_bandwidth + c.bytes / link.h2d_bandwidth


def capuchin(ctx: PlanContext) -> Attempt | None:
    """Capuchin's greedy hybrid: swap tensors whose idle time hides the transfer, then
    take swap or recompute by memory saved per second of overhead until the excess is
    covered."""
    scored = []
    for c in ctx.candidates:
        idle = c.needed_at - c.produced_at
        swap = max(_swap_time(ctx, c) - idle, 0.0)
        recompute = rebuild_cost(ctx, c)
        choice, overhead = ("offload", swap) if swap <= recompute else ("recompute", recompute)
        scored.append((c.bytes / max(overhead, 1e-12), choice, c))
    scored.sort(key=lambda s: -s[0])
    excess = ctx.keep_all_peak - ctx.budget

    def make(margin: int):
        decisions, covered = {}, 0
        for _, choice, c in scored:
            if covered >= excess + margin:
                break
            decisions[c.name] = choice
            covered += c.bytes
        return ctx.plan("capuchin", decisions)

    return fit_margin(ctx, make)


_RECOMPUTE_KINDS = {"native_layer_norm", "gelu", "silu", "native_dropout", "rsqrt", "mul",
                    "_to_copy", "pow", "mean", "tanh", "relu", "add"}
_NORM_OR_ACT = ("norm", "act", "ln_", "dropout", "drop")


def module_policy(ctx: PlanContext) -> Attempt | None:
    """Megatron-style fixed rules on a prefix of blocks: recompute norms and activation
    functions, offload attention outputs and linear inputs, keep the rest."""
    p = ctx.profile
    linear_inputs = set()
    for op in p.ops[: ctx.first_backward]:
        if op.category == "matmul":
            linear_inputs.update(op.inputs)
    rules: dict[str, str] = {}
    for c in ctx.candidates:
        module = p.ops[c.producer].module.rsplit(".", 1)[-1].lower()
        if c.kind in _RECOMPUTE_KINDS and any(key in module for key in _NORM_OR_ACT):
            rules[c.name] = "recompute"
        elif c.kind == "fused_attention" or c.tensor in linear_inputs:
            rules[c.name] = "offload"
    layers = len(p.layers)
    by_layer = {c.name: c.layer for c in ctx.candidates}

    def make(k: int):
        return ctx.plan("module-policy", {n: d for n, d in rules.items()
                                          if by_layer[n] is not None and by_layer[n] < k})

    return smallest_fitting(ctx, make, 0, layers) if layers else None
