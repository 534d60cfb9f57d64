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

Each row is profiled with the product's stack setting its run used (``simulated_stack``:
``fused`` where the run fused its memory-bound ops, NOTE [stacks] in
``slackswap/core/costmodel.py``). The simulated step is one micro-batch's forward, loss and
backward on one GPU, issued by an eager host. To it the script adds an estimate of the
optimizer step the published figure contains, which the product does not simulate: an
AdamW-style update of the rank's share of the parameters at the preset's HBM bandwidth,
once per ``grad_accum`` micro-batches (``optimizer_seconds``). It leaves out communication
between GPUs (DDP, ZeRO, FSDP collectives, partly overlapped in the real runs), data loading
and checkpoint saving. The ratios before calibration (``published/before.toml``) are
printed beside the current ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slackswap.core.costmodel import step_efficiency
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
from slackswap.sim.collectives import (
    NIC_BUSBW,
    NVLINK_BUSBW,
    OVERLAP_SLOWDOWN,
    CommStep,
    DataParallel,
    Unit,
    data_parallel_step,
)
from slackswap.sim.schedule import min_working_set

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks" / "published" / "runs.toml"
BEFORE = ROOT / "benchmarks" / "published" / "before.toml"
DOC = ROOT / "docs" / "fidelity.md"
COMMAND = "python benchmarks/fidelity.py --write"
UNITS = ("sequences/s/gpu", "tokens/s/gpu", "tokens/s/node", "model-tflops/gpu")
CHECKPOINTING = ("none", "full", "selective")
STACKS = ("eager", "fused")
# NOTE [optimizer estimate]: torch.optim.AdamW(fused=True) calls torch._fused_adamw_(params,
# grads, exp_avgs, exp_avg_sqs, ...), which reads the four fp32 tensors and writes params,
# exp_avgs and exp_avg_sqs in place: 7 x 4 bytes per parameter, a memory-bound pass. LAMB
# (the BERT rows) moves about as much per pass; its rows amortise it over 32 and 128
# micro-batches, where it is negligible either way.
ADAMW_BYTES_PER_PARAM = 28
RANKS_PER_NODE = 8  # GPUs a node of every data-parallel row holds (runs.toml)
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.20  # issue 13's targets for |simulated / published - 1|
TARGET52_MEDIAN, TARGET52_MAX = 0.15, 0.30  # issue 52's (item 3)


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
    simulated_stack: str = "eager"  # the product's stack setting for this run
    optimizer_shards: int = 1  # ranks that share one optimizer update (FSDP, ZeRO-1)
    data_parallel: str = "none"  # none, fsdp, hsdp or ddp (NOTE [data-parallel collectives])
    shard_ranks: int = 1  # ranks a unit is sharded over (fsdp, hsdp), or replicated (ddp)
    replicas: int = 1  # hsdp: replica groups, one a node
    nic_gbps: int = 0  # hsdp: the network a node states, Gb/s
    gather_bytes: int = 2  # bytes a parameter element moves when gathered
    reduce_bytes: int = 2  # bytes a gradient element moves when reduced
    zero1: bool = False  # ddp: parameters gathered from their owners after each update
    fsdp2: bool = False  # fully_shard: copies out of each gather, into each reduction
    comm_source: str = ""  # where the collectives' dtypes and sizes are read

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
        if run.simulated_stack not in STACKS:
            raise InputError(f"{run.id}: simulated_stack is one of {STACKS}")
        if not 1 <= run.optimizer_shards <= run.gpus:
            raise InputError(f"{run.id}: optimizer_shards is 1 to gpus ({run.gpus})")
        if run.checkpointing == "selective" and run.modelled:
            raise InputError(f"{run.id}: selective checkpointing is not modelled; "
                             "set modelled = false and say so in notes")
        if run.data_parallel not in ("none", "fsdp", "hsdp", "ddp"):
            raise InputError(f"{run.id}: data_parallel is none, fsdp, hsdp or ddp")
        if run.data_parallel != "none" and len(run.comm_source) < 40:
            raise InputError(f"{run.id}: a data-parallel row needs comm_source")
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


def optimizer_seconds(run: Run, prof: StepProfile, hw: Hardware) -> float:
    """The optimizer step's time per micro-batch (NOTE [optimizer estimate]): the rank's
    share of the parameters, 28 bytes each at the preset's HBM bandwidth for that size,
    once per ``grad_accum`` micro-batches. An estimate the product does not simulate."""
    params = sum(math.prod(t.shape) for t in prof.tensors if t.kind == "parameter")
    moved = params / run.optimizer_shards * ADAMW_BYTES_PER_PARAM
    m = hw.memory
    seconds = moved / (m.hbm_bandwidth * step_efficiency(m.bandwidth_efficiency, moved))
    return seconds / run.grad_accum


