"""SlackSwap beside what users run instead: activation peak and step time, one device, one run.

On one GPU (the reference is one H200, torch 2.11, transformers 5.17):
    python benchmarks/peers.py --model gpt2-xl --layers 12 --hardware h200 --out OUT
    python benchmarks/peers.py --model llama-7b --layers 8 --hardware h200 --out OUT
Neither run has been timed on the GPU yet: the eager points take seconds, the seven compile
points most of the run (each row's ``seconds``, printed at the end); ``--time-limit 85``
skips the points left once the run is past 85 s, ``--points`` splits a run.
As a smoke test on a CPU (a tiny preset in fp32; compile points are skipped):
    python benchmarks/peers.py --model gpt2-xl --layers 4 --device cpu --steps 2 --out OUT

Points, each (activation peak above the step's start, median step time) after one warm-up:
eager keep-all; Hugging Face gradient checkpointing of every block, every 2nd and every 3rd
block; PyTorch selective activation checkpointing saving matmuls (torchtitan's op-level
SAC) on every block; ``save_on_cpu(pin_memory=True)``; torchtune's ``OffloadActivations``
(or, where torchtune does not import, a stream-based offload of the same kind written
here); SlackSwap eager plans at budgets 0.3, 0.5, 0.7; ``torch.compile`` plain and with
``activation_memory_budget`` 0.3, 0.5, 0.7; ``slackswap.compile`` at 0.3, 0.5, 0.7. A point
that fails is a row with its one-line error. At the end, the Pareto check of issue 49
item 3: every eager peer point (peak p, step t) should have a SlackSwap eager point with
peak <= p and step <= max(0.9 t, 1.03 x keep-all's step). Writes
``peers-<model>.json``, ``.md`` (for docs/results-gpu.md) and ``.png`` into ``--out``;
``--plot JSON`` redraws the plot from a saved JSON (the GPU image may lack matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import slackswap
from slackswap.core.jsonio import atomic_write, atomic_write_text
from slackswap.models import MODEL_PRESETS, build_model, with_layers

GB = 1e9
BUDGETS = (0.3, 0.5, 0.7)
# the goal of issue 49 item 3: a peer is beaten by a SlackSwap eager point no higher in
# peak and no slower than 0.9 of the peer's step, or than 1.03 of keep-all's when that is
# more (a peer as fast as keep-all can only be matched, not beaten by 10%)
PEER_SPEEDUP, KEEP_ALL_SLACK = 0.9, 1.03

# family -> (marker, colour) of the plot; the eager peers are the families the check uses
FAMILIES = {
    "keep-all": ("o", "black"),
    "hf-checkpointing": ("s", "tab:blue"),
    "selective-checkpointing": ("D", "tab:cyan"),
    "save_on_cpu": ("v", "tab:brown"),
    "offload": ("^", "tab:orange"),
    "slackswap": ("*", "tab:red"),
    "torch.compile": ("P", "tab:gray"),
    "compile-budget": ("X", "tab:purple"),
    "slackswap.compile": ("h", "tab:pink"),
}
EAGER_PEERS = ("keep-all", "hf-checkpointing", "selective-checkpointing", "save_on_cpu",
               "offload")
COMPILED = ("torch.compile", "compile-budget", "slackswap.compile")


@dataclass
class Point:
    """One way to run the step: ``setup`` is entered around the warm-up and the timed steps
    and yields the step function (forward and backward)."""

    key: str
    family: str
    label: str
    setup: Callable[[], contextlib.AbstractContextManager[Callable[[], None]]]


# -- the peers -----------------------------------------------------------------------------

def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks, in order (GPT-2's ``h``, Llama's
    ``layers``, BERT's ``layer``): the largest ModuleList of the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise RuntimeError(f"{type(model).__name__} has no ModuleList of blocks")
    return list(max(lists, key=len))


def _plain_step(net: Any, model: torch.nn.Module, batch: dict) -> Callable[[], None]:
    def step() -> None:
        net(**batch).loss.backward()
        # gradients kept between steps (set_to_none=False): the step's peak above its start
        # is then activations and temporaries, as the simulator counts them
        model.zero_grad(set_to_none=False)
    return step


def _in_forward(ctx: Callable[[], contextlib.AbstractContextManager[Any]], model: torch.nn.Module,
                batch: dict) -> Callable[[], None]:
    """A step whose forward runs inside ``ctx()`` (saved-tensor hooks need only be set while
    autograd saves; backward unpacks with the hooks the forward stored)."""
    def step() -> None:
        with ctx():
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=False)
    return step


@contextlib.contextmanager
def keep_all(model: torch.nn.Module, batch: dict) -> Iterator[Callable[[], None]]:
    yield _plain_step(model, model, batch)


@contextlib.contextmanager
def hf_checkpointing(model: torch.nn.Module, batch: dict,
                     every: int) -> Iterator[Callable[[], None]]:
    """Hugging Face's gradient checkpointing (non-reentrant), on every ``every``-th block.

    HF checkpoints each ``GradientCheckpointingLayer`` whose ``gradient_checkpointing`` flag
    is set; enabling sets it on all of them, so the blocks left out are switched back off
    (what newer transformers' ``every_n_layers`` does; 5.17 may not have it). A model whose
    blocks are not such layers gets each chosen block's forward wrapped in
    ``torch.utils.checkpoint`` instead."""
    blocks = _blocks(model)
    chosen = blocks[::every]
    hf = hasattr(model, "gradient_checkpointing_enable") and all(
        hasattr(b, "gradient_checkpointing") for b in blocks)
    if hf:
        # transformers renamed the switch to activation_checkpointing_* after 5.17 (the
        # reference GPU's), keeping the old names as deprecated aliases
        renamed = hasattr(model, "activation_checkpointing_enable")
        if renamed:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        for b in blocks:
            b.gradient_checkpointing = any(b is c for c in chosen)
        try:
            yield _plain_step(model, model, batch)
        finally:
            if renamed:
                model.activation_checkpointing_disable()
            else:
                model.gradient_checkpointing_disable()
    else:
        with _wrapped_forwards(chosen, functools.partial(
                torch.utils.checkpoint.checkpoint, use_reentrant=False)):
            yield _plain_step(model, model, batch)


@contextlib.contextmanager
def _wrapped_forwards(blocks: list[torch.nn.Module],
                      wrap: Callable[..., Any]) -> Iterator[None]:
    """Each block's forward runs as ``wrap(original_forward, *args, **kwargs)``; the
    instance attribute is removed after, which restores the class's forward."""
    for b in blocks:
        b.forward = functools.partial(wrap, b.forward)
    try:
        yield
    finally:
        for b in blocks:
            del b.forward


def _matmul_ops() -> set[Any]:
    """The ops torchtitan's op-level SAC saves (torchtitan/distributed/activation_checkpoint.py,
    ``_save_list``): matmuls and attention. torchtitan recomputes every second ``mm`` to
    save memory; this policy saves them all, as issue 49 asks ("save matmuls")."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


@contextlib.contextmanager
def selective_checkpointing(model: torch.nn.Module,
                            batch: dict) -> Iterator[Callable[[], None]]:
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    save = _matmul_ops()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if func in save
                else CheckpointPolicy.PREFER_RECOMPUTE)

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    with _wrapped_forwards(_blocks(model), functools.partial(
            checkpoint, use_reentrant=False, context_fn=context_fn)):
        yield _plain_step(model, model, batch)


@contextlib.contextmanager
def save_on_cpu(model: torch.nn.Module, batch: dict) -> Iterator[Callable[[], None]]:
    pin = _on_cuda(model)  # pinning needs CUDA's host allocator
    yield _in_forward(lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin), model, batch)


def _on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).is_cuda


class StreamOffload(torch.autograd.graph.saved_tensors_hooks):
    """What torchtune's ``OffloadActivations`` does, in small, for where torchtune is not
    installed: each saved activation of at least ``min_bytes`` is copied to pinned host
    memory on a side stream as forward saves it, and copied back on that stream when
    backward unpacks it (torchtune also prefetches the next one; this waits for each).
    Parameters (and views of them) stay where they are. On a CPU nothing is moved."""

    def __init__(self, model: torch.nn.Module, min_bytes: int = 1024) -> None:
        self.stream = torch.cuda.Stream() if _on_cuda(model) else None
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> Any:
            if (self.stream is None or not t.is_cuda
                    or t.untyped_storage().data_ptr() in weights
                    or t.numel() * t.element_size() < min_bytes):
                return t
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
            # the device memory goes back to the allocator only after the copy has read it
            t.record_stream(self.stream)
            return (host, t.device)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            host, device = packed
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                t = host.to(device, non_blocking=True)
            torch.cuda.current_stream().wait_stream(self.stream)
            t.record_stream(torch.cuda.current_stream())
            return t

        super().__init__(pack, unpack)


def _offloader() -> tuple[str, Callable[[torch.nn.Module], Any]]:
    """torchtune's ``OffloadActivations`` where torchtune imports, else ``StreamOffload``."""
    try:
        from torchtune.training import OffloadActivations
    except Exception:  # noqa: BLE001 - any failure to import means: not available here
        return "stream offload (torchtune not installed)", StreamOffload
    return "torchtune OffloadActivations", lambda model: OffloadActivations()


@contextlib.contextmanager
def offload(model: torch.nn.Module, batch: dict,
            make: Callable[[torch.nn.Module], Any]) -> Iterator[Callable[[], None]]:
    hooks = make(model)  # one for every step, as torchtune's recipes hold it
    yield _in_forward(lambda: hooks, model, batch)


@contextlib.contextmanager
def slackswap_eager(model: torch.nn.Module, batch: dict, profile: Any, budget: float,
                    hardware: str, row: dict) -> Iterator[Callable[[], None]]:
    plan = slackswap.plan(profile, budget, hardware)
    sim = slackswap.simulate(profile, plan, hardware, memory_limit=budget)
    row["note"] = (f"simulated retention {sim.retention:.3f}, simulated peak "
                   f"{_size(sim.peak_bytes / GB)}")
    # one block for every step, as a training loop holds it (its host buffers are reused)
    runtime = slackswap.apply(model, plan, profile=profile)
    yield _in_forward(lambda: runtime, model, batch)


@contextlib.contextmanager
def compiled(model: torch.nn.Module, batch: dict, memory_budget: float | None,
             row: dict) -> Iterator[Callable[[], None]]:
    """``torch.compile(model)``; with ``memory_budget``, the min-cut partitioner's
    ``activation_memory_budget`` is set while it compiles (at the warm-up's call)."""
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    old = functorch_config.activation_memory_budget
    if memory_budget is not None:
        functorch_config.activation_memory_budget = memory_budget
    try:
        yield _plain_step(torch.compile(model), model, batch)
    finally:
        functorch_config.activation_memory_budget = old
        torch._dynamo.reset()


@contextlib.contextmanager
def slackswap_compiled(model: torch.nn.Module, batch: dict, budget: float, hardware: str,
                       row: dict) -> Iterator[Callable[[], None]]:
    torch._dynamo.reset()
    start = time.perf_counter()
    c = slackswap.compile(model, batch, budget=budget, hardware=hardware)
    row["compile_s"] = round(time.perf_counter() - start, 1)
    applied = c.slackswap.applied()
    row["applied"] = applied
    row["note"] = (f"kept {applied.get('kept')}, recomputed {applied.get('recomputed')}, "
                   f"offloaded {applied.get('offloaded')} tensors")
    try:
        yield _plain_step(c, model, batch)
    finally:
        torch._dynamo.reset()


def points(model: torch.nn.Module, batch: dict, hardware: str,
           profile: Callable[[], Any]) -> list[tuple[Point, dict]]:
    """Every point in run order (eager first: compiling is the slow part), each with the
    row it fills. ``profile()`` gives SlackSwap's measured profile, taken on first use."""
    offload_label, make_offloader = _offloader()
    out: list[tuple[Point, dict]] = []

    def add(key: str, family: str, label: str, setup: Callable[..., Any], *args: Any,
            row_arg: bool = False) -> None:
        row: dict[str, Any] = {"key": key, "family": family, "label": label}
        bound = (functools.partial(setup, model, batch, *args, row=row) if row_arg
                 else functools.partial(setup, model, batch, *args))
        out.append((Point(key, family, label, bound), row))

    add("keep-all", "keep-all", "eager, keep-all", keep_all)
    for every, which in ((1, "every block"), (2, "every 2nd block"), (3, "every 3rd block")):
        add(f"hf-every-{every}", "hf-checkpointing", f"eager, HF gradient checkpointing, {which}",
            hf_checkpointing, every)
    add("sac-matmul", "selective-checkpointing",
        "eager, selective checkpointing saving matmuls, every block", selective_checkpointing)
    add("save-on-cpu", "save_on_cpu", f"eager, save_on_cpu(pin_memory={_on_cuda(model)})",
        save_on_cpu)
    add("offload", "offload", f"eager, {offload_label}", offload, make_offloader)

    def planned(model: torch.nn.Module, batch: dict, budget: float, *,
                row: dict) -> contextlib.AbstractContextManager[Callable[[], None]]:
        return slackswap_eager(model, batch, profile(), budget, hardware, row)

    for b in BUDGETS:
        add(f"slackswap-{b}", "slackswap", f"eager, slackswap plan at {b}", planned, b,
            row_arg=True)
    add("compile", "torch.compile", "torch.compile", compiled, None, row_arg=True)
    for b in BUDGETS:
        add(f"compile-amb-{b}", "compile-budget",
            f"torch.compile, activation_memory_budget={b}", compiled, b, row_arg=True)
    for b in BUDGETS:
        add(f"slackswap-compile-{b}", "slackswap.compile", f"slackswap.compile(budget={b})",
            slackswap_compiled, b, hardware, row_arg=True)
    return out


# -- measuring -----------------------------------------------------------------------------

def _cpu_peak_tracker() -> Any:
    """The project's activation-memory tracker (tests/memory_tracking.py: PyTorch's
    MemTracker counting activations and temporaries, gradients left out), for a CPU, where
    there is no allocator peak to read; None where it does not import."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    try:
        from memory_tracking import ActivationMemory
    except Exception:  # noqa: BLE001 - then CPU peaks are reported as not measured
        return None
    return ActivationMemory


def measure(point: Point, row: dict, steps: int, cuda: bool, model: torch.nn.Module,
            batch: dict, tracker: Any) -> None:
    """Fill ``row`` with the median step time and the highest peak over ``steps`` steps
    after one warm-up; on an error, with its first line instead."""
    start = time.perf_counter()
    try:
        with point.setup() as step:
            warm = time.perf_counter()
            step()  # the warm-up: compiles, allocates gradients and pinned buffers
            if cuda:
                torch.cuda.synchronize()
            row["warmup_s"] = round(time.perf_counter() - warm, 2)
            times, peaks = [], []
            for _ in range(steps):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                t = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                if cuda:
                    peaks.append(torch.cuda.max_memory_allocated() - before)
            row["step_ms"] = statistics.median(times) * 1e3
            if cuda:
                row["peak_gb"] = max(peaks) / GB
            elif tracker is not None and point.family not in COMPILED:
                # one more step, untimed: the tracker slows every op
                with tracker(model, batch) as memory:
                    step()
                row["peak_gb"] = memory.peak / GB
                if point.family in ("save_on_cpu", "offload"):
                    row["note"] = "on a CPU, its host copies are device memory too"
            else:
                row["peak_gb"] = None
                row["note"] = "; ".join(filter(None, [
                    row.get("note"), "peak not measured on a CPU"]))
    except Exception as e:  # noqa: BLE001 - a failed point is a row, never the end of the run
        first = (str(e).strip().splitlines() or [""])[0]
        row["error"] = f"{type(e).__name__}: {first}"[:300]
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    row["seconds"] = round(time.perf_counter() - start, 1)


# -- the Pareto check ----------------------------------------------------------------------

def pareto(rows: list[dict]) -> list[dict]:
    """For every eager peer point: the SlackSwap eager points that beat it (peak <= p and
    step <= max(0.9 t, 1.03 x keep-all's step)), or, when none does, the closest one and
    by how much it misses (relative excess of peak and of step over the bound)."""
    ok = [r for r in rows if r.get("step_ms") is not None and r.get("peak_gb") is not None]
    keep = next((r for r in ok if r["key"] == "keep-all"), None)
    floor = KEEP_ALL_SLACK * keep["step_ms"] if keep else 0.0
    ours = [r for r in ok if r["family"] == "slackswap"]
    verdicts = []
    for peer in (r for r in ok if r["family"] in EAGER_PEERS):
        bound = max(PEER_SPEEDUP * peer["step_ms"], floor)
        misses = []
        for s in ours:
            peak_over = s["peak_gb"] / peer["peak_gb"] - 1 if peer["peak_gb"] else (
                0.0 if s["peak_gb"] <= 0 else float("inf"))
            misses.append((max(peak_over, 0.0), max(s["step_ms"] / bound - 1, 0.0), s["key"]))
        beaten = [k for p, t, k in misses if p == 0 and t == 0]
        v: dict[str, Any] = {"peer": peer["key"], "peak_gb": peer["peak_gb"],
                             "step_ms": peer["step_ms"], "bound_ms": bound, "beaten_by": beaten,
                             "closest": None}
        if not beaten and misses:
            p, t, k = min(misses, key=lambda m: (max(m[0], m[1]), m[0] + m[1]))
            v["closest"] = {"key": k, "peak_over": p, "step_over": t}
        verdicts.append(v)
    return verdicts


def pareto_lines(verdicts: list[dict], have_keep_all: bool) -> list[str]:
    lines = []
    if not have_keep_all:
        lines.append("(no keep-all point: the bound is 0.9 x the peer's step alone)")
    for v in verdicts:
        head = (f"{v['peer']} ({_size(v['peak_gb'])}, {v['step_ms']:.1f} ms; "
                f"bound {v['bound_ms']:.1f} ms)")
        if v["beaten_by"]:
            lines.append(f"beaten:  {head} by {', '.join(v['beaten_by'])}")
        elif v["closest"]:
            c = v["closest"]
            lines.append(f"missed:  {head}; closest {c['key']}: peak +{c['peak_over']:.1%}, "
                         f"step +{c['step_over']:.1%} over the bound")
        else:
            lines.append(f"missed:  {head}; no SlackSwap eager point ran")
    return lines


# -- output --------------------------------------------------------------------------------

def _fmt(x: float | None, unit: str, digits: int) -> str:
    return "—" if x is None else f"{x:.{digits}f} {unit}"


def _size(gb: float | None) -> str:
    """GB, or MB below one (a tiny model's peaks on a CPU)."""
    if gb is None:
        return "—"
    return f"{gb:.2f} GB" if gb >= 1 else f"{gb * 1e3:.2f} MB"


def markdown(result: dict) -> str:
    lines = [f"| {result['model']} ({result['device']}) | step | activation peak | notes |",
             "|---|---|---|---|"]
    for r in result["rows"]:
        notes = r.get("error") or r.get("skipped") or "; ".join(filter(None, [
            r.get("note"), f"compiled in {r['compile_s']} s" if "compile_s" in r else "",
            f"warm-up (compiling) {r['warmup_s']} s"
            if r["family"] in COMPILED and "warmup_s" in r else ""]))
        lines.append(f"| {r['label']} | {_fmt(r.get('step_ms'), 'ms', 1)} | "
                     f"{_size(r.get('peak_gb'))} | {notes} |")
    lines += ["", "Pareto check (eager peers against SlackSwap eager plans):", ""]
    lines += [f"- {line}" for line in result["pareto_lines"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> str | None:
    """Step time against activation peak, one marker per family; returns why not, if not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e} (redraw here with --plot JSON)"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    drawn = False
    peaks = [r["peak_gb"] for r in result["rows"] if r.get("peak_gb") is not None]
    scale, unit = (1, "GB") if max(peaks, default=1) >= 1 else (1e3, "MB")
    for family, (marker, colour) in FAMILIES.items():
        rows = [r for r in result["rows"] if r["family"] == family
                and r.get("step_ms") is not None and r.get("peak_gb") is not None]
        if not rows:
            continue
        ax.scatter([r["peak_gb"] * scale for r in rows], [r["step_ms"] for r in rows],
                   marker=marker, color=colour, s=110 if marker == "*" else 60, label=family)
        drawn = True
        for r in rows:
            ax.annotate(r["key"], (r["peak_gb"] * scale, r["step_ms"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel(f"activation peak above the step's start ({unit})")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{result['model']} on {result['device']}: step time against peak")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
    return None


# -- the run -------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tiny", action="store_true",
                        help="the preset's tiny variant (always, on a CPU)")
    parser.add_argument("--points", default="*",
                        help="comma-separated patterns of point keys, e.g. 'keep-all,hf-*'")
    parser.add_argument("--cpu-compile", action="store_true",
                        help="run the compile points on a CPU too (minutes of C++ builds)")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="skip the points left once the run is past this many seconds "
                             "(0: no limit)")
    parser.add_argument("--plot", type=Path, help="only redraw the plot of a saved JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the points, print each row as it is measured, write the JSON, markdown and plot;
    returns the JSON's content."""
    args = parse(argv)
    if args.plot is not None:
        result = json.loads(args.plot.read_text())
        why = plot(result, args.plot.with_suffix(".png"))
        print(why or f"wrote {args.plot.with_suffix('.png')}")
        return result
    cuda = args.device == "cuda"
    base = args.model.removesuffix("-tiny")
    tiny = args.tiny or not cuda  # a full-size block takes minutes per step on a CPU
    name = with_layers(f"{base}-tiny" if tiny else base, args.layers)
    start = time.perf_counter()
    # bf16 as trained on a GPU; fp32 on a CPU, where bf16 matmuls are slow and uncommon
    model, batch = build_model(name, dtype="bf16" if cuda else "fp32", fake=False,
                               device=args.device)
    if getattr(model, "loss_type", None) is None:
        # transformers' loss_function logs a warning when loss_type is None, a graph break
        # torch.compile would split the step at (slackswap.compile sets it for its own
        # calls: NOTE [a loss resolved before the graph]); the same loss for every point
        model.loss_type = "ForCausalLM"
    print(f"{name} on {args.device}: built in {time.perf_counter() - start:.1f} s", flush=True)

    profiled: list[Any] = []  # the profile, or why it failed: taken once, by the first plan

    def profile() -> Any:
        if not profiled:
            t = time.perf_counter()
            try:
                profiled.append(slackswap.profile(model, batch, args.hardware,
                                                  mode="measured", name=name))
            except Exception as e:  # noqa: BLE001 - each SlackSwap point reports it
                profiled.append(e)
            print(f"  profiled in {time.perf_counter() - t:.1f} s", flush=True)
        if isinstance(profiled[0], Exception):
            raise profiled[0]
        return profiled[0]

    patterns = [p.strip() for p in args.points.split(",") if p.strip()]
    tracker = None if cuda else _cpu_peak_tracker()
    chosen = [(point, row) for point, row in points(model, batch, args.hardware, profile)
              if any(fnmatch.fnmatchcase(point.key, p) for p in patterns)]
    if not chosen:
        keys = ", ".join(p.key for p, _ in points(model, batch, args.hardware, profile))
        raise SystemExit(f"--points {args.points!r} matches none of: {keys}")
    rows = []
    for point, row in chosen:
        rows.append(row)
        elapsed = time.perf_counter() - start
        if not cuda and point.family in COMPILED and not args.cpu_compile:
            row["skipped"] = "compile points are skipped on a CPU (--cpu-compile runs them)"
        elif args.time_limit and elapsed > args.time_limit:
            row["skipped"] = f"the run was past --time-limit {args.time_limit:g} s"
        else:
            measure(point, row, args.steps, cuda, model, batch, tracker)
        print(json.dumps(row), flush=True)

    verdicts = pareto(rows)
    result = {
        "model": name, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "hardware": args.hardware, "steps": args.steps, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "peak": ("torch.cuda.max_memory_allocated() above memory_allocated() at the step's "
                 "start" if cuda else "tests/memory_tracking.py ActivationMemory on one "
                 "extra step (eager points only)" if tracker else "not measured on a CPU"),
        "rows": rows, "pareto": verdicts,
        "pareto_lines": pareto_lines(verdicts, any(r["key"] == "keep-all"
                                                   and "step_ms" in r for r in rows)),
        "seconds": round(time.perf_counter() - start, 1),
    }
    stem = args.out / f"peers-{name.replace('@', '-')}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(stem.with_suffix(".md"), markdown(result))
    why = plot(result, stem.with_suffix(".png"))
    print("\n" + markdown(result))
    compiles = [r for r in rows if r["family"] in COMPILED and "seconds" in r]
    if compiles:
        print("compile points: " + ", ".join(f"{r['key']} {r['seconds']} s" for r in compiles))
    print(f"{why + '; ' if why else ''}wrote {stem}.json, .md, .png "
          f"in {result['seconds']} s", flush=True)
    return result


if __name__ == "__main__":
    main()
