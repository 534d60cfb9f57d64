"""The activation peak of steps that leave the profiled path, against plain PyTorch's.

Run: python benchmarks/off_path_memory.py [--models switch,whisper,wav2vec2,opt] [--seeds 6]

For each model (Switch from ``tests/zoo.py``; Whisper, Wav2Vec2 and OPT with LayerDrop 0.5
from ``tests/test_layerdrop.py``) and each step seed: the step's activation peak under
plain PyTorch and under two plans (SlackSwap's at 50%, against its budget, and keep and
offload in turn), as
PyTorch's ``MemTracker`` measures it (``tests/memory_tracking.py``, apart from the
runtime's own accounting), whether the step left the profiled path, and whether its loss
and gradients are plain PyTorch's bit for bit (NOTE [a step off the profiled path] in
``slackswap/runtime/block.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import slackswap
from slackswap.core.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _models() -> dict[str, Any]:
    import test_layerdrop
    import zoo

    return {"switch": lambda: zoo.switch()[:2], "whisper": test_layerdrop._whisper,
            "wav2vec2": test_layerdrop._wav2vec2, "opt": test_layerdrop._opt}


def step(model: torch.nn.Module, batch: dict, seed: int, plan: Plan | None = None,
         profile: Any = None) -> tuple[int, bool, list[torch.Tensor]]:
    """(activation peak, off the profiled path, loss and gradients) of one step."""
    from memory_tracking import ActivationMemory

    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    memory = ActivationMemory(model, batch)
    block = slackswap.apply(model, plan, profile=profile) if plan is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memory:
            with block if block is not None else contextlib.nullcontext():
                loss = model(**batch).loss
            loss.backward()
    values = [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]
    return memory.peak, bool(block is not None and block.stats.off_path), values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="switch,whisper,wav2vec2,opt")
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args()
    factories = _models()
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, batch = factories[name]()
        model.train()
        torch.manual_seed(0)
        profile = slackswap.profile(copy.deepcopy(model), copy.deepcopy(batch), mode="traced")
        names = [t.name for t in profile.saved_activations if t.producer is not None]
        plans = {"slackswap@0.5": slackswap.plan(profile, 0.5),
                 "keep/offload": Plan(fingerprint=profile.fingerprint, strategy="x", decisions={
                     n: ("keep", "offload")[i % 2] for i, n in enumerate(names)})}
        worst, over = 0.0, 0.0
        budget = plans["slackswap@0.5"].budget_bytes
        assert budget is not None
        for seed in range(args.seeds):
            plain, _, want = step(model, batch, seed)
            for label, plan in plans.items():
                peak, off, got = step(model, batch, seed, plan, profile)
                same = len(got) == len(want) and all(map(torch.equal, got, want))
                worst = max(worst, peak / plain) if off else worst
                of_budget = ""
                if plan.budget_bytes is not None:
                    over = max(over, peak / plan.budget_bytes) if off else over
                    of_budget = f"  {peak / plan.budget_bytes:7.2%} of budget"
                print(f"{name:9} seed {seed} {label:13} plain {plain:9,} B  planned "
                      f"{peak:9,} B  {peak / plain:7.2%}  {'off path' if off else 'on path ':8}"
                      f"  {'exact' if same else 'DIFFERS'}{of_budget}", flush=True)
        print(f"{name}: worst off-path step {worst:.2%} of plain PyTorch's peak, "
              f"{over:.2%} of the 50% plan's budget ({budget:,} B)", flush=True)


if __name__ == "__main__":
    main()