def step_units(prof: StepProfile, step_s: float) -> tuple[tuple[Unit, Unit], list[Unit]]:
    """The step as FSDP units (NOTE [data-parallel collectives]): each transformer block,
    and the root's work before and after the blocks in each phase, each unit's op time
    scaled so that all of it is the simulated step ``step_s`` (which adds the host's and
    a plan's costs to the ops), and each unit's parameter elements.

    Forward ops belong to the unit of their module. A backward op's module is the one
    autograd ran it under, which the profile does not always resolve (a model's whole
    backward may name its last block), so the backward is split so: the root's ops before
    the first block's (loss and head), the embeddings' backward (the root's, last), and
    the rest over the blocks in proportion to their forward time."""
    layers = prof.layers

    def unit_of(path: str) -> int:
        for i, layer in enumerate(layers):
            if path == layer or path.startswith(layer + "."):
                return i
        return -1

    fwd = [0.0] * len(layers)
    root_fwd, root_bwd = [0.0, 0.0], [0.0, 0.0]  # before the blocks, after them
    blocks_bwd, in_blocks = 0.0, False
    for op in prof.ops:
        i = unit_of(op.module)
        if op.phase == "forward":
            if i >= 0:
                fwd[i] += op.time_s
            else:
                root_fwd[int(any(fwd))] += op.time_s
        elif op.kind.startswith("embedding"):
            root_bwd[1] += op.time_s
        elif i < 0 and not in_blocks:
            root_bwd[0] += op.time_s
        else:
            in_blocks = True
            blocks_bwd += op.time_s
    forward_total = sum(fwd) or 1.0
    bwd = [blocks_bwd * f / forward_total for f in fwd]
    total = sum(op.time_s for op in prof.ops) or 1.0
    scale = step_s / total
    params = [0] * len(layers)
    root_params = 0
    for t in prof.tensors:
        if t.kind == "parameter":
            i = unit_of((t.name or "").rsplit(".", 1)[0])
            n = math.prod(t.shape)
            if i >= 0:
                params[i] += n
            else:
                root_params += n
    # forward: embeddings, blocks, then norm, head and loss; backward: the head's, the
    # blocks', then the embeddings'
    first = Unit(root_fwd[0] * scale, root_bwd[1] * scale, root_params)
    last = Unit(root_fwd[1] * scale, root_bwd[0] * scale, 0)
    blocks = [Unit(f * scale, b * scale, p) for f, b, p in zip(fwd, bwd, params, strict=True)]
    return (first, last), blocks


def data_parallel(run: Run, slowdown: float = 1.0,
                  hw: Hardware | None = None) -> DataParallel | None:
    """The run's ranks as the collectives' model sees them (NOTE [data-parallel
    collectives]); None for one GPU. A shard group inside a node runs at NVLink's bus
    bandwidth; one across nodes (more ranks than a node's 8), with a NIC per GPU, at the
    lesser of that and its node's NICs together (NCCL runs a ring a NIC, each crossing
    between nodes through its own). HSDP's network is the node's, shared by its 8
    ranks."""
    if run.data_parallel == "none":
        return None
    nic = NIC_BUSBW.get(run.nic_gbps, 0.0)
    across = run.shard_ranks > RANKS_PER_NODE
    copy = 0.0
    if run.fsdp2:  # FSDP2's copies at the preset's HBM rate for a block's parameters
        m = (hw or load_hardware(run.hardware)).memory
        block = 12 * run.hidden * run.hidden * run.gather_bytes  # about a block's
        copy = m.hbm_bandwidth * step_efficiency(m.bandwidth_efficiency, block)
    if across and not nic:
        raise InputError(f"{run.id}: a shard group across nodes needs nic_gbps")
    return DataParallel(
        kind=run.data_parallel, shard_ranks=run.shard_ranks,  # type: ignore[arg-type]
        intra_busbw=min(NVLINK_BUSBW[run.hardware], RANKS_PER_NODE * nic) if across
        else NVLINK_BUSBW[run.hardware],
        gather_bytes=run.gather_bytes, reduce_bytes=run.reduce_bytes,
        replicas=run.replicas, inter_busbw=nic, ranks_per_node=RANKS_PER_NODE,
        sync_every=run.grad_accum, zero1=run.zero1, overlap_slowdown=slowdown,
        copy_bandwidth=copy)


# NOTE [kernel terms carried]: the h200 preset's terms read from its kernel trace, and
# whether each is a property of the kernels (same code on any CUDA GPU), of the GH100 die
# (the H100 SXM's too: 132 SMs at the same clocks), or of the H200's memory.
# ``kernel_passes`` counts the bytes PyTorch's softmax and nll_loss kernels move: kernel
# code, carried to every CUDA preset as is. Carried to h100-sxm only, as h200 takes
# H100's attention figures: the causal attention overheads (key blocks of fixed cost a
# query block) and the rates of kernels bound by their per-element work rather than by
# HBM (``unvectorized_elements_per_s``: index arithmetic a load; ``random_elements_per_s``:
# Philox rounds). Not carried: the reductions' rates (their dependent loads wait on the
# H200's HBM), the unaligned-GEMM cap (no row has an odd GEMM dimension), and anything to
# A100 (another die; no measurement). Shipped presets stay as they are
# (tests/test_hardware_users.py pins their digests, and the stored exact optima were
# solved on them), so the carried step is reported beside the row, not applied.
CARRIED_MEMORY = {"kernel_passes": True}
CARRIED_GH100 = {"compute": ("attention_reference_seq", "attention_causal_forward_overhead",
                             "attention_causal_backward_overhead"),
                 "memory": ("unvectorized_elements_per_s", "random_elements_per_s")}


def carried_hardware(hw: Hardware) -> Hardware | None:
    """``hw`` with the h200 kernel terms NOTE [kernel terms carried] carries to it; None
    where none is carried (h200 itself, a GPU other than A100 or H100)."""
    name = hw.name.split("+")[0]
    if name not in ("a100-80gb", "h100-sxm"):
        return None
    h200 = load_hardware("h200")
    update: dict[str, dict[str, Any]] = {"compute": {}, "memory": dict(CARRIED_MEMORY)}
    if name == "h100-sxm":
        for table, fields in CARRIED_GH100.items():
            update[table].update({k: getattr(getattr(h200, table), k) for k in fields})
    return hw.model_copy(update={t: getattr(hw, t).model_copy(update=u)
                                 for t, u in update.items()})


