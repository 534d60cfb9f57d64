"""The alternatives a practitioner would otherwise pick, each faithful to its idea."""

from __future__ import annotations

from slackswap.core.plan import Decision
from slackswap.planners.context import PlanContext
from slackswap.planners.memory import pressure_points
from slackswap.planners.recompute import choose_recompute, kernel_cost, rebuild_cost
from slackswap.planners.search import Attempt, fit_margin, or_uniform, smallest_fitting
from slackswap.planners.slack import eviction_credit, offload_within_slack

__all__ = ["recompute_only", "checkpoint_blocks", "checkpoint_offload", "offload_only", "capuchin",
           "module_policy"]


def recompute_only(ctx: PlanContext) -> Attempt | None:
    """Least-cost recompute set covering the excess (PyTorch's memory-budget knapsack)."""
    cands = ctx.candidates

    def make(margin: int):
        chosen = choose_recompute(ctx, cands, pressure_points(ctx, margin))
        if chosen is None:
            return None
        return ctx.plan("recompute-only", {n: Decision.RECOMPUTE for n in chosen})

    return or_uniform(ctx, fit_margin(ctx, make), "recompute-only", (Decision.RECOMPUTE,))


def _block_inputs(ctx: PlanContext, layer: int) -> list[str]:
    """Activations made before block ``layer`` that it reads: its checkpoint."""
    p = ctx.profile
    names = []
    for op in p.ops[: ctx.first_backward]:
        if p.layer_index(op.module) != layer:
            continue
        for tid in op.inputs:
            t = p.tensors[tid]
            if t.kind == "activation" and t.producer is not None and t.name is not None and (
                    p.layer_index(p.ops[t.producer].module) != layer):
                names.append(t.name)
    return list(dict.fromkeys(names))


def checkpoint_blocks(ctx: PlanContext) -> Attempt | None:
    """Recompute whole transformer blocks from their kept inputs, first blocks first,
    as few as fit (Hugging Face ``gradient_checkpointing_enable`` on a prefix)."""
    layers = len(ctx.profile.layers)
    if not layers:
        return None
    inputs = [_block_inputs(ctx, i) for i in range(layers)]

    def make(k: int):
        decisions = {c.name: Decision.RECOMPUTE for c in ctx.candidates
                     if c.layer is not None and c.layer < k}
        for names in inputs[:k]:
            decisions.update({n: Decision.KEEP for n in names})
        return ctx.plan("checkpoint-blocks", decisions)

    return smallest_fitting(ctx, make, 0, layers)


def checkpoint_offload(ctx: PlanContext) -> Attempt | None:
    """Recompute every transformer block from its inputs, offloaded to the host and
    reloaded for its rebuild (torchtune's activation checkpointing of every layer with
    ``OffloadActivations``; Megatron's offload of checkpointed module inputs)."""
    layers = len(ctx.profile.layers)
    if not layers:
        return None
    decisions = {c.name: Decision.RECOMPUTE for c in ctx.candidates if c.layer is not None}
    for layer in range(layers):
        decisions.update({n: Decision.OFFLOAD for n in _block_inputs(ctx, layer)})
    plan = ctx.plan("checkpoint-offload", decisions)
    return plan, ctx.simulate(plan)


def offload_only(ctx: PlanContext) -> Attempt | None:
    """Offload in production order, as many as fit; reloads prefetched in backward order
    (torchtune's ``OffloadActivations``, vDNN)."""
    cands = ctx.candidates

    def make(n: int):
        return ctx.plan("offload-only", {c.name: Decision.OFFLOAD for c in cands[:n]})

    return smallest_fitting(ctx, make, 0, len(cands))


def capuchin(ctx: PlanContext) -> Attempt | None:
    """Capuchin's policy: swap first, the tensors idle longest between forward and
    backward, while the copy engines can hide the swaps; then evict more by memory saved
    per second of overhead (recompute), greedily, until the peak's excess is covered."""
    idle_first = sorted(ctx.candidates, key=lambda c: (c.produced_at - c.needed_at, c.tensor))
    swaps = offload_within_slack(ctx, idle_first)
    swapped = {c.name for c in swaps}
    msps = sorted((c for c in ctx.candidates if c.name not in swapped),
                  key=lambda c: (-c.bytes / max(rebuild_cost(ctx, c), 1e-12), c.tensor))
    peak_op = max(range(len(ctx.memory)), key=ctx.memory.__getitem__)
    excess = ctx.keep_all_peak - ctx.budget - eviction_credit(ctx, swaps, [peak_op])[peak_op]

    def make(margin: int):
        decisions = {c.name: Decision.OFFLOAD for c in swaps}
        freed = 0
        for c in msps:
            if freed >= excess + margin:
                break
            decisions[c.name] = Decision.RECOMPUTE
            freed += c.bytes
        return ctx.plan("capuchin", decisions)

    return fit_margin(ctx, make)


_RECOMPUTE_KINDS = {"native_layer_norm", "gelu", "silu", "native_dropout", "rsqrt", "mul",
                    "_to_copy", "pow", "mean", "tanh", "relu", "add"}
_NORM_OR_ACT = ("norm", "act", "ln_", "dropout", "drop")


def module_policy(ctx: PlanContext) -> Attempt | None:
    """Megatron-style fixed rules on a prefix of blocks: recompute norms and activation
    functions (where their inputs are saved), offload attention outputs and linear
    inputs, keep the rest."""
    p = ctx.profile
    linear_inputs = set()
    for op in p.ops[: ctx.first_backward]:
        if op.category == "matmul":
            linear_inputs.update(op.inputs)
    rules: dict[str, str] = {}
    for c in ctx.candidates:
        module = p.ops[c.producer].module.rsplit(".", 1)[-1].lower()
        local = kernel_cost(ctx, c) == c.recompute_s  # rebuilt from saved inputs alone
        if c.kind in _RECOMPUTE_KINDS and any(key in module for key in _NORM_OR_ACT) and local:
            rules[c.name] = Decision.RECOMPUTE
        elif (p.ops[c.producer].category == "attention_forward"
              or c.tensor in linear_inputs):
            rules[c.name] = Decision.OFFLOAD
    layers = len(p.layers)
    by_layer = {c.name: c.layer for c in ctx.candidates}

    def make(k: int):
        return ctx.plan("module-policy", {n: d for n, d in rules.items()
                                          if by_layer[n] is not None and by_layer[n] < k})

    # fixed rules often cannot reach the budget even on every block: try that first
    return smallest_fitting(ctx, make, 0, layers, hi_first=True) if layers else None
