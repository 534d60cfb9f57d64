"""benchmarks/partitioner_estimate.py on a tiny preset: it runs, and its numbers hold
together (issue 51 item 3, CPU part)."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch import fx
from torch._functorch import partitioners

from slackswap.compiled.api import CompiledPlan
from slackswap.models import build_model
from slackswap.profiling.machine import resolve_hardware

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import partitioner_estimate  # noqa: E402


@pytest.mark.heavy  # a benchmark run (16 s on two loaded cores)
def test_the_estimates_of_each_cut_hold_together() -> None:
    """At budget 1.0 the knob is plain torch.compile's partition, and so is
    slackswap.compile's (NOTE [the min-cut's free rebuilds]: the same bytes saved, the same
    ops rebuilt); a tighter knob saves less and rebuilds more; SlackSwap's plan at 0.7
    (0.5 is below this tiny model's floor: its parameters' gradients outweigh its
    activations) is simulated within its budget and saves less than its plan at 1.0."""
    torch.manual_seed(0)
    model, batch = build_model("llama-7b-tiny", dtype="fp32", fake=False)
    rows = partitioner_estimate.estimate_points(model, batch, (0.5, 0.7, 1.0), "h200")
    at = {(r["point"], r["budget"]): r for r in rows}
    assert "fits no plan" in at["slackswap.compile", 0.5].pop("error")
    assert not [r for r in rows if "error" in r], rows
    plain = at["torch.compile", 1.0]
    knob = {b: at["activation_memory_budget", b] for b in (0.5, 0.7, 1.0)}
    fields = ("saved_bytes", "recomputed_ops", "recompute_estimate")
    assert all(knob[1.0][f] == plain[f] for f in fields)
    assert knob[0.5]["saved_bytes"] <= knob[0.7]["saved_bytes"] < plain["saved_bytes"]
    assert knob[0.5]["recompute_estimate"] >= knob[0.7]["recompute_estimate"] \
        > plain["recompute_estimate"]
    keep_all, tight = at["slackswap.compile", 1.0], at["slackswap.compile", 0.7]
    assert all(keep_all[f] == plain[f] for f in fields)
    assert keep_all["sim_step_ms"] == keep_all["sim_keep_all_step_ms"]
    assert tight["recomputed_ops"] > plain["recomputed_ops"]
    assert tight["saved_bytes"] < keep_all["saved_bytes"]
    assert tight["sim_peak_gb"] <= tight["plan_budget_gb"]


def _blocks(width: int = 64, depth: int = 3) -> nn.Module:
    """Norms, GEMMs and GELU, run at a batch whose activations outweigh the parameters
    (so half the keep-all peak is within reach)."""
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width),
                                         nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(depth)])


def _cuts(gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], *,
          model: nn.Module) -> dict[str, Any]:
    """Saved bytes (the partitioner's size of the saved nodes) of plain torch.compile's
    cut and of slackswap.compile's at 1.0 and 0.5, with the latter's profile."""
    n = kwargs["num_fwd_outputs"]
    out: dict[str, Any] = {}
    fw, _ = partitioners.min_cut_rematerialization_partition(copy.deepcopy(gm),
                                                             joint_inputs, **kwargs)
    out["plain"] = partitioner_estimate.cut_estimate(fw, _, n)["saved_bytes"]
    for budget in (1.0, 0.5):
        state = CompiledPlan(budget, resolve_hardware("h200"), "slackswap", model, "test")
        fw, bw = state.partition(copy.deepcopy(gm), joint_inputs, **kwargs)
        out[budget] = partitioner_estimate.cut_estimate(fw, bw, n)["saved_bytes"]
        out[f"graph {budget}"] = state.graphs[0]
    return out


def test_slackswap_compile_saves_at_most_torch_compiles_bytes_and_half_at_half() -> None:
    """NOTE [the min-cut's free rebuilds]: at keep-all slackswap.compile saves no more
    than plain torch.compile (by the partitioner's own size of the saved nodes, in device
    memory), and at budget 0.5 at most half of that, plus half of what the keep-all peak
    holds beyond those bytes. Why that tolerance: the budget is half the keep-all peak P
    (the simulated activation memory), and every activation a plan keeps is held when
    forward ends (the plan's simulated peak within the budget), so it saves at most
    P / 2 = S / 2 + (P - S) / 2, S plain's saved bytes (all held when forward ends, so
    P >= S); P - S is what the peak holds beyond them (backward's gradients and
    buffers). Before the compiled plan started from the min-cut's partition, its
    keep-all saved what eager saves, more than S."""
    torch.manual_seed(0)
    model, batch = _blocks(), {"input": torch.randn(2048, 64)}
    cut = partitioner_estimate.on_joint(model, batch, functools.partial(_cuts, model=model))
    plain, keep_all, half = cut["plain"], cut[1.0], cut[0.5]
    assert keep_all <= plain
    profile = cut["graph 0.5"].profile
    assert sum(t.bytes for t in profile.saved_activations if t.kind == "activation") \
        == keep_all == plain  # the profile saves what the min-cut saves
    peak = profile.keep_all_peak
    bound = plain / 2 + (peak - plain) / 2
    assert bound < plain  # a plan that saved what plain torch.compile saves would fail
    assert 0 < half <= bound
    assert cut["graph 0.5"].applied.recomputed  # the plan rebuilt some of what it saves


def test_attention_dropout_is_turned_off_for_the_cpu_trace() -> None:
    model, _ = build_model("gpt2-xl-tiny", dtype="fp32", fake=False)
    layers = len(model.transformer.h)
    assert partitioner_estimate.without_attention_dropout(model) == layers
    assert all(block.attn.attn_dropout.p == 0.0 for block in model.transformer.h)
    assert partitioner_estimate.without_attention_dropout(model) == 0
