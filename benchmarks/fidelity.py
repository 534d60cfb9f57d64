"""Simulated against published: the cost model judged on measured training runs.

    python benchmarks/fidelity.py [--write] [--only ID ...]

For each row of ``benchmarks/published/runs.toml`` (a published, measured training run):
builds the model from a ``transformers`` config (no weights, no network) as a model preset
of the row's sizes, micro-batch and sequence; profiles one step analytically on the row's
hardware preset (``cached_profile``, cached by content as ``slackswap reproduce`` caches);
simulates it keep-all, or with every transformer block recomputed from its input
(the ``checkpoint-blocks`` strategy) where the run checkpointed every block; and prints
the simulated per-GPU throughput beside the published one with their ratio. ``--write``
also writes ``docs/fidelity.md``. Nothing is fitted: the presets are as shipped.

The simulated step is one micro-batch's forward, loss and backward on one GPU, issued by
an eager host. It leaves out what the product does not model: the optimizer step (once per
``grad_accum`` micro-batches), communication between GPUs (DDP, ZeRO, FSDP collectives,
partly overlapped in the real runs), data loading and checkpoint saving.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slackswap.core.hardware import Hardware, load_hardware
from slackswap.core.jsonio import atomic_write_text
from slackswap.core.plan import Decision
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError
from slackswap.models import MODEL_PRESETS
from slackswap.models.presets import ModelPreset
from slackswap.planners.baselines import checkpoint_blocks
from slackswap.planners.context import PlanContext
from slackswap.reproduce import cached_profile
from slackswap.sim import simulate
from slackswap.sim.schedule import min_working_set

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks" / "published" / "runs.toml"
DOC = ROOT / "docs" / "fidelity.md"
COMMAND = "python benchmarks/fidelity.py --write"
UNITS = ("sequences/s/gpu", "tokens/s/gpu", "tokens/s/node", "model-tflops/gpu")
CHECKPOINTING = ("none", "full", "selective")
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.20  # issue 13's targets for |simulated / published - 1|


@dataclass(frozen=True)
class Run:
    """One published run (a row of ``runs.toml``); field meanings are in that file."""

    id: str
    family: str
    model: str
    arch: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    gpu: str
    gpus: int
    hardware: str
    precision: str
    micro_batch: int
    seq: int
    grad_accum: int
    attention: str
    checkpointing: str
    stack: str
    parallelism: str
    published: float
    unit: str
    source_repo: str
    source_file: str
    source_where: str
    source_commit: str = ""
    kv_heads: int = 0
    predictions: int = 0
    dropout: float | None = None
    flops_formula: str = ""
    notes: str = ""
    modelled: bool = True  # False: the run used something the product does not model

    @property
    def per_token(self) -> bool:
        """Throughput in tokens (else sequences) per second."""
        return self.unit != "sequences/s/gpu"

    @property
    def published_per_gpu(self) -> float:
        """The published figure as sequences or tokens per second per GPU."""
        if self.unit == "tokens/s/node":
            return self.published / self.gpus
        if self.unit == "model-tflops/gpu":
            return self.published * 1e12 / megatron_flops_per_token(self)
        return self.published

    @property
    def source(self) -> str:
        commit = f" @ {self.source_commit[:12]}" if self.source_commit else ""
        return f"{self.source_repo}{commit}, {self.source_file}"


def megatron_flops_per_token(run: Run) -> float:
    """Model FLOPs per token of a GPT block stack by Narayanan et al. 2021, Section 5.1
    (96·B·s·l·h²·(1 + s/6h + V/16lh) per batch with full recompute), scaled by 3/4 to
    drop the recompute, as flash-attention's training README counts them."""
    if run.flops_formula != "megatron-3/4":
        raise InputError(f"{run.id}: unit {run.unit} needs flops_formula = 'megatron-3/4'")
    h, layers, s, v = run.hidden, run.layers, run.seq, run.vocab
    return 72 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def load_runs(path: Path = RUNS) -> list[Run]:
    """The rows of ``runs.toml``, checked: every field known, units and kernels valid,
    every row with a source."""
    data = tomllib.loads(path.read_text())
    fields = dataclasses.fields(Run)
    names = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    runs = []
    for raw in data.get("run", []):
        if unknown := set(raw) - names:
            raise InputError(f"{path.name}: row {raw.get('id')}: unknown fields {sorted(unknown)}")
        if missing := required - set(raw):
            raise InputError(f"{path.name}: row {raw.get('id')}: missing fields {sorted(missing)}")
        run = Run(**raw)
        if run.unit not in UNITS:
            raise InputError(f"{run.id}: unit '{run.unit}' is not one of {UNITS}")
        if run.attention not in ("sdpa", "eager") or run.arch not in ("bert", "gpt2", "llama"):
            raise InputError(f"{run.id}: attention sdpa|eager, arch bert|gpt2|llama")
        if run.checkpointing not in CHECKPOINTING:
            raise InputError(f"{run.id}: checkpointing is one of {CHECKPOINTING}")
        if run.checkpointing == "selective" and run.modelled:
            raise InputError(f"{run.id}: selective checkpointing is not modelled; "
                             "set modelled = false and say so in notes")
        if not (run.source_repo and run.source_file and len(run.source_where) > 40):
            raise InputError(f"{run.id}: every row needs source_repo, source_file and "
                             "source_where saying where the number is")
        runs.append(run)
    if len({r.id for r in runs}) != len(runs):
        raise InputError(f"{path.name}: row ids repeat")
    return runs