@dataclass(frozen=True)
class Outcome:
    """A row simulated: the step, and throughput per GPU against the published."""

    run: Run
    strategy: str
    step_s: float  # the product's simulated step
    optimizer_s: float  # the optimizer estimate per micro-batch, added to the step
    compute_share: float  # matmul and attention kernels' share of the profile's op time
    matmul_share: float  # matmul kernels' share of the profile's op time
    hbm_bound_matmul_share: float  # share of matmuls below half the matmul cap (HBM-bound)
    before: float | None  # the ratio before calibration (published/before.toml)
    exposed_s: float = 0.0  # collectives left exposed, with FSDP2's copies (NOTE
    # [data-parallel collectives])
    sharing_s: float = 0.0  # compute slowed by collectives sharing its SMs
    comm_s: float = 0.0  # the collectives' own time, summed, per micro-batch
    carried_step_s: float | None = None  # the step with h200's kernel terms (not applied)
    copy_out_s: float = 0.0  # FSDP2's copies out of its gathers, within exposed_s

    @property
    def simulated(self) -> float:
        """Sequences or tokens per second per GPU, optimizer estimate and communication
        included."""
        return self._per_step / (self.step_s + self.optimizer_s + self.exposed_s
                                 + self.sharing_s)

    @property
    def _per_step(self) -> float:
        return self.run.micro_batch * (self.run.seq if self.run.per_token else 1)

    @property
    def ratio_carried(self) -> float:
        """The ratio with the h200 kernel terms carried (NOTE [kernel terms carried])."""
        extra = 0.0 if self.carried_step_s is None else self.carried_step_s - self.step_s
        return self.ratio_at(self.exposed_s + self.sharing_s + extra)

    def ratio_at(self, extra_s: float) -> float:
        """The ratio with ``extra_s`` in place of the communication (0: none)."""
        step = self.step_s + self.optimizer_s + extra_s
        return self._per_step / step / self.run.published_per_gpu

    @property
    def ratio(self) -> float:
        return self.simulated / self.run.published_per_gpu

    @property
    def error(self) -> float:
        return abs(self.ratio - 1)


def load_before(path: Path = BEFORE) -> dict[str, float]:
    """The ratios before calibration, by row id."""
    return dict(tomllib.loads(path.read_text())["ratio"]) if path.exists() else {}


def simulate_run(run: Run, before: dict[str, float] | None = None) -> Outcome:
    """Profile ``run``'s step on its preset with its stack, simulate it, add the optimizer
    estimate, convert to its throughput."""
    overrides = {"stack": run.simulated_stack} if run.simulated_stack != "eager" else None
    hw = load_hardware(run.hardware, overrides=overrides)
    prof = cached_profile(register(run), hw)
    if run.checkpointing == "full":
        strategy, plan = "checkpoint-blocks (every block)", every_block_recomputed(prof, hw)
    else:  # none; a selective run is simulated keep-all (not modelled, said in its notes)
        strategy, plan = "keep-all", None
    step = simulate(prof, plan, hw).step_time_s
    total = sum(op.time_s for op in prof.ops)
    compute = sum(op.time_s for op in prof.ops if op.category != "memory")
    matmuls = [op for op in prof.ops if op.category == "matmul"]
    slow = hw.compute.matmul_efficiency_cap / 2  # of peak: below it, not FLOP-bound
    hbm_bound = sum(op.time_s for op in matmuls
                    if op.time_s and op.flops / op.time_s < slow * hw.peak(op.dtype))
    carried = None
    if (hw_carried := carried_hardware(hw)) is not None:
        prof_c = cached_profile(register(run), hw_carried)
        plan_c = every_block_recomputed(prof_c, hw_carried) if plan is not None else None
        carried = simulate(prof_c, plan_c, hw_carried).step_time_s
    exposed = sharing = comm = copy_out = 0.0
    if (dp := data_parallel(run, hw=hw)) is not None:
        root, blocks = step_units(prof, step)
        alone = data_parallel_step(root, blocks, dp)
        shared: CommStep = data_parallel_step(
            root, blocks, dataclasses.replace(dp, overlap_slowdown=OVERLAP_SLOWDOWN))
        exposed, sharing, comm = alone.exposed_s + alone.copy_out_s, \
            shared.step_s - alone.step_s, alone.comm_s
        copy_out = alone.copy_out_s
    return Outcome(run, strategy, step, optimizer_seconds(run, prof, hw), compute / total,
                   sum(op.time_s for op in matmuls) / total, hbm_bound / total,
                   (before or {}).get(run.id), exposed, sharing, comm, carried, copy_out)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _stats(outcomes: list[Outcome]) -> tuple[float, float, str]:
    errors = [o.error for o in outcomes]
    worst = max(outcomes, key=lambda o: o.error)
    return statistics.median(errors), worst.error, worst.run.id


def _before_stats(outcomes: list[Outcome]) -> str:
    """Median and max |error| of the same rows before calibration, where all are known."""
    if any(o.before is None for o in outcomes):
        return "before calibration: (not all rows known)"
    errors = {o.run.id: abs(o.before - 1) for o in outcomes if o.before is not None}
    worst = max(errors, key=lambda k: errors[k])
    return (f"before calibration: median {statistics.median(errors.values()):.1%}, max "
            f"{errors[worst]:.1%} ({worst})")


def _group_row(label: str, outcomes: list[Outcome]) -> list[str]:
    ratios = [o.ratio for o in outcomes]
    before = [o.before for o in outcomes if o.before is not None]
    return [label, str(len(ratios)), f"{statistics.median(ratios):.2f}x", _span(outcomes),
            f"{statistics.median(before):.2f}x" if len(before) == len(ratios) else "-"]


