"""The partitioner's own estimate of what it recomputes, for PyTorch's
``activation_memory_budget`` and for ``slackswap.compile``, on CPU, beside the GPU's
measurement (issue 51 item 3, CPU part).

One joint graph per model is traced on the CPU (Dynamo and AOTAutograd run on fake
tensors; the compile is stopped at the partition, so nothing runs at the model's size), and
partitioned once per point, each on a copy of that graph:
- ``torch.compile`` with ``activation_memory_budget`` b: ``min_cut_rematerialization_partition``
  under the knob, as torch.compile partitions;
- ``slackswap.compile(budget=b)``: SlackSwap's planned partition (``CompiledPlan.partition``).
Each cut is read the same way: the forward ops its backward graph runs again and their cost
by the partitioner's own ``estimate_runtime`` (``activation_memory_budget_runtime_estimator``,
FLOPs by default), and the bytes the forward graph saves for backward (the partitioner's
``_size_of``). The FLOPs are turned into time at the hardware preset's dense peak (the
partitioner's estimate has no time of its own on a CPU) and added to plain torch.compile's
measured step, which is the step the estimate predicts; SlackSwap's simulator's step and
peak for its plan stand beside it.

    python benchmarks/partitioner_estimate.py --model gpt2-xl --layers 6 --out OUT
    python benchmarks/partitioner_estimate.py --model llama-7b-tiny --budgets 0.5,1.0
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import operator
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._functorch import config as functorch_config
from torch._functorch import partitioners
from torch._functorch._activation_offloading.activation_offloading import CPU_OFFLOAD_PREFIX
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._subclasses.fake_tensor import FakeTensorMode

import slackswap
from slackswap.compiled.api import CompiledPlan, with_losses_resolved
from slackswap.core.hardware import Hardware
from slackswap.core.jsonio import atomic_write_text
from slackswap.models import build_model, with_layers
from slackswap.profiling.machine import resolve_hardware

GB = 1e9
BUDGETS = (0.3, 0.5, 0.7)


class _Traced(Exception):
    """Raised from the partitioner once the joint graph is captured: nothing is compiled."""


class _Capture(CustomPartitionerFn):
    """Runs ``work`` on the joint graph inside the compile (its fake mode and tracing
    context, which the offloading pass asks for), then stops the compile."""

    def __init__(self, work: Callable[[fx.GraphModule, Any, dict[str, Any]], Any]) -> None:
        self.work, self.result, self.done = work, None, False
        self._uuid = uuid.uuid4().hex  # never a cached partition

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        self.result, self.done = self.work(gm, joint_inputs, kwargs), True
        raise _Traced

    def uuid(self) -> str:
        return self._uuid


def on_joint(model: torch.nn.Module, batch: dict[str, torch.Tensor],
             work: Callable[[fx.GraphModule, Any, dict[str, Any]], Any]) -> Any:
    """``work(gm, joint_inputs, partition_kwargs)`` on the joint graph Inductor hands its
    partitioner for one training step of ``model``; nothing is compiled or run."""
    capture = _Capture(work)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False,
                             options={"custom_partitioner_fn": capture})
    forward = with_losses_resolved(compiled.forward, model)
    try:
        with torch.enable_grad():
            forward(**batch)
    except Exception:
        if not capture.done:
            raise
    finally:
        torch._dynamo.reset()
    if not capture.done:
        raise RuntimeError("the step compiled without a partition")
    return capture.result


def cut_estimate(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int
                 ) -> dict[str, Any]:
    """The partitioner's estimate of a cut: the forward ops backward runs again (views
    and ``getitem`` left out: they make no data) and their ``estimate_runtime`` (FLOPs by
    default: an op that does no matmul counts 1), and the bytes forward saves for backward
    in device memory and, apart, those it offloads (copies to the host, which the
    offloading pass saves in their place)."""
    outputs = [n for n in next(iter(fw.graph.find_nodes(op="output"))).args[0][num_fwd_outputs:]
               if isinstance(n, fx.Node)]
    # the offloading pass's copies to the host: saved, but not in device memory
    offloaded = [n for n in outputs if n.name.startswith(CPU_OFFLOAD_PREFIX)]
    saved = [n for n in outputs if n not in offloaded]
    forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    rebuilt = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in forward
               and not getattr(n.target, "is_view", False) and n.target is not operator.getitem]
    fake = next((v.fake_mode for n in bw.graph.nodes
                 if isinstance(v := n.meta.get("val"), torch.Tensor)
                 and hasattr(v, "fake_mode")), None) or FakeTensorMode()
    with fake:
        cost = sum(partitioners.estimate_runtime(n) for n in rebuilt)
    return {"saved_bytes": saved_activation_bytes(fw, saved),
            "offloaded_bytes": sum(partitioners._size_of(n) for n in offloaded),
            "recomputed_ops": len(rebuilt), "recompute_estimate": float(cost)}


def saved_activation_bytes(fw: fx.GraphModule, saved: list[fx.Node]) -> int:
    """Bytes of what forward saves for backward by the partitioner's ``_size_of``, once per
    storage (a view saved beside its base costs nothing more), leaving out the graph's
    inputs (parameters and the batch) and views of them: they are held anyway."""
    from torch._inductor.fx_utils import get_node_storage

    inputs = {get_node_storage(n) for n in fw.graph.find_nodes(op="placeholder")
              if isinstance(n.meta.get("val"), torch.Tensor)}
    counted, total = set(inputs), 0
    for node in saved:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        storage = get_node_storage(node)
        if storage not in counted:
            counted.add(storage)
            total += partitioners._size_of(node)
    return total


def without_attention_dropout(model: torch.nn.Module) -> int:
    """Attention dropout set to 0, in place; the number of modules changed. On a CPU,
    ``scaled_dot_product_attention`` with dropout runs the math path (the fp32 attention
    matrix and its mask saved, 1.7 GB a layer of gpt2-xl at its batch), where a GPU runs
    its flash kernel, which saves the output and log-sum-exp; without dropout the CPU
    runs its flash kernel too, so the joint graph saves what the GPU's saves."""
    changed = 0
    for module in model.modules():
        drop = getattr(module, "attn_dropout", None)
        if isinstance(drop, torch.nn.Dropout) and drop.p:
            drop.p, changed = 0.0, changed + 1
        if isinstance(getattr(module, "attention_dropout", None), float) \
                and module.attention_dropout:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