@dataclass(frozen=True)
class _RunPreset(ModelPreset):
    """A row's model: a preset with the run's attention kernel and KV heads."""

    attention: str = "sdpa"
    kv_heads: int = 0

    def config(self, seq: int, attn: str) -> Any:
        cfg = super().config(seq, self.attention)
        if self.kv_heads:
            cfg.num_key_value_heads = self.kv_heads
        return cfg


def register(run: Run) -> str:
    """Register ``run``'s model as a preset of its micro-batch and sequence; its name.

    The name carries a digest of the preset, so the profile cache (keyed by the model's
    structure, which the attention kernel and dropout do not change) never mixes rows."""
    extra: dict[str, Any] = {}
    if run.dropout is not None and run.arch == "gpt2":
        extra = {"resid_pdrop": run.dropout, "embd_pdrop": run.dropout,
                 "attn_pdrop": run.dropout}
    elif run.dropout is not None:
        raise InputError(f"{run.id}: dropout is set for gpt2 rows only")
    preset = _RunPreset(
        name="", family=run.arch, layers=run.layers, hidden=run.hidden, heads=run.heads,
        ffn=run.ffn, vocab=run.vocab, batch=run.micro_batch, seq=run.seq, extra=extra,
        predictions=run.predictions, attention=run.attention, kv_heads=run.kv_heads)
    digest = hashlib.sha256(repr(preset).encode()).hexdigest()[:8]
    name = f"fidelity-{run.id}-{digest}"
    MODEL_PRESETS[name] = dataclasses.replace(preset, name=name)
    return name


def every_block_recomputed(prof: StepProfile, hw: Hardware) -> Any:
    """The ``checkpoint-blocks`` plan with every block checkpointed: its plan at the
    smallest budget one op needs, where no prefix of blocks fits (checked)."""
    ctx = PlanContext(prof, hw, min_working_set(prof)[0])
    plan, _ = checkpoint_blocks(ctx)
    rebuilt = {c.layer for c in ctx.candidates
               if plan.decisions.get(c.name) == Decision.RECOMPUTE}
    if rebuilt != set(range(len(prof.layers))):
        raise RuntimeError(f"checkpoint-blocks rebuilt blocks {sorted(rebuilt)} of "
                           f"{len(prof.layers)}, not all")
    return plan


@dataclass(frozen=True)
class Outcome:
    """A row simulated: the step, and throughput per GPU against the published."""

    run: Run
    strategy: str
    step_s: float
    simulated: float  # sequences or tokens per second per GPU
    compute_share: float  # matmul and attention kernels' share of the profile's op time
    view_share: float  # share priced for `_unsafe_view`, a view that launches no kernel

    @property
    def ratio(self) -> float:
        return self.simulated / self.run.published_per_gpu

    @property
    def error(self) -> float:
        return abs(self.ratio - 1)