def _intro() -> list[str]:
    return [
        "# Fidelity: the cost model against published training runs",
        "",
        f"Regenerate with `{COMMAND}` (it prints this file; profiles are cached as "
        "`slackswap reproduce` caches them: on two cores about a minute with the cache, "
        "three without). Every number here is that script's output; the runs, with their "
        "full configuration and where each number is published, are in "
        "`benchmarks/published/runs.toml`.",
        "",
        "Each row is a published, measured training run. The script builds the same model "
        "from a `transformers` config (no weights), profiles one step at the run's "
        "micro-batch and sequence on the run's hardware preset (analytic, FakeTensorMode), "
        "simulates it keep-all, or with every block recomputed (`checkpoint-blocks`) where "
        "the run checkpointed every block, and converts the simulated step to throughput per "
        "GPU. Each row is profiled with the product's stack setting for what its run used "
        "(column 'stack': `fused` where the run fused its memory-bound ops; NOTE [stacks] "
        "in `src/slackswap/core/costmodel.py`). Two things the published figure contains "
        "and the product's one-GPU step does not are estimated and added: the optimizer "
        "step (column 'optimizer': an AdamW-style pass over the rank's share of the "
        "parameters at the preset's HBM bandwidth, per micro-batch; NOTE [optimizer "
        "estimate] in the script), and the data-parallel collectives of the run's stated "
        "configuration (FSDP, HSDP or DDP with ZeRO-1: all-gathers, reduce-scatters and "
        "all-reduces at published nccl-tests bus bandwidths, overlapped with the step's "
        "compute as the frameworks schedule them; NOTE [data-parallel collectives] in "
        "`src/slackswap/sim/collectives.py`): column 'exposed' is what they add beyond "
        "the compute, 'sharing' what their kernels add by slowing the compute they run "
        "beside (a published average, 18.9%). Ratio = simulated / published: above 1 the "
        "model is optimistic; 'no comm' is the ratio without the collectives. The presets "
        "are as shipped: every constant comes from component evidence cited in its "
        "preset's `[sources]` (microbenchmarks and kernel benchmark tables, never these "
        "rows), and these rows are for judging, not for calibration. 'before' is the "
        "ratio of the same row before that calibration "
        "(`benchmarks/published/before.toml`).",
        "",
        "## Results",
        "",
    ]


def _results(outcomes: list[Outcome]) -> list[str]:
    rows = []
    for o in outcomes:
        r = o.run
        comm = r.data_parallel != "none"
        rows.append([
            r.id + ("" if r.modelled else " *"), f"{r.gpu.split(',')[0]} (`{r.hardware}`)",
            f"{r.micro_batch} x {r.seq}", r.simulated_stack, o.strategy,
            f"{o.step_s * 1e3:.1f} ms", f"{o.optimizer_s * 1e3:.1f} ms",
            f"{o.exposed_s * 1e3:.1f} ms" if comm else "-",
            f"{o.sharing_s * 1e3:.1f} ms" if comm else "-",
            f"{o.compute_share:.0%}", _num(o.simulated), _num(r.published_per_gpu),
            "tokens/s" if r.per_token else "sequences/s",
            "-" if o.before is None else f"{o.before:.2f}x", f"{o.ratio_at(0):.2f}x",
            f"{o.ratio:.2f}x"])
    return _table(["run", "GPU (preset)", "batch x seq", "stack", "simulated as",
                   "simulated step", "optimizer", "exposed", "sharing", "compute share",
                   "simulated", "published", "unit (per GPU)", "before", "no comm", "ratio"],
                  rows)


def _no_comm_stats(outcomes: list[Outcome]) -> str:
    def stats(label: str, errors: dict[str, float]) -> str:
        worst = max(errors, key=lambda k: errors[k])
        return (f"{label}: median {statistics.median(errors.values()):.1%}, max "
                f"{errors[worst]:.1%} ({worst})")

    return (stats("without the collectives", {o.run.id: abs(o.ratio_at(0) - 1)
                                               for o in outcomes}) + "; " +
            stats("with the H200 trace's kernel terms carried too (not applied)",
                  {o.run.id: abs(o.ratio_carried - 1) for o in outcomes}))


def report(outcomes: list[Outcome]) -> str:
    """The Markdown of ``docs/fidelity.md``."""
    modelled = [o for o in outcomes if o.run.modelled]
    med, worst, worst_id = _stats(outcomes)
    lines = _intro() + _results(outcomes)
    lines += [
        "",
        "\\* outside what the product models (see its notes below); counted in the "
        "all-rows figures, left out of the modelled-rows ones. Compute share: matmul and "
        "attention kernels' share of the profile's op time (the rest is memory-bound ops).",
        "",
        f"- **All {len(outcomes)} rows**: median |error| {med:.1%}, max {worst:.1%} "
        f"({worst_id}); {_no_comm_stats(outcomes)}; {_before_stats(outcomes)}.",
    ]
    if modelled and len(modelled) < len(outcomes):
        m_med, m_worst, m_id = _stats(modelled)
        lines.append(f"- **The {len(modelled)} modelled rows**: median |error| {m_med:.1%}, "
                     f"max {m_worst:.1%} ({m_id}); {_no_comm_stats(modelled)}; "
                     f"{_before_stats(modelled)}.")
    within = sum(o.error <= TARGET_MAX for o in outcomes)
    lines += [
        f"- Target (issue 13): median |error| <= {TARGET_MEDIAN:.0%} and every row <= "
        f"{TARGET_MAX:.0%}. Rows within {TARGET_MAX:.0%}: {within} of {len(outcomes)}; "
        f"the median is {'within' if med <= TARGET_MEDIAN else 'outside'} "
        f"{TARGET_MEDIAN:.0%}.",
        f"- Target (issue 52, item 3): median |error| <= {TARGET52_MEDIAN:.0%} and every "
        f"row <= {TARGET52_MAX:.0%}. Rows within {TARGET52_MAX:.0%}: "
        f"{sum(o.error <= TARGET52_MAX for o in outcomes)} of {len(outcomes)}; the median "
        f"is {'within' if med <= TARGET52_MEDIAN else 'outside'} {TARGET52_MEDIAN:.0%}.",
        "",
        "By group (ratio, simulated / published):",
        "",
    ]
    groups = [(f"family {f}", [o for o in outcomes if o.run.family == f])
              for f in dict.fromkeys(o.run.family for o in outcomes)]
    groups += [(f"preset {h}", [o for o in outcomes if o.run.hardware == h])
               for h in dict.fromkeys(o.run.hardware for o in outcomes)]
    lines += _table(["group", "rows", "median", "range", "median before"],
                    [_group_row(label, members) for label, members in groups])
    lines += ["", *_what_it_says(outcomes), "", *_evidence(), "", *_left_out(outcomes), "",
              *_left_over(outcomes), "", *_configurations(outcomes)]
    return "\n".join(lines) + "\n"


