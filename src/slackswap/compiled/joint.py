"""The joint forward-backward graph AOTAutograd hands its partitioner, as a
:class:`StepProfile`; a plan written onto it as selective-checkpoint tags; and what the
partitioner then saved and recomputed."""

from __future__ import annotations

import hashlib
import operator
import re
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._functorch import config as functorch_config
from torch._functorch._activation_offloading.activation_offloading import (
    CPU_OFFLOAD_PREFIX,
    GPU_RELOAD_PREFIX,
    can_offload,
)
from torch._functorch.partitioners import (
    classify_nodes,
    get_default_op_list,
    min_cut_rematerialization_partition,
)
from torch.utils._ordered_set import OrderedSet
from torch.utils.checkpoint import CheckpointPolicy

from slackswap.core.costmodel import OpDetail, step_times
from slackswap.core.hardware import Hardware
from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import OpRecord, StepProfile, TensorRecord
from slackswap.errors import InputError
from slackswap.planners.recompute import rebuild_ops
from slackswap.profiling.naming import ActivationNamer, is_random, is_replayable, op_kind
from slackswap.profiling.recorder import dtype_name, op_category, op_flops

__all__ = ["JointGraph", "Applied", "read_joint", "tag_joint", "applied_partition",
           "MinCut", "min_cut"]

# Set on every forward node before partitioning: the profile tensor the node makes (or
# views). The partitioner copies node meta into the graphs it cuts, so a forward node
# found in the backward graph carries it: that node was recomputed.
_ID = "slackswap_tensor"
# Set on every op's node: its profile op index (where a reload lands in backward).
_OP = "slackswap_op"


@dataclass
class JointGraph:
    """A profile of one joint graph and where its tensors are in the graph."""

    profile: StepProfile
    tensor_of: dict[str, int]  # node name -> tensor id (views -> their base's)
    producer_node: dict[int, fx.Node]  # tensor id -> the forward node that makes it
    forward: set[str]  # names of the forward nodes (the partitioner's required_fw)
    # tensor id -> its forward nodes that are no alias (what is saved when it is offloaded)
    bases: dict[int, list[fx.Node]] = field(default_factory=dict)
    # saved activation -> why PyTorch's offloading pass would not offload it; the
    # activations not listed are those it can (NOTE [compiled offload])
    not_offloadable: dict[str, str] = field(default_factory=dict)
    op_of: dict[str, int] = field(default_factory=dict)  # node name -> op index
    # forward nodes the default min-cut runs again in backward (NOTE [the min-cut's free
    # rebuilds]): run again in the profile's backward, tagged MUST_RECOMPUTE
    rebuilt: frozenset[str] = frozenset()
    copy_op: dict[str, int] = field(default_factory=dict)  # rebuilt node -> its copy's op

    @property
    def offloadable(self) -> frozenset[str]:
        """Saved activations PyTorch's offloading pass can offload (NOTE [compiled offload])."""
        return offloadable(self.profile, self.not_offloadable)


def offloadable(profile: StepProfile, refused: dict[str, str]) -> frozenset[str]:
    """The profile's saved activations (made by an op) but those ``refused``."""
    return frozenset(n for n, t in profile.by_name.items()
                     if t.producer is not None and n not in refused)


@dataclass
class Applied:
    """What the partitioner did with the profile's saved activations in the graphs it cut."""

    kept: dict[str, int] = field(default_factory=dict)  # activation id -> bytes
    recomputed: dict[str, int] = field(default_factory=dict)
    offloaded: dict[str, int] = field(default_factory=dict)
    recomputed_ops: int = 0  # forward ops run again in backward (chains included)
    # RNG states the forward graph saves for its rebuilt random ops (NOTE [compiled recompute])
    rng_states: int = 0
    rng_state_bytes: int = 0
    # offloaded activation -> the forward op its copy follows, and the backward op its
    # reload comes right before (the rebuilds that need it, if any, run there too)
    offload_after: dict[str, int] = field(default_factory=dict)
    reload_at: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, int]:
        """Counts and bytes, the figures a plan is checked against."""
        return {
            "kept": len(self.kept), "kept_bytes": sum(self.kept.values()),
            "recomputed": len(self.recomputed),
            "recomputed_bytes": sum(self.recomputed.values()),
            "offloaded": len(self.offloaded), "offloaded_bytes": sum(self.offloaded.values()),
            "recomputed_ops": self.recomputed_ops,
            "rng_states": self.rng_states, "rng_state_bytes": self.rng_state_bytes,
        }


