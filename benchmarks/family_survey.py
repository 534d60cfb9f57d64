"""SlackSwap on model families it was not built around: against every baseline and the LP
bound (and, on short steps, the exact model), on every hardware preset.

Run: python benchmarks/family_survey.py [--families mistral,qwen2,neox,opt,phi,gemma]
         [--hardware a100-80gb,h100-sxm] [--layers 2] [--budgets 0.3,0.5,0.7]
         [--exact SECONDS]
Each family is a Hugging Face causal LM built from a config of a published size (no
weights: traced under ``FakeTensorMode``) with ``--layers`` layers at full width, profiled
analytically on each preset. Per budget (fractions of keep-all's peak): SlackSwap's
simulated retention, the best baseline's, the LP bound (``retention_bound``), and flags
where SlackSwap loses to a baseline (``WORSE``), exceeds the bound (``OVER BOUND``) or
plans differently on a second call (``NONDET``). With ``--exact``, also the exact model's
bound (NOTE [exact model] in ``planners/exact.py``; ``*`` when unproven at that time
limit) and its own plan, simulated: a plan SlackSwap could have found.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import slackswap
from slackswap.planners import STRATEGIES
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.exact import exact_optimum
from slackswap.sim.simulate import collector_paused

# (config class, its size arguments, batch, sequence length): published sizes
FAMILIES: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "mistral": ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      vocab_size=32000), 1, 4096),
    "qwen2": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944,
                                  num_attention_heads=28, num_key_value_heads=4,
                                  vocab_size=152064), 1, 4096),
    "neox": ("GPTNeoXConfig", dict(hidden_size=4096, intermediate_size=16384,
                                   num_attention_heads=32, vocab_size=50432), 2, 2048),
    "opt": ("OPTConfig", dict(hidden_size=2048, ffn_dim=8192, num_attention_heads=32,
                              vocab_size=50272, word_embed_proj_dim=2048,
                              max_position_embeddings=2048), 4, 2048),
    "phi": ("PhiConfig", dict(hidden_size=2560, intermediate_size=10240,
                              num_attention_heads=32, vocab_size=51200), 2, 2048),
    "gemma": ("GemmaConfig", dict(hidden_size=3072, intermediate_size=24576,
                                  num_attention_heads=16, num_key_value_heads=16,
                                  head_dim=256, vocab_size=256000), 1, 4096),
}


def build(family: str, layers: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``family`` with ``layers`` layers, its weights fake (bf16), and a real batch."""
    import transformers

    transformers.logging.set_verbosity_error()
    config_class, sizes, batch, seq = FAMILIES[family]
    config = getattr(transformers, config_class)(num_hidden_layers=layers, use_cache=False,
                                                 attn_implementation="sdpa", **sizes)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(dtype)
    ids = torch.randint(0, sizes["vocab_size"], (batch, seq),
                        generator=torch.Generator().manual_seed(0))
    return model.train(), {"input_ids": ids, "labels": ids.clone()}


def survey(ctx: PlanContext) -> dict[str, Any]:
    """SlackSwap, the best baseline and the bound at one budget, and what is wrong."""
    def retention(make: Callable) -> float | None:
        attempt = ctx.attempt(make)
        return attempt[1].retention if attempt is not None and attempt[1].feasible else None

    start = time.perf_counter()
    with collector_paused():  # as the product plans (NOTE [collector paused]): the models
        ours = ctx.attempt(STRATEGIES["slackswap"])  # built here would be walked otherwise
    seconds = time.perf_counter() - start
    again = STRATEGIES["slackswap"](ctx)  # (uncached: a second plan from scratch)
    others = {name: retention(make) for name, make in STRATEGIES.items() if name != "slackswap"}
    best = max(((r, n) for n, r in others.items() if r is not None), default=(None, None))
    mine = ours[1].retention if ours is not None and ours[1].feasible else None
    bound = retention_bound(ctx)
    flags = []
    if best[0] is not None and (mine is None or mine < best[0] - 1e-12):
        flags.append(f"WORSE than {best[1]}")
    if mine is not None and mine > bound + 1e-9:
        flags.append("OVER BOUND")
    if (ours is None) != (again is None) or (
            ours is not None and again is not None and ours[0].decisions != again[0].decisions):
        flags.append("NONDET")
    return dict(ours=mine, best=best[0], baseline=best[1], bound=bound, seconds=seconds,
                flags=flags)


def _pct(retention: float | None) -> str:
    return "-" if retention is None else f"{100 * retention:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--hardware", default="a100-80gb,h100-sxm")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budgets", default="0.3,0.5,0.7")
    parser.add_argument("--exact", type=float, default=0.0,
                        help="time limit of the exact model per case (0: not run)")
    args = parser.parse_args()
    print(f"{'family':8s} {'hardware':10s} {'budget':>6s} {'slackswap':>9s} "
          f"{'best baseline':>22s} {'bound':>6s} {'to bound':>8s} {'plan s':>6s}"
          + (f" {'exact':>7s} {'its plan':>8s}" if args.exact else ""))
    for family in args.families.split(","):
        for preset in args.hardware.split(","):
            hw = slackswap.load_hardware(preset)
            model, batch = build(family, args.layers)
            profile = slackswap.profile(model, batch, hw, name=f"{family}@{args.layers}")
            for fraction in (float(b) for b in args.budgets.split(",")):
                ctx = PlanContext(profile, hw, int(fraction * profile.keep_all_peak))
                head = f"{family:8s} {preset:10s} {fraction:6.0%}"
                if not ctx.reachable:
                    print(f"{head} below the step's working set", flush=True)
                    continue
                row = survey(ctx)
                gap = "-" if row["ours"] is None else f"{100 * (row['bound'] - row['ours']):.2f}"
                line = (f"{head} {_pct(row['ours']):>9s} {row['baseline'] or '-':>15s} "
                        f"{_pct(row['best']):>6s} {_pct(row['bound']):>6s} {gap:>8s} "
                        f"{row['seconds']:6.1f}")
                if args.exact:
                    exact = exact_optimum(ctx, time_limit_s=args.exact)
                    line += (f" {_pct(exact.bound):>6s}{' ' if exact.proven else '*'}"
                             f" {_pct(exact.achieved):>8s}")
                print(line, " ".join(row["flags"]), flush=True)


if __name__ == "__main__":
    main()