def _span(outcomes: list[Outcome]) -> str:
    ratios = sorted(o.ratio for o in outcomes)
    return f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x" if len(ratios) > 1 else f"{ratios[0]:.2f}x"


def _communication_says(outcomes: list[Outcome]) -> list[str]:
    """The bullets of "What it says" on the data-parallel collectives."""
    dp = [o for o in outcomes if o.run.data_parallel != "none" and o.run.modelled]
    if not dp:
        return []
    moved = sorted(dp, key=lambda o: o.ratio_at(0) - o.ratio)
    exposed = [o.exposed_s / (o.step_s + o.optimizer_s) for o in dp]
    sharing = [o.sharing_s / (o.step_s + o.optimizer_s) for o in dp]
    hsdp = [o for o in dp if o.run.data_parallel == "hsdp"]
    fsdp8 = [o for o in dp if o.run.data_parallel == "fsdp"]
    lines = [
        f"- **The collectives explain a part of the gap, not most of it.** Estimated for "
        f"the {len(dp)} modelled data-parallel rows from their stated configuration (NOTE "
        f"[data-parallel collectives]), they add {min(exposed):.1%} to {max(exposed):.1%} "
        f"of the step left exposed and {min(sharing):.1%} to {max(sharing):.1%} by "
        f"slowing the compute they overlap, and move the ratios from "
        f"{moved[0].ratio_at(0):.2f}x to {moved[0].ratio:.2f}x ({moved[0].run.id}, the "
        f"least) up to {moved[-1].ratio_at(0):.2f}x to {moved[-1].ratio:.2f}x "
        f"({moved[-1].run.id}, the most). Inside a node FSDP's gathers hide behind the "
        f"compute of the unit before (a block of these models computes for milliseconds; "
        f"its parameters cross NVLink in a fraction of that): what shows is the root "
        f"unit's gather before the forward and its reduction after the backward "
        f"({_span_ms([o.exposed_s - o.copy_out_s for o in fsdp8])} on the FSDP rows), "
        f"and the SMs the collectives share."]
    fsdp2 = [o for o in dp if o.run.fsdp2]
    if fsdp2:
        lines.append(
            f"- **FSDP2's copies** (torchtitan's rows): `fully_shard` copies each unit's "
            f"parameters out of its gather's buffer on the compute stream, and its "
            f"gradients into the reduction's buffer in fp32 (PyTorch's _fsdp_collectives.py), "
            f"memory-bound copies of the whole model's parameters twice a step and of its "
            f"gradients once, at the preset's HBM rate: "
            f"{_span_ms([o.copy_out_s for o in fsdp2])} of copies out, in the 'exposed' "
            f"column. FSDP1 (the Composer and FMS rows) gathers into its flat parameter "
            f"itself and makes neither.")
    if hsdp:
        lines.append(
            f"- **HSDP's replica all-reduces** cross the network the row states (the Llama-2 "
            f"rows: {', '.join(f'{o.run.nic_gbps} Gbps over {o.run.replicas} nodes' for o in hsdp)}"
            f"), {_span_ms([o.comm_s for o in hsdp])} of collectives a step, most of it "
            f"overlapped with the backward: {_span_ms([o.exposed_s for o in hsdp])} "
            f"exposed and {_span_ms([o.sharing_s for o in hsdp])} of slowed compute. The "
            f"README does not say whether its figure is each node's or each GPU's; taken as "
            f"each node's (per GPU, the all-reduces would take an eighth of the time and "
            f"these rows would move less).")
    return lines


def _kernel_terms_says(outcomes: list[Outcome]) -> list[str]:
    """The bullet of "What it says" on h200's kernel terms carried to other presets."""
    carried = [o for o in outcomes if o.carried_step_s is not None and o.run.modelled]
    if not carried:
        return []
    moves = {o.run.id: o.carried_step_s / o.step_s - 1 for o in carried}
    h100 = [moves[o.run.id] for o in carried if o.run.hardware == "h100-sxm"]
    a100 = [moves[o.run.id] for o in carried if o.run.hardware == "a100-80gb"]
    return [
        f"- **The H200 trace's kernel terms, carried where a source allows** (NOTE [kernel "
        f"terms carried] in the script; reported, not applied, since the shipped presets "
        f"are pinned): the softmax and loss kernels' passes on every CUDA preset, and on "
        f"H100, the die the H200 shares, the causal attention kernel's fixed cost a query "
        f"block (the H100 rows run at 2048 and 4096 tokens, below the 8192 of the "
        f"preset's attention figures) and the rates of kernels bound by their per-element "
        f"work (one element a load; dropout's random numbers). They would lengthen the "
        f"simulated step by {min(a100):.1%} to {max(a100):.1%} on the A100 rows and "
        f"{min(h100):.1%} to {max(h100):.1%} on the H100 rows: what these runs lose is "
        f"not in those kernels. The reductions' rates wait on the H200's memory and carry "
        f"to no other GPU, nothing carries to the A100's die without a measurement, and "
        f"no row has an odd GEMM dimension (their vocabularies are padded), so the "
        f"unaligned-GEMM cap would not apply."]