def _module(node: fx.Node) -> str:
    """The innermost module path as ``named_modules`` spells it: dynamo writes
    ``L['self'].layers[0].mlp``, or ``L['self']._modules['layers']...``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\](\[\d+\])*", "", path)  # the root module
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.lstrip(".")


def _is_alias(node: fx.Node) -> bool:
    target = node.target
    # ``_unsafe_view`` shares its input's storage: the profiler resolves it to its base too
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or op_kind(target).startswith(("detach", "alias", "_unsafe_view")))


def _vals(x: Any) -> Any:
    return fx.node.map_arg(x, lambda n: n.meta.get("val"))


def _tensor_vals(val: Any) -> list[torch.Tensor | None]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _nbytes(t: torch.Tensor) -> int:
    if any(isinstance(s, torch.SymInt) for s in t.shape):
        raise InputError("slackswap.compile plans static shapes only; compile with "
                         "dynamic=False (the default here)")
    return t.numel() * t.element_size()


def read_joint(gm: fx.GraphModule, num_fwd_outputs: int, static_inputs: list[int],
               hw: Hardware, *, model: str, fingerprint: str, layers: list[str],
               min_cut: MinCut | None = None) -> JointGraph:
    """The profile of the step the joint graph runs: forward ops (those the partitioner
    counts as forward), then the rest; a tensor per non-view value, named as the
    profiler names activations; saved = read by a backward op. With ``min_cut`` (the
    default min-cut's partition of the graph), the forward nodes its backward runs again
    run again as backward ops, each right before the first backward op that needs it,
    and backward reads their copies: so the profile saves what the min-cut saves (NOTE
    [the min-cut's free rebuilds])."""
    info = classify_nodes(gm, static_inputs, num_fwd_outputs)
    primals = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors, tensor_of, state_bytes, tangents = _read_inputs(primals, static_inputs)
    producer_node: dict[int, fx.Node] = {}
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    rebuilt = min_cut.rebuilt if min_cut is not None else frozenset()
    forward = [n for n in calls if info.is_required_fw(n)]
    names = {n.name for n in forward}
    ordered = [(n, False) for n in forward] + _with_rebuilds(
        [n for n in calls if n.name not in names], rebuilt)
    ops, details, op_of, copy_op = _read_ops(ordered, names, tensors, tensor_of,
                                             producer_node)
    _mark_uses(ops, tensors, tangents)
    joint_outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    for i, node in enumerate(joint_outputs[num_fwd_outputs:]):
        tid = tensor_of.get(node.name) if isinstance(node, fx.Node) else None
        if i in static_inputs and tid is not None and tensors[tid].producer is not None \
                and ops[tensors[tid].producer].phase == "backward":
            tensors[tid].kind = "gradient"
    times = step_times(ops, tensors, hw, details)
    for op, seconds in zip(ops, times, strict=True):
        op.time_s = seconds
    code = hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    profile = StepProfile(
        model=model, fingerprint=f"{fingerprint}:joint:{code}", hardware=hw.name,
        mode="analytic", kernels="native", device=_device(primals), layers=layers,
        model_state_bytes=state_bytes, ops=ops, tensors=tensors)
    bases = _bases(calls, tensor_of, profile)
    outputs = OrderedSet(n for n in joint_outputs[:num_fwd_outputs] if isinstance(n, fx.Node))
    not_offloadable = {}
    for t in profile.saved_activations:
        if t.name is not None and t.producer is not None:
            why = _offload_refusal(bases.get(t.id, []), outputs)
            if why is not None:
                not_offloadable[t.name] = why
    return JointGraph(profile, tensor_of, producer_node, names, bases, not_offloadable,
                      op_of, rebuilt, copy_op)


@dataclass(frozen=True)
class MinCut:
    """Plain ``torch.compile``'s partition of a joint graph, by node name."""

    rebuilt: frozenset[str]  # forward nodes its backward graph runs again (views included)


def min_cut(gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
            static_inputs: list[int], compiler: str, **kwargs: Any) -> MinCut:
    """Plain ``torch.compile``'s partition (the default min-cut, no activation budget, no
    offloading) of a copy of ``gm`` (NOTE [the min-cut's free rebuilds])."""
    # the nodes copied, each with its own meta dict (values shared: a deep copy would
    # copy the fake tensors, which under aot_eager is refused), and no tags: those are
    # the plan's to write, not the baseline's
    copied = fx.Graph()
    copied.output(copied.graph_copy(gm.graph, {}))
    for node in copied.nodes:
        node.meta.pop("recompute", None)
        node.meta.pop("should_offload", None)
    graph = fx.GraphModule(gm, copied)
    with functorch_config.patch(activation_memory_budget=1.0,
                                enable_activation_offloading=False):
        fw, bw = min_cut_rematerialization_partition(
            graph, joint_inputs, compiler=compiler, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=list(static_inputs), **kwargs)
    forward = frozenset(n.name for n in fw.graph.nodes if n.op == "call_function")
    return MinCut(frozenset(n.name for n in bw.graph.nodes
                            if n.op == "call_function" and n.name in forward))


def _with_rebuilds(backward: list[fx.Node], rebuilt: frozenset[str]
                   ) -> list[tuple[fx.Node, bool]]:
    """The backward nodes in order, each after the forward nodes of ``rebuilt`` it needs
    (through other rebuilt ones) that no earlier one needed, in graph order: (node,
    True) for a rebuild."""
    position = {n: i for i, n in enumerate(backward[0].graph.nodes)} if backward else {}
    done: set[fx.Node] = set()
    out: list[tuple[fx.Node, bool]] = []
    for node in backward:
        need, todo = set(), [a for a in node.all_input_nodes if a.name in rebuilt]
        while todo:
            a = todo.pop()
            if a not in done and a not in need:
                need.add(a)
                todo.extend(b for b in a.all_input_nodes if b.name in rebuilt)
        out += [(a, True) for a in sorted(need, key=position.__getitem__)]
        done |= need
        out.append((node, False))
    return out


def _read_inputs(primals: list[fx.Node], static_inputs: list[int]
                 ) -> tuple[list[TensorRecord], dict[str, int], int, set[int]]:
    """A tensor per placeholder of the joint graph: the model's state (a static input's
    primal), the batch, the tangents backward starts from (unnamed); with the bytes of
    state, and the tangents' ids."""
    tensors: list[TensorRecord] = []
    tensor_of: dict[str, int] = {}
    state_bytes = 0
    tangents: set[int] = set()
    for i, node in enumerate(primals):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if "tangents" in node.name:
            tangents.add(len(tensors))
        is_state = "primals" in node.name and i in static_inputs
        kind = "parameter" if is_state else "input"
        nbytes = _nbytes(val)
        state_bytes += nbytes if is_state else 0
        tensor_of[node.name] = len(tensors)
        tensors.append(TensorRecord(id=len(tensors), kind=kind, bytes=nbytes,
                                    dtype=dtype_name(val.dtype), shape=list(val.shape),
                                    name=None if is_state or "tangents" in node.name
                                    else f"input:{node.name}"))
    return tensors, tensor_of, state_bytes, tangents


def _read_ops(ordered: list[tuple[fx.Node, bool]], forward: set[str],
              tensors: list[TensorRecord],
              tensor_of: dict[str, int], producer_node: dict[int, fx.Node],
              ) -> tuple[list[OpRecord], list[OpDetail], dict[str, int], dict[str, int]]:
    """An op per ATen call of ``ordered`` (getitems and aliases name the tensors they
    read), a tensor per output it makes, added to ``tensors``, ``tensor_of`` and
    ``producer_node``: the ops, what each reads and writes, each node's op, and each
    rebuilt node's copy's op. A node marked True is a forward node run again in
    backward: its copy's tensors are what backward reads from then on, and
    ``tensor_of``, ``op_of`` and ``producer_node`` keep the forward node's."""
    ops: list[OpRecord] = []
    details: list[OpDetail] = []
    op_of: dict[str, int] = {}
    namer = ActivationNamer()
    copy_op: dict[str, int] = {}
    copies: dict[str, int] = {}  # a rebuilt node (and its outputs' keys) -> its copy's
    backward_reads = ChainMap(copies, tensor_of)
    for node, again in ordered:
        phase = "forward" if node.name in forward and not again else "backward"
        reads = backward_reads if phase == "backward" else tensor_of
        writes = copies if again else tensor_of
        if node.target is operator.getitem:
            base = node.args[0]
            key = f"{base.name}#{node.args[1]}"
            if key in reads:
                writes[node.name] = reads[key]
            elif base.name in reads:  # one view of a view op with several (split)
                writes[node.name] = reads[base.name]
            continue
        if _is_alias(node):
            src = node.args[0]
            if isinstance(src, fx.Node) and src.name in reads:
                writes[node.name] = reads[src.name]
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        func, kind = node.target, op_kind(node.target)
        index = len(ops)
        (copy_op if again else op_of)[node.name] = index
        inputs = list(dict.fromkeys(reads[a.name] for a in node.all_input_nodes
                                    if a.name in reads))
        outs = _tensor_vals(node.meta.get("val"))
        out_ids: list[int] = []
        module = _module(node)
        random = _draws(func)
        for k, val in enumerate(outs):
            if val is None:
                continue
            tid = len(tensors)
            writes[f"{node.name}#{k}"] = tid
            out_ids.append(tid)
            tensors.append(TensorRecord(
                id=tid, kind="activation", bytes=_nbytes(val), dtype=dtype_name(val.dtype),
                shape=list(val.shape), producer=index, random=random,
                name=namer(module, kind) if phase == "forward" else None))
            if not again:
                producer_node[tid] = node
        if isinstance(node.meta.get("val"), torch.Tensor):
            writes[node.name] = out_ids[0]
        vals = [v for v in outs if v is not None]
        floats = [v.dtype for v in vals if v.is_floating_point()]
        read = {t: tensors[t].bytes for t in inputs}
        ops.append(OpRecord(
            index=index, name=str(func), kind=kind, phase=phase, module=module,
            category=op_category(kind), dtype=dtype_name(floats[0]) if floats else "fp32",
            flops=op_flops(func, kind, _vals(node.args), _vals(node.kwargs),
                           node.meta.get("val")),
            bytes_read=sum(read.values()), bytes_written=sum(tensors[t].bytes for t in out_ids),
            time_s=0.0, inputs=inputs, outputs=out_ids, random=random,
            # NOTE [compiled recompute]: a rebuilt random op runs with its RNG state
            replayable=is_replayable(func),
        ))
        details.append(OpDetail(reads=read, writes={t: tensors[t].bytes for t in out_ids}))
    return ops, details, op_of, copy_op


def _mark_uses(ops: list[OpRecord], tensors: list[TensorRecord], tangents: set[int]) -> None:
    """Each tensor's forward and backward readers; saved: made in forward (or an input,
    not a tangent) and read in backward, first at its first backward reader."""
    made_in_forward = {t.id for t in tensors if t.producer is None
                       or ops[t.producer].phase == "forward"} - tangents
    for op in ops:
        for t in op.inputs:
            record = tensors[t]
            if op.phase == "forward":
                record.forward_consumers.append(op.index)
                continue
            record.backward_consumers.append(op.index)
            if t in made_in_forward and record.first_backward_use is None:
                record.saved, record.first_backward_use = True, op.index


def _bases(calls: list[fx.Node], tensor_of: dict[str, int], profile: StepProfile,
           ) -> dict[int, list[fx.Node]]:
    """For each tensor made in forward, its nodes that are no alias: the op's node, or
    the getitem of a multi-output op's output. Its aliases (views, detaches) are rebuilt
    in backward when it is offloaded, so these are what the partition saves then."""
    bases: dict[int, list[fx.Node]] = {}
    for node in calls:
        tid = tensor_of.get(node.name)
        producer = profile.tensors[tid].producer if tid is not None else None
        if producer is not None and profile.ops[producer].phase == "forward" \
                and not _is_alias(node):
            bases.setdefault(tid, []).append(node)
    return bases


def _offload_refusal(nodes: list[fx.Node], model_outputs: OrderedSet[fx.Node]) -> str | None:
    """Why PyTorch's offloading pass would not offload a tensor saved as ``nodes`` (its
    ``can_offload``, asked of each), or None when it would."""
    if not nodes:
        return "no forward node makes it"
    saved = OrderedSet(nodes)
    for node in nodes:
        if can_offload(node, saved, model_outputs, OrderedSet()):
            continue
        if node in model_outputs:
            return f"{node.name} is an output of the model"
        if node.target is operator.getitem:
            return f"{node.name} is one output of a multi-output op (a getitem)"
        if get_default_op_list().is_view(node):
            return f"{node.name} is a view"
        return f"{node.name} is not contiguous"
    return None


def _device(placeholders: list[fx.Node]) -> str:
    for node in placeholders:
        if isinstance(val := node.meta.get("val"), torch.Tensor):
            return str(val.device)
    return "cpu"


def _draws(func: torch._ops.OpOverload) -> bool:
    """Whether the partitioner rebuilds ``func`` under a saved RNG state (NOTE [compiled
    recompute]): a random op, or one tagged ``nondeterministic_seeded``, which attention
    kernels are (CPU's flash attention with ``dropout_p=0`` too). Counted as random only
    where eager dropout draws (``is_random``), CLIP's and UNet2DModel's rebuilt attention
    saved RNG states no plan held: 15% over the budget measured at 0.4."""
    return is_random(func) or torch.Tag.nondeterministic_seeded in func.tags


def uniform_per_op(joint: JointGraph, plan: Plan) -> Plan:
    """The plan with each op's saved outputs under one decision: a graph recomputes an op,
    not one of its outputs, so an op with any output to recompute recomputes them all,
    and so does an op a rebuild runs again (NOTE [compiled recompute])."""
    p = joint.profile
    decisions = dict(plan.decisions)
    before: dict[str, str] = {}
    while decisions != before:  # a newly recomputed output may have a chain of its own
        before, rebuilt = dict(decisions), _rebuilt_ops(p, decisions)
        for op in p.ops:
            if op.phase != "forward":
                break
            names = [p.tensors[t].name for t in op.outputs if p.tensors[t].saved]
            if op.index in rebuilt and (
                    any(decisions.get(n) == Decision.RECOMPUTE for n in names)
                    or all(n in p.recomputable for n in names)):
                decisions.update({n: Decision.RECOMPUTE for n in names})
    if decisions == plan.decisions:
        return plan
    prefetch = {n: i for n, i in plan.prefetch.items() if decisions.get(n) == Decision.OFFLOAD}
    return plan.model_copy(update={"decisions": decisions, "prefetch": prefetch})


def _rebuilt_ops(p: StepProfile, decisions: dict[str, str]) -> set[int]:
    """The forward ops the rebuilds of ``decisions`` run: each recomputed activation's
    producer, and the producers of the never-saved tensors on its chain."""
    rebuilt: set[int] = set()
    for name, d in decisions.items():
        record = p.by_name.get(name)
        if d == Decision.RECOMPUTE and record is not None and record.producer is not None:
            rebuilt.update(rebuild_ops(p, record.producer))
    return rebuilt


def tag_joint(gm: fx.GraphModule, joint: JointGraph, plan: Plan) -> None:
    """Tag every forward node MUST_SAVE or MUST_RECOMPUTE by the plan (NOTE [compiled
    recompute]), those the default min-cut rebuilds MUST_RECOMPUTE (NOTE [the min-cut's
    free rebuilds]); nodes outside forward that the partitioner could still run in forward
    are MUST_RECOMPUTE, so it saves nothing the plan does not. An offloaded activation's
    nodes that are no alias are marked ``should_offload``, as PyTorch's
    offloading pass asks, and their aliases MUST_RECOMPUTE, so backward makes them again
    from the reloaded tensor and the partition saves no view of it (NOTE [compiled
    offload])."""
    p = joint.profile
    offloaded: set[int] = set()
    for name, d in plan.decisions.items():
        if d == Decision.OFFLOAD and name in p.by_name:
            offloaded.add(p.by_name[name].id)
            for node in joint.bases.get(p.by_name[name].id, []):
                node.meta["should_offload"] = True
    policy = _policies(joint, plan)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.name in joint.op_of:
            node.meta[_OP] = joint.op_of[node.name]
        tid = joint.tensor_of.get(node.name)
        if tid is None:  # a multi-output op: its outputs are named "<node>#k"
            tid = joint.tensor_of.get(f"{node.name}#0")
        record = p.tensors[tid] if tid is not None else None
        if record is not None and record.producer in policy:  # made in forward, or a view
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE if (
                tid in offloaded and _is_alias(node)) or node.name in joint.rebuilt \
                else policy[record.producer]
            node.meta[_ID] = tid
        elif node.name in joint.forward or not any(
                a.op == "placeholder" and "tangents" in a.name for a in node.all_input_nodes):
            # a view of a parameter or input, or backward work that needs no gradient
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _policies(joint: JointGraph, plan: Plan) -> dict[int, CheckpointPolicy]:
    """Each forward op's tag: MUST_RECOMPUTE if the plan rebuilds an output; MUST_SAVE if
    it saves one, or the op cannot be replayed; else MUST_RECOMPUTE, rebuilt where a
    rebuild needs it."""
    p = joint.profile
    policy: dict[int, CheckpointPolicy] = {}  # op index -> tag
    for op in p.ops:
        if op.phase != "forward":
            continue
        outs = [p.tensors[t] for t in op.outputs]
        said = [plan.decisions.get(t.name) for t in outs]
        if Decision.RECOMPUTE in said:
            policy[op.index] = CheckpointPolicy.MUST_RECOMPUTE
        elif any(t.saved for t in outs) or Decision.KEEP in said or not op.replayable:
            policy[op.index] = CheckpointPolicy.MUST_SAVE
        else:  # made and used in forward only: rebuilt if a rebuild needs it
            policy[op.index] = CheckpointPolicy.MUST_RECOMPUTE
    return policy


def applied_partition(joint: JointGraph, fw: fx.GraphModule, bw: fx.GraphModule,
                      num_fwd_outputs: int) -> Applied:
    """What the cut graphs save (the forward graph's outputs after its own), offload (the
    saved outputs that are copies to the CPU the offloading pass added) and rebuild
    (forward nodes found in the backward graph), for the profile's saved activations.
    Nodes are matched by the tensor id :func:`tag_joint` wrote into their meta, which the
    partitioner copies (their names may change)."""
    p = joint.profile
    out = Applied()
    outputs = next(iter(fw.graph.find_nodes(op="output"))).args[0][num_fwd_outputs:]
    copies: dict[str, str] = {}  # offload node name -> activation
    for node in outputs:
        if not isinstance(node, fx.Node) or node.op == "placeholder" or not isinstance(
                node.meta.get("val"), torch.Tensor):
            continue  # parameters and inputs; sizes
        if _is_rng_state(node):
            out.rng_states += 1
            out.rng_state_bytes += _rng_state_bytes(node.meta["val"])
            continue
        if (source := _offloaded(node)) is not None:
            t = p.tensors[source.meta[_ID]]
            out.offloaded[t.name] = t.bytes
            copies[node.name] = t.name
            out.offload_after[t.name] = _op_before(node)
            continue
        tid = node.meta.get(_ID)
        if tid is None:  # made after profiling: a save no plan decided on
            out.kept[f"(unplanned) {node.name}"] = _nbytes(node.meta["val"])
        elif p.tensors[tid].kind == "activation":
            out.kept[p.tensors[tid].name] = p.tensors[tid].bytes
    rebuilt: set[int] = set()
    random_ops = {_call_key(n.target, n.args): tid for tid, n in joint.producer_node.items()
                  if p.ops[p.tensors[tid].producer].phase == "forward"}
    for node in bw.graph.nodes:
        tid = node.meta.get(_ID)
        if node.target is torch._prims.rng_prims.run_with_rng_state:
            # a rebuilt random op, run with the RNG state forward saved: the node that
            # ran it is gone, so it is found by its op and arguments
            tid = random_ops.get(_call_key(node.args[1], node.args[2:]))
            if tid is None:
                continue
        if node.op == "call_function" and tid is not None \
                and joint.producer_node.get(tid) is not None and not _is_alias(node) \
                and node.target is not operator.getitem:
            out.recomputed_ops += 1
            rebuilt.update(p.ops[p.tensors[tid].producer].outputs)
    for tid in rebuilt:
        t = p.tensors[tid]
        if t.saved and t.name not in out.kept:
            out.recomputed[t.name] = t.bytes
    for node in bw.graph.find_nodes(op="call_function",
                                    target=torch.ops.prims.device_put.default):
        source = node.args[0]
        if node.name.startswith(GPU_RELOAD_PREFIX) and source.name in copies:
            out.reload_at[copies[source.name]] = _backward_op_after(node, joint)
    return out


def _call_key(target: Any, args: Any) -> tuple[Any, ...]:
    """An op and its arguments, by node name (the cut graphs keep the joint's names; an
    offloaded argument is read back in backward by its reload, named by the forward node
    it copies)."""
    return (target, *(_forward_name(a) if isinstance(a, fx.Node) else repr(a) for a in args))


def _forward_name(node: fx.Node) -> str:
    """The joint graph's name of what ``node`` holds: a reload's is the forward node the
    offloading pass copied (``gpu_reload_<name>`` of ``cpu_offload_<name>``)."""
    if node.target is torch.ops.prims.device_put.default and node.name.startswith(
            GPU_RELOAD_PREFIX) and isinstance(copy := node.args[0], fx.Node) \
            and copy.name.startswith(CPU_OFFLOAD_PREFIX):
        return copy.name.removeprefix(CPU_OFFLOAD_PREFIX)
    return node.name


def _is_rng_state(node: fx.Node) -> bool:
    """Whether ``node`` is the RNG state the partitioner saves for a random op it has
    rebuilt in backward (``run_and_save_rng_state``'s first output)."""
    source = node.args[0] if node.target is operator.getitem else None
    return isinstance(source, fx.Node) and source.target is \
        torch._prims.rng_prims.run_and_save_rng_state and node.args[1] == 0


def _rng_state_bytes(val: torch.Tensor) -> int:
    """The bytes of a saved RNG state (a CPU generator's state has a symbolic size in
    the fake graph: its size is read from a real one)."""
    numel = val.numel()
    if isinstance(numel, torch.SymInt):
        numel = torch.get_rng_state().numel()
    return numel * val.element_size()


def _offloaded(node: fx.Node) -> fx.Node | None:
    """The forward node an offload copy (``prims.device_put`` to the CPU, as the pass's
    synchronous path writes it) copies, or None."""
    if node.target is torch.ops.prims.device_put.default and node.name.startswith(
            CPU_OFFLOAD_PREFIX) and isinstance(node.args[0], fx.Node) \
            and _ID in node.args[0].meta:
        return node.args[0]
    return None


def _op_before(node: fx.Node) -> int:
    """The profile op of the last op node before ``node`` (-1 if none)."""
    while (node := node.prev).op != "root":
        if _OP in node.meta:
            return node.meta[_OP]
    return -1


def _backward_op_after(node: fx.Node, joint: JointGraph) -> int:
    """The profile op of the first backward op node after ``node``: where the compute
    stream is when a reload placed at ``node`` starts (a rebuild runs at that op too).
    A forward node the default min-cut rebuilds is its copy's backward op (NOTE [the
    min-cut's free rebuilds])."""
    p = joint.profile
    while (node := node.next).op != "root":
        if node.name in joint.copy_op:
            return joint.copy_op[node.name]
        if _OP in node.meta and p.ops[node.meta[_OP]].phase == "backward":
            return node.meta[_OP]
    return len(p.ops) - 1