def simulate_run(run: Run) -> Outcome:
    """Profile ``run``'s step on its preset, simulate it, convert to its throughput."""
    hw = load_hardware(run.hardware)
    prof = cached_profile(register(run), hw)
    if run.checkpointing == "full":
        strategy, plan = "checkpoint-blocks (every block)", every_block_recomputed(prof, hw)
    else:  # none; a selective run is simulated keep-all (not modelled, said in its notes)
        strategy, plan = "keep-all", None
    step = simulate(prof, plan, hw).step_time_s
    per_step = run.micro_batch * (run.seq if run.per_token else 1)
    total = sum(op.time_s for op in prof.ops)
    compute = sum(op.time_s for op in prof.ops if op.category != "memory")
    views = sum(op.time_s for op in prof.ops if op.kind == "_unsafe_view")
    return Outcome(run, strategy, step, per_step / step, compute / total, views / total)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _stats(outcomes: list[Outcome]) -> tuple[float, float, str]:
    errors = [o.error for o in outcomes]
    worst = max(outcomes, key=lambda o: o.error)
    return statistics.median(errors), worst.error, worst.run.id


def _group_row(label: str, outcomes: list[Outcome]) -> list[str]:
    ratios = [o.ratio for o in outcomes]
    return [label, str(len(ratios)), f"{statistics.median(ratios):.2f}x", _span(outcomes)]


def report(outcomes: list[Outcome]) -> str:
    """The Markdown of ``docs/fidelity.md``."""
    modelled = [o for o in outcomes if o.run.modelled]
    med, worst, worst_id = _stats(outcomes)
    lines = [
        "# Fidelity: the cost model against published training runs",
        "",
        f"Regenerate with `{COMMAND}` (it prints this file; profiles are cached as "
        "`slackswap reproduce` caches them: on two cores about 30 s with the cache, two "
        "minutes without). Every number here is that script's output; the runs, with their "
        "full configuration and where each number is published, are in "
        "`benchmarks/published/runs.toml`.",
        "",
        "Each row is a published, measured training run. The script builds the same model "
        "from a `transformers` config (no weights), profiles one step at the run's "
        "micro-batch and sequence on the run's hardware preset (analytic, FakeTensorMode), "
        "simulates it keep-all, or with every block recomputed (`checkpoint-blocks`) where "
        "the run checkpointed every block, and converts the simulated step to throughput per "
        "GPU. Ratio = simulated / published: above 1 the model is optimistic. The presets "
        "are as shipped: nothing here is fitted, and these rows are for judging, not for "
        "calibration.",
        "",
        "## Results",
        "",
    ]
    rows = []
    for o in outcomes:
        r = o.run
        rows.append([
            r.id + ("" if r.modelled else " *"), f"{r.gpu.split(',')[0]} (`{r.hardware}`)",
            f"{r.micro_batch} x {r.seq}", o.strategy, f"{o.step_s * 1e3:.1f} ms",
            f"{o.compute_share:.0%}", _num(o.simulated), _num(r.published_per_gpu),
            "tokens/s" if r.per_token else "sequences/s", f"{o.ratio:.2f}x"])
    lines += _table(["run", "GPU (preset)", "batch x seq", "simulated as", "simulated step",
                     "compute share", "simulated", "published", "unit (per GPU)", "ratio"],
                    rows)
    lines += [
        "",
        "\\* outside what the product models (see its notes below); counted in the "
        "all-rows figures, left out of the modelled-rows ones. Compute share: matmul and "
        "attention kernels' share of the profile's op time (the rest is memory-bound ops).",
        "",
        f"- **All {len(outcomes)} rows**: median |error| {med:.1%}, max {worst:.1%} "
        f"({worst_id}).",
    ]
    if modelled and len(modelled) < len(outcomes):
        m_med, m_worst, m_id = _stats(modelled)
        lines.append(f"- **The {len(modelled)} modelled rows**: median |error| {m_med:.1%}, "
                     f"max {m_worst:.1%} ({m_id}).")
    within = sum(o.error <= TARGET_MAX for o in outcomes)
    lines += [
        f"- Target (issue 13): median |error| <= {TARGET_MEDIAN:.0%} and every row <= "
        f"{TARGET_MAX:.0%}. {within} of {len(outcomes)} rows are within "
        f"{TARGET_MAX:.0%}; the median is {'within' if med <= TARGET_MEDIAN else 'outside'} "
        f"{TARGET_MEDIAN:.0%}.",
        "",
        "By group (ratio, simulated / published):",
        "",
    ]
    groups = [(f"family {f}", [o for o in outcomes if o.run.family == f])
              for f in dict.fromkeys(o.run.family for o in outcomes)]
    groups += [(f"preset {h}", [o for o in outcomes if o.run.hardware == h])
               for h in dict.fromkeys(o.run.hardware for o in outcomes)]
    lines += _table(["group", "rows", "median", "range"],
                    [_group_row(label, members) for label, members in groups])
    lines += ["", *_what_it_says(outcomes), "", *_left_out(outcomes), "",
              *_configurations(outcomes)]
    return "\n".join(lines) + "\n"