def _span_ms(values: list[float]) -> str:
    lo, hi = min(values) * 1e3, max(values) * 1e3
    return f"{lo:.1f} ms" if round(lo, 1) == round(hi, 1) else f"{lo:.1f} to {hi:.1f} ms"


def _lookups(outcomes: list[Outcome]) -> tuple[
        dict[str, Outcome], Callable[[str], str], Callable[[str], str]]:
    """The rows by id, and a row's ratio and ratio before calibration as text."""
    by_id = {o.run.id: o for o in outcomes}

    def ratio(run_id: str) -> str:
        return f"{by_id[run_id].ratio:.2f}x" if run_id in by_id else "(not run)"

    def before(run_id: str) -> str:
        known = by_id.get(run_id)
        return f"{known.before:.2f}x" if known and known.before is not None else "(unknown)"

    return by_id, ratio, before


def _what_it_says(outcomes: list[Outcome]) -> list[str]:
    by_id, ratio, before = _lookups(outcomes)

    modelled = [o for o in outcomes if o.run.modelled]
    over = [o for o in modelled if o.ratio > 1]
    a100 = [o for o in modelled if o.run.hardware == "a100-80gb" and o.run.family != "bert"]
    h100 = [o for o in modelled if o.run.hardware == "h100-sxm"]
    lm = a100 + h100
    lines = [
        "## What it says",
        "",
        f"- **The cost model is still optimistic, and calibration did not change that.** "
        f"{len(over)} of the {len(modelled)} modelled rows simulate faster than they ran. "
        f"Each component now has its own evidence (next section), and each moved the rows "
        f"by a few percent: the large matmuls that dominate these steps were already priced "
        f"at what isolated GEMMs measure, and the evidence says they run there. Where a "
        f"kernel trace checks the model op by op (the H200, last section), the analytic "
        f"keep-all step of one GPU is 6% short of the measured one (gpt2-xl@12, "
        f"llama-7b@8); the runs here are multi-GPU training jobs, and what "
        f"is left of them (the section 'What is left, row by row') is outside the kernels "
        f"a one-GPU step runs. Issue 52's target (median within 15%, every row within 30%) "
        f"is not reached: nothing estimated from published evidence closes the gap, and "
        f"no constant is chosen to.",
    ]
    if lm:
        matmul = [o.matmul_share for o in lm]
        lines.append(
            f"- **Matmuls are {min(matmul):.0%} to {max(matmul):.0%} of the op time of the "
            f"GPT-2, MPT and Llama rows**, nearly all large enough to sit at the preset's "
            f"cap: the best-shape MAMF measurement (85.9% of peak on A100, 80.1% on H100), "
            f"which square GEMMs of training size reach too on H100 (4096^3 at 79.7%, "
            f"8192^3 at 80.6% of peak; 2048^3 only 68.4%, now priced so). A step at these "
            f"ratios would need its matmuls at roughly 1/ratio of that, about "
            f"{0.859 / max(o.ratio for o in a100):.0%} to {0.859 / min(o.ratio for o in a100):.0%} "
            f"of peak on A100 and {0.801 / max(o.ratio for o in h100):.0%} to "
            f"{0.801 / min(o.ratio for o in h100):.0%} on H100, below anything a GEMM "
            f"benchmark of these shapes shows. So what the runs lose lies outside the kernels "
            f"as benchmarked alone. The collectives, now estimated (below), are a part "
            f"of it; what they leave is unmeasured here: clocks under sustained power load "
            f"(the A100 FlashAttention measurement cited in the preset notes the SM clock "
            f"falling from 1410 to about 1200 MHz), the frameworks' host work (FSDP's hooks, "
            f"the trainer's loop), data loading. llm-foundry's own MFU column for MPT-7B is "
            f"64.23% on A100 and 46.44% on H100 (same source rows)."
            if a100 and h100 else "- (the A100 or H100 rows were not run)")
        lines.append(
            f"- **A100: {_span(a100)} (median {statistics.median(o.ratio for o in a100):.2f}x, "
            f"before {statistics.median(o.before for o in a100 if o.before):.2f}x); H100: "
            f"{_span(h100)} (median {statistics.median(o.ratio for o in h100):.2f}x, before "
            f"{statistics.median(o.before for o in h100 if o.before):.2f}x).** The fused "
            f"stack made flash-attention's GPT rows more optimistic (gpt2-xl "
            f"{before('gpt2-xl-flash-a100')} to {ratio('gpt2-xl-flash-a100')}): their stack "
            f"fuses dropout, residual add and LayerNorm, which the eager profile priced as "
            f"kernels of their own. On the eager rows two changes pull against each other: "
            f"`_unsafe_view` is no longer priced as a copy (faster), and attention runs at "
            f"measured causal FlashAttention-2 rates (slower: on H100 28.7% of peak forward "
            f"and 29.0% backward against the combined 33.9% before, on A100 50% forward "
            f"against 73%). The Llama-3-8B rows "
            f"({ratio('llama3-8b-fsdp-h100')} without and {ratio('llama3-8b-fsdp-fullac-h100')} "
            f"with full checkpointing, batch 1 of 4096 tokens under FSDP2) stay the worst: "
            f"their GPU variant is not stated, and torchtitan's own H100 benchmark file "
            f"(benchmarks/llama3_h100_202412_torchtitan.md) describes the team's H100s as "
            f"96 GB HBM2e at a 500 W limit, below the SXM preset's compute if these runs "
            f"used them." if a100 and h100 else "- (the A100 or H100 rows were not run)")
    lines += _communication_says(outcomes) + _kernel_terms_says(outcomes)
    return lines + _rest_says(outcomes)


