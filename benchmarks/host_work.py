"""Host work of the eager runtime's CUDA path per step, counted on a CPU.

Run: python benchmarks/host_work.py [--model gpt2-xl] [--layers 12] [--budget 0.5]
        [--strategy slackswap] [--policy behind|done] [--steps 5]
        [--costs benchmarks/host_costs_h200.json] [--json OUT] [--cheap-ops]
        [--keep offload|recompute]
     python benchmarks/host_work.py --measure-costs OUT   # on a CUDA GPU

On an H200 the runtime's Python starved the GPU (``docs/results-gpu.md``), and a timed
ratio on a CPU did not see it. This runs the runtime's own asynchronous (CUDA) branch on
a CPU: the preset is built on the meta device (no memory, no arithmetic: the model's
ops cost only their dispatch) and run under the analytic profiler's CUDA kernel
rewrites (``TargetKernels``: the fused attention and dropout kernels the GPU runs). Its
profile is traced there, priced for the ``h200`` preset: a traced profile, since the
runtime is guided by the real step's ops and lifetimes (sparse watching, offload
deadlines) as by a measured profile on the GPU. Only the stream, event, copy and
pinned-memory calls are stand-ins that count (NOTE [stand-ins for the device calls] in
``slackswap/runtime/streams.py``); everything else is the runtime as it runs on a GPU.

Printed per step: packs, offloads, reloads, watched ops, rebuilds, each device call and
the pool's polls, in forward and in backward; then the predicted host time the runtime
adds to forward on the GPU: this machine's Python time (forward under the plan less
plain forward, both on meta tensors) plus each forward device call times its cost on
the GPU (``--costs``: per-call host costs, from the H200 evidence, refreshed by
``--measure-costs`` on every GPU run). ``--policy behind`` (default) is the most work
the host can be asked to do (no copy seen finished until waited for); ``done`` the
least. Target ("A hot path the GPU never waits for"): at most 10 ms added to forward on
gpt2-xl@12 at 50%.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slackswap
from slackswap.core.jsonio import atomic_write_text, parse_json, read_file
from slackswap.core.plan import Decision
from slackswap.models import build_model, with_layers
from slackswap.profiling.kernels import TargetKernels
from slackswap.runtime.calibrate import device_call_costs
from slackswap.runtime.copies import HostCopies
from slackswap.runtime.saved import SavedValues
from slackswap.runtime.streams import stand_ins

COSTS = Path(__file__).with_name("host_costs_h200.json")


@contextlib.contextmanager
def no_packed_sequence_check() -> Any:
    """transformers asks whether the position ids pack several sequences with a
    data-dependent ``.all()``, which a meta tensor cannot answer (and which is skipped
    under any dispatch mode, as in the runtime's watched segments): without it here."""
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def meta_workload(model: str, layers: int | None, budget: float, strategy: str,
                  hardware: str = "h200", cached: bool = False) -> tuple[Any, dict, Any, Any]:
    """The preset on the meta device, its profile (traced there, under the CUDA kernel
    rewrites the analytic profiler uses, priced for ``hardware``) and its plan;
    ``cached``: the plan from the plan cache (NOTE [plan cache]: the trace on the meta
    device is the same every run) where an earlier call made it."""
    name = with_layers(model, layers)
    net, batch = build_model(name, dtype="bf16", fake=False, device="meta")
    batch = {k: v.to("meta") for k, v in batch.items()}
    with TargetKernels("cuda", dense_masks_are_causal=True), no_packed_sequence_check():
        profile = slackswap.profile(net, batch, hardware, mode="traced", name=name)
    plan = slackswap.plan(profile, budget, hardware, strategy=strategy, cached=cached)
    return net, batch, plan, profile


def keeping(plan: Any, decision: str) -> Any:
    """``plan`` with its ``decision`` ('offload' or 'recompute') activations kept, and
    the prefetch points of what it no longer offloads dropped: what the other kind
    costs the host without it (not a plan to train with: its budget is the original's)."""
    kept = plan.model_copy(deep=True)
    kept.decisions = {k: Decision.KEEP if v == decision else v
                      for k, v in plan.decisions.items()}
    kept.prefetch = {k: at for k, at in plan.prefetch.items()
                     if kept.decisions.get(k) == Decision.OFFLOAD}
    kept._profile = plan._profile
    return kept


@contextlib.contextmanager
def kernels_by_name() -> Any:
    """The CUDA kernel rewrites the profile was traced under (``TargetKernels``: fused
    attention, the fused dropout kernel), as the two functions the model calls by name,
    not as a torch function mode: under a mode every tensor method the runtime calls
    (``size()``, ``view``, ``untyped_storage()``, ...) pays a Python call into it,
    measured 4 to 13 times the method's own cost, and the GPU runs with no mode on. The
    runtime checks each watched op and each save against the profile, so a step that
    ran other ops than it would be refused, not timed."""
    rewrites = TargetKernels("cuda", dense_masks_are_causal=True)
    functional = torch.nn.functional
    attention, dropout = functional.scaled_dot_product_attention, functional.dropout
    functional.scaled_dot_product_attention = rewrites._attention
    functional.dropout = rewrites._dropout
    try:
        yield
    finally:
        functional.scaled_dot_product_attention, functional.dropout = attention, dropout


# NOTE [ops at a GPU host's cost]
#     On the meta device most ops run Python meta kernels (``torch._refs``, the meta
#     registrations): 0.5 to 1.5 ms an op at gpt2-xl@12's sizes, so a plain forward takes
#     about 120 ms here where the H200's host issued it in 14.6 ms. The runtime's calls
#     then sit between long stretches of other Python, which may make each cost more than
#     it would on the GPU's host (its code and data evicted). ``--cheap-ops`` runs both
#     forwards under :class:`CheapOps`, which hands out the outputs of an op it has seen
#     with the same arguments as new meta tensors of the shapes it gave then: a plain
#     forward then takes about 14 ms on this CPU, near the H200 host's. Its own Python
#     call for every op is paid by the plain and the planned forward alike; the
#     runtime's own calls to torch in its pack hook (a detach, a view of host bytes, a
#     host buffer laid out), which on a GPU cost a C++ call each, are kept out of it
#     (``_hooks_unseen``: the hook runs with Python dispatch off, as no mode of the
#     runtime's needs to see its calls); in backward, those of the unpack hook are not
#     (the rebuilds it runs are the model's ops), so backward's figure is overstated.
#     Two costs of this harness are not the runtime's, and are not counted as its: the
#     wrapper that turns dispatch off, about 1.4 us a pack here (timed, and taken off
#     the planned forward once per pack: ``harness_cost_s``), and the slow branch of
#     the runtime's ``detached``, which enters a context of its own while a mode is on,
#     1.6 us more a detach here: on the GPU no mode is on in forward outside a watched
#     segment, so under ``cheap_ops`` it counts the modes other than CheapOps.
#     No library caches a meta op's output geometry by its arguments: FakeTensorMode's
#     cache returns fake tensors, a subclass, which the runtime keeps as saved and never
#     moves.
def _geometry_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return tuple(_geometry_key(y) for y in x)
    return x


class CheapOps(TorchDispatchMode):
    """NOTE [ops at a GPU host's cost]: a functional op's outputs by its arguments'
    geometry, made anew (new storages, as the op would make them) after its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[Any, tuple[bool, list[tuple]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if func.is_view or schema.is_mutable or any(r.alias_info is not None
                                                     for r in schema.returns):
            return func(*args, **kwargs)
        try:
            key = (func, _geometry_key(args), tuple(sorted(
                (k, _geometry_key(v)) for k, v in kwargs.items())))
            made = self.seen.get(key)
        except TypeError:  # an argument that is no key
            return func(*args, **kwargs)
        if made is None:
            out = func(*args, **kwargs)
            outs = [out] if isinstance(out, torch.Tensor) else out
            if isinstance(outs, (list, tuple)) and all(
                    isinstance(o, torch.Tensor) and o.is_meta for o in outs):
                self.seen[key] = (isinstance(out, torch.Tensor),
                                  [(o.shape, o.stride(), o.dtype) for o in outs])
            return out
        single, geometries = made
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                for shape, stride, dtype in geometries]
        return outs[0] if single else tuple(outs)


def unseen(original: Any) -> Any:
    """``original(self, x)`` run with Python dispatch off: no mode sees its ops."""
    def hook(self: Any, x: Any) -> Any:
        with torch._C._DisableTorchDispatch():
            return original(self, x)
    return hook


def harness_cost_s(repeats: int = 20000) -> float:
    """What :func:`unseen`'s wrapper adds to a call, in this machine's seconds: a cost of
    the harness, not of the runtime (NOTE [ops at a GPU host's cost]), taken off the
    planned forward's Python once per pack. The least of five timings of each."""
    import timeit

    def bare(self: Any, x: Any) -> Any:
        return x

    wrapped = unseen(bare)
    times = [min(timeit.repeat(lambda f=f: f(None, None), number=repeats, repeat=5))
             for f in (wrapped, bare)]
    return max(0.0, (times[0] - times[1]) / repeats)


@contextlib.contextmanager
def _hooks_unseen() -> Any:
    """The runtime's saved-tensor hooks run out of :class:`CheapOps`'s sight (NOTE [ops
    at a GPU host's cost])."""
    # (unpack not: the rebuilds it runs are the model's ops, which the GPU's host runs)
    originals = {"pack": SavedValues.pack}
    for name, original in originals.items():
        setattr(SavedValues, name, unseen(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(SavedValues, name, original)


@contextlib.contextmanager
def cheap_ops() -> Any:
    """NOTE [ops at a GPU host's cost]."""
    from slackswap.runtime import recipes

    modes = recipes._dispatch_modes
    # the runtime's ``detached`` asks whether a dispatch mode would see its detach: not
    # this one, which the GPU does not run (NOTE [ops at a GPU host's cost])
    recipes._dispatch_modes = lambda: modes() - 1
    try:
        with CheapOps(), _hooks_unseen():
            yield
    finally:
        recipes._dispatch_modes = modes


@contextlib.contextmanager
def counting_calls(calls: Counter, *methods: tuple[type, str],
                   inside: dict[str, list] | None = None) -> Any:
    """Count calls of the runtime's own methods (``HostCopies.poll``, ...) into ``calls``;
    with ``inside``, each one's CPU seconds and the device calls made inside it too:
    ``inside[name] = [calls, seconds, Counter]`` (the bookkeeping outside the seconds)."""
    originals = [(cls, attr, getattr(cls, attr)) for cls, attr in methods]
    for cls, attr, original in originals:
        def counted(*args: Any, _original: Any = original, _key: str = attr, **kwargs: Any) -> Any:
            calls[_key] += 1
            if inside is None:
                return _original(*args, **kwargs)
            before = Counter(calls)
            begin = time.thread_time()
            out = _original(*args, **kwargs)
            seconds = time.thread_time() - begin
            record = inside.setdefault(_key, [0, 0.0, Counter()])
            record[0] += 1
            record[1] += seconds
            record[2].update(calls - before)
            return out

        setattr(cls, attr, counted)
    try:
        yield calls
    finally:
        for cls, attr, original in originals:
            setattr(cls, attr, original)


def one_step(net: Any, batch: dict, plan: Any = None, guide: Any = None,
             policy: str = "behind", copies: bool = False,
             links: Counter | None = None) -> dict[str, Any]:
    """One training step (planned, or plain when ``plan`` is None): forward and backward
    host seconds (this thread's CPU time: what another process takes of the machine's
    cores is not counted), and what the runtime did in each; ``copies``: what each
    offload and reload cost inside the runtime too (a step of its own: that bookkeeping
    costs time). ``links``: the counter of stand-in links kept open across steps
    (:func:`steps_counted`), as a GPU's links are; without it the step opens its own."""
    calls: Counter = links if links is not None else Counter()
    start = Counter(calls)
    inside: dict[str, list] = {}
    timed = ((HostCopies, "offload"), (HostCopies, "reload"), (HostCopies, "ready"))
    net.zero_grad(set_to_none=True)
    gc.collect()  # each step pays for the collections its own objects set off, no earlier's
    with (stand_ins(calls, policy) if links is None else contextlib.nullcontext(),
          counting_calls(calls, (HostCopies, "poll")),
          counting_calls(calls, *timed, inside=inside) if copies else contextlib.nullcontext(),
          no_packed_sequence_check()):
        begin = time.thread_time()
        if plan is None:
            with kernels_by_name():
                loss, runtime = net(**batch).loss, None
        else:
            with slackswap.apply(net, plan, profile=guide) as runtime, kernels_by_name():
                loss = net(**batch).loss
        forward_s = time.thread_time() - begin
        in_forward = Counter(calls) - start
        begin = time.thread_time()
        with kernels_by_name():
            loss.backward()
        backward_s = time.thread_time() - begin
    in_step = Counter(calls) - start
    for key in ("offload", "reload", "ready"):  # the runtime's methods, not device calls
        in_forward.pop(key, None)
        in_step.pop(key, None)
        if links is not None:
            calls.pop(key, None)
    step: dict[str, Any] = {"forward_s": forward_s, "backward_s": backward_s,
                            "forward": dict(in_forward), "backward": dict(in_step - in_forward),
                            "inside": {k: [n, s, dict(c)] for k, (n, s, c) in inside.items()}}
    if runtime is not None:
        stats, recorder = runtime.stats, runtime.values.recorder
        watch = runtime.values.watch
        step["packs"] = recorder.packs_seen if recorder is not None else None
        step["watched_ops"] = watch.watched_ops if watch is not None else None
        step["stats"] = {k: v for k, v in stats.as_dict().items() if not k.endswith("_s")}
    return step


# NOTE [links kept across steps]
#     On a GPU the runtime makes a device's link once and keeps it from step to step (its
#     streams resolved as each block opens), and an event recorded in one step may be
#     asked about in the next: a host buffer taken from the pool waits for the event of
#     the copy that last used it, often the last backward's reload. Counted with a new
#     stand-in link per step, that call went to the step that made the event, and every
#     step resolved a new link's stream once more. :func:`steps_counted` keeps one
#     stand-in link's counter open across the steps, and each step counts what it called.
@contextlib.contextmanager
def steps_counted(policy: str) -> Any:
    """NOTE [links kept across steps]: the counter to pass as ``one_step(links=)``."""
    with stand_ins(Counter(), policy) as links:
        yield links


def measure(net: Any, batch: dict, plan: Any, guide: Any, steps: int,
            policy: str) -> dict[str, Any]:
    """Planned and plain steps interleaved (drift hits both alike), after a warm-up each;
    the fastest of each."""
    with steps_counted(policy) as links:
        return _measured(net, batch, plan, guide, steps, policy, links)


def _measured(net: Any, batch: dict, plan: Any, guide: Any, steps: int, policy: str,
              links: Counter) -> dict[str, Any]:
    one_step(net, batch, plan, guide, policy, links=links)
    one_step(net, batch, links=links)
    planned, plain = [], []
    for _ in range(steps):
        planned.append(one_step(net, batch, plan, guide, policy, links=links))
        plain.append(one_step(net, batch, links=links))
    last = planned[-1]
    last["inside"] = one_step(net, batch, plan, guide, policy, copies=True,
                              links=links)["inside"]
    # the least of each: another process on the machine only ever adds to a step's time
    return {**last,
            "forward_s": min(s["forward_s"] for s in planned),
            "backward_s": min(s["backward_s"] for s in planned),
            "plain_forward_s": min(s["forward_s"] for s in plain),
            "plain_backward_s": min(s["backward_s"] for s in plain)}


def copy_costs(result: dict[str, Any], costs: dict[str, float]) -> dict[str, float]:
    """The hardware file's ``offload_s`` and ``reload_s`` (NOTE [copy costs] in
    ``slackswap/core/hardware.py``): the runtime's Python per offload (``HostCopies.
    offload``) and per reload (``reload`` and the compute stream's ``ready``), this
    machine's, plus the device calls made inside them priced with ``costs``."""
    inside = result["inside"]

    def per_call(*keys: str) -> float:
        n = inside.get(keys[0], [0])[0]
        if not n:
            return 0.0
        seconds = sum(inside[k][1] for k in keys if k in inside)
        priced = sum(c * costs.get(call, 0.0) * 1e-6 for k in keys if k in inside
                     for call, c in inside[k][2].items())
        return (seconds + priced) / n

    return {"offload_s": per_call("offload"), "reload_s": per_call("reload", "ready")}


def predict(result: dict[str, Any], costs: dict[str, float]) -> dict[str, float]:
    """Host seconds the runtime adds to forward and backward on the GPU the costs are of."""
    out = {}
    for phase in ("forward", "backward"):
        python_s = result[f"{phase}_s"] - result[f"plain_{phase}_s"]
        if phase == "forward":  # the harness's own wrapper, once per pack
            python_s -= result.get("harness_s", 0.0)
        calls_s = sum(n * costs.get(k, 0.0) for k, n in result[phase].items()) * 1e-6
        out[f"{phase}_python_ms"] = 1e3 * python_s
        out[f"{phase}_calls_ms"] = 1e3 * calls_s
        out[f"{phase}_added_ms"] = 1e3 * (python_s + calls_s)
    return out


def measure_costs(path: Path, repeats: int = 2000) -> None:
    """Host cost of each device call the runtime makes, timed on this CUDA GPU (as
    ``slackswap calibrate --costs`` times them), written where ``--costs`` reads them."""
    record = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
              "source": "benchmarks/host_work.py --measure-costs (1 MiB copies)",
              "costs_us": device_call_costs(repeats)}
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


def read_costs(path: Path) -> dict[str, Any]:
    """The per-call host costs ``slackswap calibrate --costs`` writes, read as every file
    is (NOTE [files] in ``slackswap/core/jsonio.py``) and checked: the machine's name and
    a finite, non-negative time in microseconds per call; else an ``InputError``."""
    data = parse_json(read_file(path, "costs file", 2**20), str(path), strict=True)
    costs = data.get("costs_us") if isinstance(data, dict) else None
    if not (isinstance(costs, dict) and isinstance(data.get("machine"), str) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0 for v in costs.values())):
        raise slackswap.InputError(
            f"{path}: not a costs file ('machine', and 'costs_us': microseconds per call, "
            "as slackswap calibrate --costs writes)")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--strategy", default="slackswap")
    parser.add_argument("--policy", default="behind", choices=["behind", "done"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--costs", type=Path, default=COSTS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure-costs", type=Path, metavar="OUT")
    parser.add_argument("--keep", choices=["offload", "recompute"],
                        help="keep what the plan offloads (or recomputes): the host cost "
                             "of the other kind alone")
    parser.add_argument("--cheap-ops", action="store_true",
                        help="the forward's ops at a GPU host's cost (NOTE [ops at a GPU "
                             "host's cost])")
    args = parser.parse_args()
    if args.measure_costs:
        if not torch.cuda.is_available():
            sys.exit("--measure-costs needs a CUDA GPU")
        measure_costs(args.measure_costs)
        return
    try:  # read before measuring: a bad file costs no run
        costs = read_costs(args.costs)
    except slackswap.InputError as e:
        sys.exit(f"error: {e}")
    torch.set_num_threads(1)
    net, batch, plan, guide = meta_workload(args.model, args.layers, args.budget,
                                            args.strategy)
    if args.keep:
        plan = keeping(plan, args.keep)
    with cheap_ops() if args.cheap_ops else contextlib.nullcontext():
        result = measure(net, batch, plan, guide, args.steps, args.policy)
    if args.cheap_ops:
        result["harness_s"] = result["packs"] * harness_cost_s()
    result["predicted"] = predict(result, costs["costs_us"])
    decisions = Counter(d.value for d in plan.decisions.values())
    print(f"{args.model}@{args.layers} {args.strategy} at {args.budget:.0%} (h200 plan: "
          f"{decisions.get('offload', 0)} offloaded, {decisions.get('recompute', 0)} "
          f"recomputed{', the rest kept' if args.keep else ''}), policy {args.policy}, "
          "per step:")
    stats = result["stats"]
    offloads, reloads = result["forward"].get("copy", 0), result["backward"].get("copy", 0)
    print(f"  packs {result['packs']}, watched ops {result['watched_ops']}, offloads "
          f"{offloads}, reloads {reloads}, rebuilt ops {stats['recomputed_ops']}, "
          f"stalls {stats['stalls']}, offload waits {stats['offload_waits']}")
    keys = sorted(set(result["forward"]) | set(result["backward"]))
    print(f"  {'call':16} {'forward':>8} {'backward':>8} {'cost us':>8}")
    for key in keys:
        print(f"  {key:16} {result['forward'].get(key, 0):8d} "
              f"{result['backward'].get(key, 0):8d} {costs['costs_us'].get(key, 0):8.1f}")
    p = result["predicted"]
    print(f"  forward: {1e3 * result['forward_s']:.1f} ms planned, "
          f"{1e3 * result['plain_forward_s']:.1f} ms plain on meta tensors here"
          + (" (ops at a GPU host's cost)" if args.cheap_ops else ""))
    print(f"  predicted host time added on the GPU ({costs['machine']}): forward "
          f"{p['forward_added_ms']:.1f} ms ({p['forward_python_ms']:.1f} Python + "
          f"{p['forward_calls_ms']:.1f} device calls), backward {p['backward_added_ms']:.1f} ms "
          f"({p['backward_python_ms']:.1f} + {p['backward_calls_ms']:.1f})")
    copies = copy_costs(result, costs["costs_us"])
    result["host"] = copies
    print(f"  [host] offload_s = {copies['offload_s']:.1e}, reload_s = "
          f"{copies['reload_s']:.1e} (this machine's Python, {costs['machine']}'s calls)")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