def _span(outcomes: list[Outcome]) -> str:
    ratios = sorted(o.ratio for o in outcomes)
    return f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x" if len(ratios) > 1 else f"{ratios[0]:.2f}x"


def _what_it_says(outcomes: list[Outcome]) -> list[str]:
    by_id = {o.run.id: o for o in outcomes}

    def ratio(run_id: str) -> str:
        return f"{by_id[run_id].ratio:.2f}x" if run_id in by_id else "(not run)"

    def share(run_id: str, field: str) -> str:
        return f"{getattr(by_id[run_id], field):.0%}" if run_id in by_id else "(not run)"

    modelled = [o for o in outcomes if o.run.modelled]
    over = [o for o in modelled if o.ratio > 1]
    a100 = [o for o in modelled if o.run.hardware == "a100-80gb" and o.run.family != "bert"]
    h100 = [o for o in modelled if o.run.hardware == "h100-sxm"]
    views = max(outcomes, key=lambda o: o.view_share)
    lines = [
        "## What it says",
        "",
        f"- **The cost model is optimistic.** {len(over)} of the {len(modelled)} modelled "
        f"rows simulate faster than they ran. The simulated step is a lower bound of a kind: "
        f"one micro-batch's forward and backward, each kernel at the preset's efficiency, "
        f"with no optimizer, no communication, no data loading. Those the published "
        f"figures contain, so some optimism is expected; how much is the measurement.",
    ]
    if a100:
        lines.append(
            f"- **On A100 the GPT-2, MPT and Llama rows sit in one band, {_span(a100)}**, "
            f"across three stacks: flash-attention's fused GPT scripts (ZeRO-1), "
            f"llm-foundry's MPT (FSDP) and IBM's eager Llama-2 (HSDP). The band does not "
            f"depend on whether the stack fuses its elementwise ops, and matmul and "
            f"attention kernels are most of each simulated step (column 'compute share': "
            f"{min(o.compute_share for o in a100):.0%} to "
            f"{max(o.compute_share for o in a100):.0%} of op time), priced at up to the "
            f"preset's cap of 85.9% of peak for matmuls. So the gap lies mostly in how fast "
            f"those kernels run in a training step (shapes, epilogues, NCCL kernels sharing "
            f"the SMs while FSDP and ZeRO overlap communication, clocks under sustained "
            f"load) and in the optimizer and the communication left out; the rows cannot "
            f"tell these apart. llm-foundry's own MFU column for MPT-7B on A100 is 64.23% "
            f"(same source row).")
    if h100:
        lines.append(
            f"- **On H100 the optimism is larger, {_span(h100)}.** The preset's matmul cap "
            f"(80.1%, a measured best GEMM) and FlashAttention-2's 33.9% are the H100 SXM's; "
            f"llm-foundry's MFU column for MPT-7B on H100 is 46.44%, where this model "
            f"simulates the same step {ratio('mpt-7b-h100')} faster. A faster step also "
            f"leaves the same optimizer work and collectives, not modelled, a larger share "
            f"of the real step. "
            f"The Llama-3-8B rows ({ratio('llama3-8b-fsdp-h100')} without and "
            f"{ratio('llama3-8b-fsdp-fullac-h100')} with full checkpointing, batch 1 of 4096 "
            f"tokens under FSDP2) are the worst: their GPU variant is not stated, and "
            f"torchtitan's own H100 benchmark file (benchmarks/llama3_h100_202412_"
            f"torchtitan.md) describes the team's H100s as 96 GB HBM2e at a 500 W limit, "
            f"below the SXM preset's compute if these runs used them.")
    lines += [
        f"- **BERT goes both ways.** NVIDIA's BERT on one GPU (no communication, optimizer "
        f"once per 32 or 128 micro-batches) is {ratio('bert-large-p1-a100')} at sequence "
        f"128 and {ratio('bert-large-p2-a100')} at 512. Its attention is matmul + softmax "
        f"+ dropout on [batch, heads, seq, seq] tensors; the profiler prices the scale, "
        f"softmax and dropout each as an HBM-bound kernel (memory-bound ops: "
        f"{1 - by_id['bert-large-p2-a100'].compute_share:.0%} of the simulated op time at "
        f"512, {1 - by_id['bert-large-p1-a100'].compute_share:.0%} at 128), where the run's "
        f"TorchScript with nvFuser (run_pretraining.py scripts the model unless "
        f"--disable_jit_fusions) fuses elementwise chains. At 128 those tensors hold 4 "
        f"times fewer elements per token and the matmul optimism of the other rows shows "
        f"through."
        if "bert-large-p1-a100" in by_id and "bert-large-p2-a100" in by_id else
        "- **BERT**: (rows not run).",
        f"- **The H200 row** ({ratio('llama3.1-8b-fsdp-h200')}) is not a like-for-like "
        f"test: its matmuls are fp8 and compiled, and its per-op selective checkpointing "
        f"recomputes part of each block, none of which the product models. It is the only "
        f"published H200 training run found with its full configuration, so it stays, "
        f"marked.",
        f"- **A profiler finding, left as it is here:** `_unsafe_view`, which on CUDA is a "
        f"view and launches no kernel, is priced as a copy of its output (up to "
        f"{views.view_share:.1%} of a profile's op time, {views.run.id}). It makes the "
        f"simulated step slower, so it does not explain the optimism.",
        "- **Not covered**: BERT on H100 or H200 (no published run with its configuration "
        "was found; MLPerf's BERT logs pack variable-length sequences), and the time of the "
        "optimizer and of communication, which the product does not model (next section).",
    ]
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header),
            *(f"| {' | '.join(row)} |" for row in rows)]


