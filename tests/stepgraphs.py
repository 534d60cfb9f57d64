"""Hand-built and random step graphs (``StepProfile``) for simulator tests."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from slackswap.core.hardware import Hardware, load_hardware
from slackswap.core.plan import Plan
from slackswap.core.profile import OpRecord, StepProfile, TensorRecord
from slackswap.errors import SlackSwapError


@dataclass
class Op:
    phase: str
    time: float
    inputs: list[int]
    outputs: list[int]
    inplace: bool = False


@dataclass
class T:
    bytes: int
    kind: str = "activation"
    saved: bool = False
    first_backward_use: int | None = None
    producer: int | None = field(default=None)


def build(ops: list[Op], tensors: list[T], layers: int = 0) -> StepProfile:
    """A profile from op and tensor lists; producers and consumers are derived."""
    records = [
        TensorRecord(id=i, name=None, kind=t.kind, bytes=t.bytes, dtype="bf16",
                     shape=[t.bytes // 2], saved=t.saved,
                     first_backward_use=t.first_backward_use)
        for i, t in enumerate(tensors)
    ]
    op_records = []
    for i, op in enumerate(ops):
        for tid in op.outputs:
            if records[tid].producer is None and records[tid].kind == "activation":
                records[tid].producer = i
        for tid in dict.fromkeys(op.inputs):
            side = records[tid].forward_consumers if op.phase == "forward" \
                else records[tid].backward_consumers
            side.append(i)
        op_records.append(OpRecord(
            index=i, name=f"op{i}", kind=f"k{i % 3}", phase=op.phase,
            module=f"layers.{i % max(layers, 1)}" if layers else "", category="memory",
            dtype="bf16", flops=0, bytes_read=0, bytes_written=0, time_s=op.time,
            inputs=op.inputs, outputs=op.outputs, inplace=op.inplace))
    for t in records:
        if t.saved and t.kind == "activation":
            t.name = f"t{t.id}"
        elif t.saved and t.kind == "input":
            t.name = f"input:{t.id}"
    return StepProfile(model="graph", fingerprint=str(len(ops)) * 8, hardware="a100-80gb",
                       mode="analytic", kernels="cuda", device="cpu",
                       layers=[f"layers.{i}" for i in range(layers)], model_state_bytes=0,
                       ops=op_records, tensors=records)


def random_step(rng: random.Random, n: int) -> StepProfile:
    """A forward chain-DAG of ``n`` ops, autograd-shaped backward, random saves."""
    tensors = [T(rng.randint(1, 64) * 1000, kind="input", saved=True)]
    ops: list[Op] = []
    saves: list[list[int]] = []
    pool = [0]
    for i in range(n):
        if i > 0 and rng.random() < 0.15:  # an in-place op on an earlier activation
            target = rng.choice(pool[1:]) if len(pool) > 1 else None
            if target is not None:
                ops.append(Op("forward", rng.uniform(1e-5, 1e-3), [target, rng.choice(pool)],
                              [target], inplace=True))
                saves.append([])
                continue
        inputs = rng.sample(pool, min(len(pool), rng.choice([1, 1, 2])))
        tid = len(tensors)
        tensors.append(T(rng.randint(1, 64) * 1000))
        ops.append(Op("forward", rng.uniform(1e-5, 1e-3), inputs, [tid]))
        candidates = [x for x in [*inputs, tid] if rng.random() < 0.6]
        saves.append(candidates)
        pool.append(tid)
    grad = len(tensors)
    tensors.append(T(1000))
    ops.append(Op("backward", rng.uniform(1e-5, 1e-4), [], [grad]))
    for i in reversed(range(n)):
        index = len(ops)
        for tid in saves[i]:
            t = tensors[tid]
            t.saved = True
            if t.first_backward_use is None:
                t.first_backward_use = index
        new = len(tensors)
        tensors.append(T(rng.randint(1, 64) * 1000))
        ops.append(Op("backward", rng.uniform(1e-5, 2e-3), [grad, *saves[i]], [new]))
        grad = new
    return build(ops, tensors)


def block_step(rng: random.Random, blocks: int) -> StepProfile:
    """Blocks as in a transformer: u = a(x) saves x or not, s = b(u) saves its output, y =
    c(s, x) saves s or not; u, and x where no op saves it, are never saved, so rebuilding
    s reads them back: checkpoints (named ``c<id>``) a plan may keep or offload."""
    tensors = [T(rng.randint(1, 64) * 1000, kind="input", saved=True)]
    ops: list[Op] = []
    saves: list[list[int]] = []
    x = 0
    for _ in range(blocks):
        u, s, y = len(tensors), len(tensors) + 1, len(tensors) + 2
        tensors += [T(rng.randint(8, 64) * 1000), T(rng.randint(8, 64) * 1000),
                    T(rng.randint(8, 64) * 1000)]
        ops += [Op("forward", rng.uniform(1e-4, 1e-3), [x], [u]),
                Op("forward", rng.uniform(1e-5, 5e-4), [u], [s]),
                Op("forward", rng.uniform(1e-5, 2e-4), [s, x], [y])]
        saves += [[x] if rng.random() < 0.4 else [], [s], [s] if rng.random() < 0.5 else []]
        x = y
    grad = len(tensors)
    tensors.append(T(1000))
    ops.append(Op("backward", rng.uniform(1e-5, 1e-4), [x], [grad]))
    for i in reversed(range(len(saves))):
        for tid in saves[i]:
            tensors[tid].saved = True
            if tensors[tid].first_backward_use is None:
                tensors[tid].first_backward_use = len(ops)
        new = len(tensors)
        tensors.append(T(rng.randint(8, 64) * 1000))
        ops.append(Op("backward", rng.uniform(1e-5, 2e-3), [grad, *saves[i]], [new]))
        grad = new
    profile = build(ops, tensors)
    for t in profile.tensors:
        if t.id in profile.never_saved:
            t.name = f"c{t.id}"
    return profile


def random_plan(rng: random.Random, profile: StepProfile, kinds=("keep", "offload", "recompute")
                ) -> Plan:
    decisions, prefetch = {}, {}
    first_bwd = next(op.index for op in profile.ops if op.phase == "backward")
    for t in profile.saved_activations:
        if t.producer is None:
            continue
        decisions[t.name] = rng.choice(kinds)
        if decisions[t.name] == "offload" and rng.random() < 0.3:
            prefetch[t.name] = rng.randint(first_bwd, t.first_backward_use)
    return Plan(fingerprint=profile.fingerprint, strategy="random", decisions=decisions,
                prefetch=prefetch)


NO_HOST = {"dispatch_s": 0.0, "pack_s": 0.0, "watch_s": 0.0, "replay_s": 0.0, "unpack_s": 0.0}


def link_hardware(d2h: float, h2d: float, duplex_d2h: float, duplex_h2d: float,
                  latency: float = 0.0, host: dict[str, float] | None = None):
    """The reference preset with a different host link (and host costs, when given)."""
    data = load_hardware("a100-80gb").model_dump()
    data["host_link"].update(d2h_bandwidth=d2h, h2d_bandwidth=h2d, duplex_d2h_bandwidth=duplex_d2h,
                             duplex_h2d_bandwidth=duplex_h2d, latency_s=latency)
    if host is not None:
        data["host"].update(host)
    return Hardware.model_validate(data)


def with_host(hw: Hardware | str = "a100-80gb", **costs: float) -> Hardware:
    """``hw`` with its host costs replaced (the rest as they were)."""
    data = load_hardware(hw).model_dump()
    data["host"].update(costs)
    return Hardware.model_validate(data)


GPU_ONLY = with_host(**NO_HOST)  # the reference preset with a host that costs nothing


def best_assignment(ctx, checkpoints: tuple[str, ...] = ()) -> float:
    """The best simulated retention over every keep/offload/recompute assignment of the
    candidates of ``ctx`` (a ``PlanContext``; 0.0 when none fits), each of the named
    ``checkpoints`` kept, offloaded or left to be rebuilt."""
    names = [c.name for c in ctx.candidates]
    best = 0.0
    for combo in itertools.product(("keep", "offload", "recompute"), repeat=len(names)):
        for kept in itertools.product(("keep", "offload", None), repeat=len(checkpoints)):
            decisions = dict(zip(names, combo, strict=True))
            decisions |= {c: k for c, k in zip(checkpoints, kept, strict=True) if k}
            try:
                result = ctx.simulate(ctx.plan("x", decisions))
            except SlackSwapError:  # a decision the plan refuses
                continue
            if result.feasible:
                best = max(best, result.retention)
    return best


def chain_step(rng: random.Random, n: int) -> StepProfile:
    """A line of ``n`` forward ops, each saving its input (``x_k = f_k(x_{k-1})``), and
    backward in reverse: rebuilding x_k reads x_{k-1}, so a plan that recomputes a run of
    them reads the activation before the run through every link of it."""
    tensors = [T(rng.randint(8, 64) * 1000, kind="input", saved=True)]
    ops = [Op("forward", rng.uniform(1e-4, 1e-3), [k], [k + 1]) for k in range(n)]
    tensors += [T(rng.randint(8, 64) * 1000) for _ in range(n)]
    grad = len(tensors)
    tensors.append(T(1000))
    ops.append(Op("backward", rng.uniform(1e-5, 1e-4), [], [grad]))
    for k in reversed(range(n)):  # f_k's backward reads x_{k-1}, its saved input
        tensors[k].saved = True
        if tensors[k].first_backward_use is None:
            tensors[k].first_backward_use = len(ops)
        new = len(tensors)
        tensors.append(T(rng.randint(8, 64) * 1000))
        ops.append(Op("backward", rng.uniform(1e-4, 2e-3), [grad, k], [new]))
        grad = new
    return build(ops, tensors)