def _rest_says(outcomes: list[Outcome]) -> list[str]:
    """The bullets of "What it says" on BERT, the optimizer, the H200 row, and what is not
    covered."""
    by_id, ratio, before = _lookups(outcomes)

    lines: list[str] = []
    if "bert-large-p1-a100" in by_id and "bert-large-p2-a100" in by_id:
        p2 = by_id["bert-large-p2-a100"]
        lines.append(
            f"- **BERT, now simulated with the fused stack its run used** (TorchScript with "
            f"nvFuser, run_pretraining.py): sequence 512 went from {before('bert-large-p2-a100')} "
            f"to {ratio('bert-large-p2-a100')}, sequence 128 from "
            f"{before('bert-large-p1-a100')} to {ratio('bert-large-p1-a100')}, now inside the "
            f"band of the other A100 rows. At 512 the model is still pessimistic: its attention is "
            f"matmul + softmax (modeling.py BertSelfAttention), so the batched matmuls that "
            f"write and read the [batch, heads, 512, 512] scores are bound by HBM, not by "
            f"their FLOPs ({p2.hbm_bound_matmul_share:.0%} of the simulated op time runs "
            f"below half the matmul cap), and the fused stack cannot remove what autograd "
            f"saves (softmax output, dropout mask, dropped probabilities). What the run did "
            f"differently there is not known from its sources.")
    lines += [
        f"- **The optimizer step**, estimated from its HBM traffic and added here, is at most "
        f"{max(o.optimizer_s / o.step_s for o in outcomes):.1%} of any row's step "
        f"(sharded over the data-parallel group, or amortised over gradient accumulation): "
        f"it does not explain the gap either.",
        f"- **The H200 row** ({ratio('llama3.1-8b-fsdp-h200')}, before "
        f"{before('llama3.1-8b-fsdp-h200')}) is not a like-for-like test: its matmuls are fp8 "
        f"(priced at the bf16 rate), its stack compiled (simulated fused), and its per-op "
        f"selective checkpointing recomputes part of each block (simulated keep-all). It is "
        f"the only published H200 training run found with its full configuration, so it "
        f"stays, marked. The terms the H200 kernel trace calibrated (next to last section) "
        f"do not move it: its GEMMs are aligned, its causal attention runs at 8192 tokens, "
        f"the sequence of the preset's attention figures, and under the fused stack a "
        f"reduction, a kernel that loads one element at a time, dropout or a loss kernel inside a "
        f"run of memory-bound ops is priced with its run (its simulated "
        f"step did not change at a tenth of a millisecond). No other "
        f"row runs on the h200 preset, so these rows judge none of those terms.",
        "- **Not covered**: BERT on H100 or H200 (no published run with its configuration "
        "was found; MLPerf's BERT logs pack variable-length sequences). Communication is "
        "estimated here, in this script, from each run's stated configuration; the "
        "product's simulation stays one GPU's step (next section).",
    ]
    return lines