def estimate_points(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    budgets: tuple[float, ...], hardware: str,
                    strategy: str = "slackswap") -> list[dict[str, Any]]:
    """One row per point: plain, ``activation_memory_budget`` b and ``slackswap.compile`` b
    (planned by ``strategy``)."""
    return on_joint(model, batch, functools.partial(
        _points, model=model, budgets=budgets, hw=resolve_hardware(hardware),
        strategy=strategy))


def _points(gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], *,
            model: torch.nn.Module, budgets: tuple[float, ...], hw: Hardware,
            strategy: str) -> list[dict[str, Any]]:
    rows = []
    points: list[tuple[str, float]] = [("torch.compile", 1.0)]
    points += [("activation_memory_budget", b) for b in budgets]
    points += [("slackswap.compile", b) for b in budgets]
    for kind, budget in points:
        graph, t = copy.deepcopy(gm), time.perf_counter()
        row: dict[str, Any] = {"point": kind, "budget": budget}
        try:
            if kind == "slackswap.compile":
                state = CompiledPlan(budget, hw, strategy, model, fingerprint="estimate")
                row["strategy"] = strategy
                fw, bw = state.partition(graph, joint_inputs, **kwargs)
                planned = state.graphs[0]
                sim = slackswap.simulate(planned.profile, planned.plan, hw)
                keep_all = slackswap.simulate(planned.profile, None, hw)
                row |= {"sim_step_ms": sim.step_time_s * 1e3, "sim_peak_gb": sim.peak_bytes / GB,
                        "sim_keep_all_step_ms": keep_all.step_time_s * 1e3,
                        "sim_keep_all_peak_gb": planned.profile.keep_all_peak / GB,
                        "plan_budget_gb": planned.plan.budget_bytes / GB}
            else:
                with functorch_config.patch(activation_memory_budget=budget):
                    fw, bw = partitioners.min_cut_rematerialization_partition(
                        graph, joint_inputs, **kwargs)
            row |= cut_estimate(fw, bw, kwargs["num_fwd_outputs"])
        except Exception as e:  # noqa: BLE001 - a point that fails is a row with its error
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        row["seconds"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--strategy", default="slackswap",
                    help="slackswap.compile's planner strategy (the file name says it "
                         "when not slackswap)")
    ap.add_argument("--keep-attention-dropout", action="store_true",
                    help="trace SDPA with its dropout (on a CPU: the math path)")
    args = ap.parse_args(argv)
    name = with_layers(args.model, args.layers) if args.layers else args.model
    torch.manual_seed(0)
    model, batch = build_model(name, dtype=args.dtype, fake=False)
    dropped = 0 if args.keep_attention_dropout else without_attention_dropout(model)
    budgets = tuple(float(b) for b in args.budgets.split(","))
    hw = resolve_hardware(args.hardware)
    rows = estimate_points(model, batch, budgets, args.hardware, args.strategy)
    for row in rows:  # the FLOPs as time at the preset's dense peak
        if "recompute_estimate" in row:
            row["recompute_ms_at_peak"] = row["recompute_estimate"] / hw.peak(args.dtype) * 1e3
    result = {"model": name, "dtype": args.dtype, "hardware": args.hardware,
              "attention_dropout_off_in": dropped,
              "estimator": str(functorch_config.activation_memory_budget_runtime_estimator),
              "torch": torch.__version__, "rows": rows}
    if args.out:
        tail = "" if args.strategy == "slackswap" else f"-{args.strategy}"
        atomic_write_text(args.out / f"estimate-{name.replace('@', '-')}{tail}.json",
                          json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
