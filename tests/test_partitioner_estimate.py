"""benchmarks/partitioner_estimate.py on a tiny preset: it runs, and its numbers hold
together (issue 51 item 3, CPU part)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from slackswap.models import build_model

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import partitioner_estimate  # noqa: E402


def test_the_estimates_of_each_cut_hold_together() -> None:
    """At budget 1.0 the knob is plain torch.compile's partition and slackswap.compile
    rebuilds nothing; a tighter knob saves less and rebuilds more; SlackSwap's plan at 0.5
    is simulated within its budget and saves less than its plan at 1.0."""
    torch.manual_seed(0)
    model, batch = build_model("llama-7b-tiny", dtype="fp32", fake=False)
    rows = partitioner_estimate.estimate_points(model, batch, (0.5, 0.7, 1.0), "h200")
    assert not [r for r in rows if "error" in r], rows
    at = {(r["point"], r["budget"]): r for r in rows}
    plain = at["torch.compile", 1.0]
    knob = {b: at["activation_memory_budget", b] for b in (0.5, 0.7, 1.0)}
    fields = ("saved_bytes", "recomputed_ops", "recompute_estimate")
    assert all(knob[1.0][f] == plain[f] for f in fields)
    assert knob[0.5]["saved_bytes"] <= knob[0.7]["saved_bytes"] < plain["saved_bytes"]
    assert knob[0.5]["recompute_estimate"] >= knob[0.7]["recompute_estimate"] \
        > plain["recompute_estimate"]
    keep_all, half = at["slackswap.compile", 1.0], at["slackswap.compile", 0.5]
    assert keep_all["recomputed_ops"] == 0 and keep_all["recompute_estimate"] == 0
    assert keep_all["sim_step_ms"] == keep_all["sim_keep_all_step_ms"]
    assert half["recomputed_ops"] > 0 and half["saved_bytes"] < keep_all["saved_bytes"]
    assert half["sim_peak_gb"] <= half["plan_budget_gb"]


def test_attention_dropout_is_turned_off_for_the_cpu_trace() -> None:
    model, _ = build_model("gpt2-xl-tiny", dtype="fp32", fake=False)
    layers = len(model.transformer.h)
    assert partitioner_estimate.without_attention_dropout(model) == layers
    assert all(block.attn.attn_dropout.p == 0.0 for block in model.transformer.h)
    assert partitioner_estimate.without_attention_dropout(model) == 0