def _evidence() -> list[str]:
    """The section "The component evidence"."""
    return [
        "## The component evidence",
        "",
        "Every figure is in its preset's `[sources]` with where to read it; what each "
        "component is calibrated on:",
        "",
        "- **Matmuls by size**: A100, MAMF cap 85.9% (stas00/ml-engineering, best of a shape "
        "sweep) over Calculon's size table; H100 and H200, a measured square bf16 sweep "
        "(1024^3 to 8192^3: 17.9%, 68.4%, 79.7%, 80.6% of peak) under the MAMF cap 80.1%. "
        "By dtype: fp32 matmuls at the fp32 (non-TF32) peak, as PyTorch runs them by "
        "default. Shapes beyond size (tile and wave quantization of non-square GEMMs) are "
        "not modelled: no published per-shape sweep of transformer GEMMs on these GPUs was "
        "found, and the square sweep reaches the cap from 4096^3, below the size of these "
        "rows' GEMMs.",
        "- **Memory-bound kernels by size**: Calculon's table of bandwidth efficiency by bytes "
        "moved (30% under 1 MB to 88-90% over 100 MB), the top row capped at a measured read "
        "bandwidth; each kernel at least 1.3 us. On H200 only, reductions (sums, means, "
        "LayerNorm) at their own rates, 31.6% from 1 MB and 40.5% from 100 MB, LayerNorm's "
        "backward reading its inputs twice: this project's kernel trace of gpt2-xl@12 "
        "(NOTE [reductions]; the op-by-op section below). On H200 only too, elementwise "
        "kernels that load one element at a time (a bf16 to fp32 upcast, a pointwise op "
        "with a broadcast operand) at most 343e9 elements/s, from the same trace (NOTE "
        "[unvectorized kernels]), dropout at most 528e9 random numbers/s (NOTE [random "
        "kernels]), and softmax over rows longer than 48 KiB reading its "
        "input three times, its backward the gradient twice, the loss's `nll_loss` kernels "
        "the bytes they touch, read from PyTorch's kernels and checked on the trace (NOTE "
        "[kernel passes]).",
        "- **Attention, forward and backward, causal or not**: FlashAttention-2 measured per "
        "configuration. A100: 59% forward, 50% causal (head dim 128, sequence 4096; a "
        "third-party benchmark, inside the paper's own 50-73% range); backward 63%, the "
        "paper's best figure (no per-shape A100 backward measurement found). H100: 37.4% / "
        "28.7% forward, 29.4% / 29.0% backward (FlashAttention's own benchmark, head dim "
        "128, sequence 8192). H200: the H100 figures at sequence 8192, a causal kernel at a "
        "shorter sequence slowed by a fixed cost per query block read from this project's "
        "kernel trace of gpt2-xl@12 (NOTE [causal attention by sequence]; the op-by-op "
        "section below).",
        "- **The host link by direction**: pinned copy-engine rates from nvbandwidth "
        "(A100, PCIe 4.0: about 25 GB/s each way alone, H2D falling to 11-13 GB/s when both "
        "run) and, for H200, this project's own measurement (docs/results-gpu/link.txt: "
        "55.3 / 55.5 GB/s alone, 50.8 / 52.1 GB/s together, no duplex drop on that host). "
        "By transfer size: a fixed 10 us per copy on top of the rate. Pageable copies are "
        "not modelled: the runtime copies only through pinned buffers (runtime/copies.py), "
        "so no plan moves pageable memory. The link does not enter these rows (keep-all "
        "and recompute-only steps copy nothing).",
        "- **The software stack**: `eager` (every aten op a kernel) or `fused` (each run of "
        "memory-bound ops between compute kernels one kernel, moving only what enters and "
        "outlives it), a hardware setting (`--set stack=fused`). The default is eager: the "
        "product plans steps that its eager runtime executes.",
        "- **The optimizer**: 28 bytes per parameter (fused AdamW reads parameter, gradient "
        "and both moments in fp32, writes three) over the rank's shard at HBM bandwidth; an "
        "estimate in this script only.",
        "- **The collectives**: nccl-tests bus bandwidths as published (NVIDIA/nccl-tests "
        "issue #149: about 200 GB/s on 8 NVLink A100s; NVIDIA/nccl issue #1229: 360 GB/s "
        "reduce-scatter on H100 nodes; NVIDIA/nccl-tests issue #290, a maintainer: 46-48 "
        "GB/s a 400 Gb/s NIC), timed by nccl-tests' own formulas "
        "(doc/PERFORMANCE.md), and the compute they overlap slowed by 18.9% (Lee et al. "
        "2025, arXiv:2507.03114, the average of their runs). Which dtype each framework "
        "gathers and reduces in is read per row (`comm_source` in runs.toml); FSDP2's "
        "copies around its collectives at the preset's HBM rate (PyTorch's "
        "_fsdp_collectives.py). In "
        "`slackswap.sim.collectives`, called by this script only.",
    ]


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
        "optimizer step, and simulates communication only where it is told the ranks "
        "(`slackswap.sim.collectives`, which this script calls with each row's stated "
        "configuration; no profile records it, so `slackswap reproduce`, `fit` and plans "
        "price one GPU's step as before). The optimizer step is estimated here from "
        "evidence and added (its HBM traffic at the preset's bandwidth; 'optimizer "
        "(estimated)' is per micro-batch, against the simulated step): it is a memory-bound "
        "pass over the rank's parameter shard, so with sharding or gradient accumulation it "
        "is a few percent at most. It stays out of the product's step, since a plan "
        "neither changes nor is changed by it (it runs after backward, on model state). "
        "The collectives (NOTE [data-parallel collectives]) are each row's FSDP, HSDP or "
        "DDP traffic at published nccl-tests bus bandwidths (NVLink inside a node: 200 "
        "GB/s on A100, 360 GB/s on H100 and H200; 46 GB/s a 400 Gb/s NIC between nodes), "
        "in the dtypes the row's framework gathers and reduces in ('collectives': exposed "
        "+ sharing, against the simulated step). How much the collectives' kernels slow "
        "the compute beside them is one published average (18.9%, arXiv:2507.03114, "
        "over GPT and LLaMA runs on A100, H100 and two AMD GPUs), not a measurement of "
        "these kernels; without it the 'exposed' column alone is the estimate.",
        "",
        *_table(["run", "optimizer steps", "optimizer (estimated)", "communication",
                 "collectives (estimated)", "other"],
                [[o.run.id, optimizer(o.run),
                  f"{o.optimizer_s * 1e3:.1f} ms ({o.optimizer_s / o.step_s:.1%})",
                  o.run.parallelism,
                  "-" if o.run.data_parallel == "none" else
                  f"{o.comm_s * 1e3:.1f} ms in all; {o.exposed_s * 1e3:.1f} + "
                  f"{o.sharing_s * 1e3:.1f} ms "
                  f"({(o.exposed_s + o.sharing_s) / o.step_s:.1%})",
                  o.run.notes or "-"] for o in outcomes]),
    ]


def _left_over(outcomes: list[Outcome]) -> list[str]:
    """What is left of each row's measured step once everything estimated is added."""
    rows = []
    for o in outcomes:
        published = o._per_step / o.run.published_per_gpu  # seconds a micro-batch took
        simulated = o.step_s + o.optimizer_s + o.exposed_s + o.sharing_s
        carried = "-" if o.carried_step_s is None else (
            f"{(o.carried_step_s - o.step_s) * 1e3:+.1f} ms")
        left = published - simulated
        rows.append([o.run.id, f"{published * 1e3:.1f} ms", f"{o.step_s * 1e3:.1f} ms",
                     f"{o.optimizer_s * 1e3:.1f} ms",
                     f"{(o.exposed_s + o.sharing_s) * 1e3:.1f} ms", carried,
                     f"{left * 1e3:+.1f} ms", f"{left / published:+.0%}"])
    return [
        "## What is left, row by row",
        "",
        "Each row's measured step (a micro-batch's share of the published throughput, per "
        "GPU) against what is estimated of it: the simulated step, the optimizer, the "
        "collectives (exposed and sharing together), and, not applied, what the H200 "
        "trace's kernel terms would add (NOTE [kernel terms carried]). 'left' is the "
        "measured step less the first three: time the runs spent that nothing here "
        "accounts for (negative: the model is pessimistic).",
        "",
        *_table(["run", "measured step", "simulated step", "optimizer", "collectives",
                 "kernel terms (not applied)", "left", "left, of measured"], rows),
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
    before = load_before()
    for run in runs:
        outcome = simulate_run(run, before)
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
        from fidelity_ops import kept_section  # its section, "Op by op on the H200"

        atomic_write_text(DOC, text.rstrip("\n") + "\n" + kept_section(DOC))


if __name__ == "__main__":
    main()