def _left_out(outcomes: list[Outcome]) -> list[str]:
    def optimizer(run: Run) -> str:
        return "every micro-batch" if run.grad_accum == 1 else (
            f"1 per {run.grad_accum} micro-batches")

    return [
        "## What the simulation leaves out",
        "",
        "The product simulates one micro-batch's step on one GPU. It has no model of the "
        "optimizer step or of communication, so neither is added to the simulated step; "
        "for each run this table says how much of each the published figure contains.",
        "",
        *_table(["run", "optimizer steps (not simulated)", "communication (not simulated)",
                 "other"],
                [[o.run.id, optimizer(o.run), o.run.parallelism, o.run.notes or "-"]
                 for o in outcomes]),
    ]


def _configurations(outcomes: list[Outcome]) -> list[str]:
    kernel = {"sdpa": "flash (SDPA)", "eager": "eager (matmul + softmax)"}
    rows = [[r.id, r.model, f"{r.gpu}; {r.gpus}", r.precision, kernel[r.attention],
             r.checkpointing, r.stack, f"{r.published:,g} {r.unit}",
             f"{r.source}: {r.source_where}"] for r in (o.run for o in outcomes)]
    return [
        "## The runs",
        "",
        *_table(["run", "model", "GPU, GPUs", "precision", "attention", "checkpointing",
                 "stack", "published as", "source"], rows),
        "",
        "fp16 rows are profiled in bf16: every preset gives both the same peak and both are "
        "2 bytes, so the cost model prices them the same.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also write {DOC}")
    parser.add_argument("--only", nargs="+", metavar="ID", help="simulate these rows only")
    args = parser.parse_args()
    start = time.perf_counter()
    runs = load_runs()
    if args.only:
        missing = set(args.only) - {r.id for r in runs}
        if missing:
            sys.exit(f"unknown row ids: {', '.join(sorted(missing))}")
        runs = [r for r in runs if r.id in args.only]
    outcomes = []
    for run in runs:
        outcome = simulate_run(run)
        outcomes.append(outcome)
        print(f"{run.id:28s} {outcome.strategy:32s} simulated {_num(outcome.simulated):>9s}  "
              f"published {_num(run.published_per_gpu):>9s}  ratio {outcome.ratio:.2f}x",
              file=sys.stderr, flush=True)
    text = report(outcomes)
    print(text)
    print(f"{len(outcomes)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.write:
        if args.only:
            sys.exit("--write needs every row; drop --only")
        atomic_write_text(DOC, text)


if __name__ == "__main__":
    main()
