"""``slackswap.compile``: plan the joint graph torch.compile runs, and have its partitioner
save and recompute exactly as planned."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils import _pytree as pytree

from slackswap.compiled.joint import (
    Applied,
    JointGraph,
    applied_partition,
    min_cut,
    offloadable,
    read_joint,
    tag_joint,
    uniform_per_op,
)
from slackswap.core.hardware import Hardware, with_overrides
from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes, resolve_budget
from slackswap.device_budget import resolve_fit
from slackswap.errors import InputError, SlackSwapError
from slackswap.planners import STRATEGIES, plan_in_context
from slackswap.planners import plan as plan_profile
from slackswap.planners.context import PlanContext
from slackswap.profiling.machine import resolve_hardware
from slackswap.profiling.sharding import module_class
from slackswap.profiling.step import (
    Batch,
    batch_fingerprint,
    batch_tensors,
    leaves_no_trace,
    model_fingerprint,
    transformer_blocks,
)

__all__ = ["compile", "CompiledPlan", "PlannedGraph"]

_BACKENDS = ("aot_eager", "inductor")


# NOTE [compiled recompute]
#     AOTAutograd traces forward and backward into one joint graph and cuts it with
#     min_cut_rematerialization_partition, which honours selective-checkpoint tags
#     (node.meta["recompute"]): a MUST_SAVE node is never recomputed, a MUST_RECOMPUTE
#     one is always rebuilt in backward when backward needs it. SlackSwap takes the
#     partitioner's place (a partition_fn for aot_eager, Inductor's custom_partitioner_fn),
#     after AOTAutograd's and Inductor's joint-graph passes: it profiles the joint graph
#     (ids as the profiler writes them, from the nodes' module stacks, but over the
#     compiler's ops: under Inductor's decompositions they are not the eager profile's
#     ids), plans it, tags *every* forward node (so no choice is left to the min-cut
#     heuristics; the ops the default min-cut rebuilds for free are rebuilt by every
#     plan, NOTE [the min-cut's free rebuilds]), partitions, and reads back from the cut
#     graphs what was saved and rebuilt; a difference from the plan is an error, never a
#     silent change.
#     Two rules follow from the graph:
#     - a graph rebuilds an op, not one output of it: an op with any output to recompute
#       recomputes them all (the plan is made uniform per op before tagging);
#     - ops that may draw from the RNG (dropout, and attention kernels, which are tagged
#       nondeterministic_seeded) are rebuilt as PyTorch's selective checkpointing rebuilds
#       them: the partitioner runs a MUST_RECOMPUTE one in forward under
#       run_and_save_rng_state, saves that RNG state, and runs the rebuild under
#       run_with_rng_state, so backward draws what forward drew (bit-identical on CPU).
#       The rebuild's node is replaced, so applied_partition finds it by its op and
#       arguments. The saved states are counted apart (Applied.rng_states: 5056 bytes
#       each on a CPU generator, 16 on a CUDA one) and are not in the plan.
#     Offloads are the subject of NOTE [compiled offload].


# NOTE [an op a rebuild runs again]
#     A rebuild runs again every op on its chain through tensors no plan saves (dropout's
#     input, made by a LayerNorm whose mean and rstd backward reads). Such an op is tagged
#     MUST_SAVE when it has a saved output the plan keeps, and the partition then saved
#     the never-saved tensor the rebuild starts from instead: memory the plan did not
#     hold, refused as "the partitioner did not follow the plan" (BERT's embeddings at
#     0.7, recompute-only). As with an op one of whose outputs is recomputed, every saved
#     output of an op a rebuild runs is recomputed too (``uniform_per_op``), and the plan
#     is simulated again that way, within the budget, before it is tagged.


# NOTE [the min-cut's free rebuilds]
#     Plain torch.compile saves less than eager autograd: its partitioner (the default
#     min-cut, no activation budget) runs cheap forward ops again in backward (pointwise
#     ops, views, reductions: never a matmul, an attention kernel or a random op), where
#     Inductor fuses them into the backward kernels that read them; on gpt2-xl@6 it saves
#     3.27 GB where eager saves 8.84 GB. A plan whose keep-all saved what eager saves,
#     and whose budget was a fraction of that, saved at 0.5 about what plain
#     torch.compile saves at no budget. So the compiled path starts from the default
#     min-cut's partition: it is run once on a copy of the joint graph (``min_cut``),
#     and the forward nodes its backward runs again are rebuilt by every plan:
#     - the profile runs each of them again as a backward op, right before the first
#       backward op that needs it (with those it needs in turn), and backward reads the
#       copy; so the profile's saved activations are what the min-cut saves, its keep-all
#       peak is plain torch.compile's, and a budget is a fraction of that;
#     - their cost is counted as the cost model prices the ops, unfused: each rebuild
#       reads its inputs and writes its output in device memory, where Inductor's fused
#       kernel reads the saved tensor once (an upper bound on what they cost; the same
#       ops in every plan, keep-all included);
#     - ``tag_joint`` tags them MUST_RECOMPUTE, and the plan decides on the rest as
#       before (NOTE [compiled recompute]): the partition is checked against the plan,
#       so a min-cut that saved or rebuilt otherwise under the tags is an error.
#     A keep-all plan's partition is then the min-cut's own (the same bytes saved and ops
#     rebuilt, tests/test_partitioner_estimate.py) but for one kind of node: work for
#     backward that needs no gradient, which the partitioner does not count as forward,
#     and which the min-cut may run in forward to save its smaller output. In bf16,
#     LayerNorm's backward casts the fp32 mean and rstd to bf16, and the min-cut saves the
#     casts; the profile reads such work as backward (its tag, MUST_RECOMPUTE, keeps it
#     there), so a plan saves the fp32 statistics: 4 bytes more per token and norm
#     (gpt2-xl@12: 0.8 MB more than plain torch.compile's 5.64 GB). Profiled as forward
#     and tagged MUST_SAVE or left untagged, the min-cut still saved the fp32 statistics
#     (the two cuts cost the same to it), and the partition was refused as not the plan.


# NOTE [compiled offload]
#     Offloads go through PyTorch's activation-offloading pass
#     (torch._functorch._activation_offloading), which min_cut_rematerialization_partition
#     runs on the cut graphs when functorch's ``enable_activation_offloading`` is set (set
#     here for the one partition call, never globally). It offloads the forward graph's
#     saved outputs whose node is marked ``should_offload`` and that its ``can_offload``
#     accepts: not a model output, not a view, not a getitem (so no output of a
#     multi-output op: LayerNorm's, dropout's, SDPA's output and logsumexp), contiguous.
#     Which node a partition saves for an activation is made certain: an offloaded one's
#     aliases (views, detaches) are tagged MUST_RECOMPUTE, so backward makes them again
#     from the reloaded tensor and the activation's own node is saved (the op's, or the
#     getitem of a multi-output op's output). Left MUST_SAVE, the partitioner would save a
#     view (which the pass refuses) or a detach it makes at the end of forward (which the
#     pass would copy only then, freeing nothing earlier). So the profile knows which
#     activations the pass can offload: can_offload is asked of that node when the joint
#     graph is read (JointGraph.not_offloadable: the others, with why). Planning keeps the
#     others (PassContext: its plans keep what the pass would not offload, as plans keep
#     what no replay rebuilds), so no strategy plans an offload that cannot happen; a
#     plan that offloads one anyway is refused before partitioning. After the partition
#     the copies are read back from the forward graph and checked against the plan, as
#     recomputes are.
#     The pass chooses its own timing, and it is not the simulator's:
#     - its copy to the CPU is issued after the last use it sees (through the ops it counts
#       as views, which leave out ``_unsafe_view``): between the producer and the last
#       forward use, where the simulator starts it when the producer ends. The device
#       memory goes after the last forward use in both (an alias holds it until then);
#     - this module runs its synchronous path (``prims.device_put``, one node each way):
#       a copy runs in order with the kernels on the compute stream and does not overlap
#       them. PassContext simulates so (``host_link.stream = "compute"``: each copy an item
#       of the compute stream, after the last forward item that reads the tensor, or right
#       before the first that needs it back), so plans pay for copies as the graph does.
#       Not simulated: a copy to pageable host memory also makes the host wait for the
#       GPU, so the host cannot run ahead of it (the simulated step is optimistic there);
#     - a reload is issued right before the first backward node that needs it (a rebuild
#       that reads it, or the op), which a plan can say: plans are made, and kept, with that
#       op as each offload's prefetch point (``plan.prefetch``; the schedule issues a reload
#       at the earlier of it and the first need), so the simulator waits for each reload
#       where the graph does (``applied.reload_at`` reads the points back).
#     The asynchronous path (``activation_offload_separate_stream``: ao.offload / reload /
#     wait_tensor on a transfer stream) needs an accelerator's streams and is not used: it
#     waits for each copy out right after issuing it unless ``activation_offload_sink_wait``
#     moves the waits to the end of forward, which holds every offloaded tensor in device
#     memory until then; its prefetch moves reloads earlier by times it benchmarks while
#     compiling, which a plan cannot know. Its config calls the pass a testing feature.
#     On a CPU graph the "offload" is a copy within host memory: it saves nothing, but it
#     is the same graph rewrite a GPU runs, so the CPU tests check that path.


# NOTE [inputs freed at last use]
#     AOTAutograd hands the compiled backward its saved tensors as one list it gives up
#     ("boxed" calling convention: the callee may clear it). Inductor's code clears it
#     and frees each buffer after its last use; so does aot_eager's compiler,
#     ``boxed_nop`` (FX's boxed code on torch 2.13; on older releases, such as 2.11, an
#     ``fx.Interpreter.boxed_run``, which drops each value after its last use): a saved
#     activation goes once backward no longer needs it, as the simulator frees it. A
#     compiler that calls ``gm.forward(*args)`` (``make_boxed_func``, used here before)
#     holds every saved activation until backward ends: on a 2-layer MLP, 21% above the
#     simulated peak at budget 1.0 and 71% at 0.6 (tests/test_compiled_memory.py).
#     Not yet in the plan: the RNG states saved for recomputed random ops (NOTE [compiled
#     recompute]), 5056 bytes each on a CPU generator, 16 on a CUDA one.


@dataclass
class PlannedGraph:
    """One compiled joint graph: its profile, the plan, what its partition applied, and
    the saved activations PyTorch's offloading pass can offload (NOTE [compiled offload])."""

    profile: StepProfile
    plan: Plan
    applied: Applied
    not_offloadable: dict[str, str]  # saved activation -> why the pass would not offload it

    @property
    def offloadable(self) -> frozenset[str]:
        """The saved activations PyTorch's offloading pass can offload."""
        return offloadable(self.profile, self.not_offloadable)


class CompiledPlan:
    """``compiled.slackswap``: the plans of the graphs compiled so far and what each applied."""

    def __init__(self, budget: str | int | float, hardware: Hardware, strategy: str,
                 model: torch.nn.Module, fingerprint: str | None = None) -> None:
        self.budget, self.hardware, self.strategy = budget, hardware, strategy
        self.graphs: list[PlannedGraph] = []
        self._model_name = module_class(model).__name__
        self._layers = transformer_blocks(model)
        # the model's and the batch's; None: the model's now, the batch's read from each
        # graph's inputs (a model compiled before any batch is seen, as attach does)
        self._fingerprint = fingerprint
        self._model_fingerprint = model_fingerprint(model) if fingerprint is None else ""

    @property
    def plan(self) -> Plan:
        """The plan of the first compiled graph (the step ``slackswap.compile`` compiled)."""
        if not self.graphs:
            raise InputError("nothing compiled yet: call the module on a batch first")
        return self.graphs[0].plan

    @property
    def profile(self) -> StepProfile:
        """The profile of the first compiled graph's joint graph."""
        return self.plan and self.graphs[0].profile

    def applied(self, graph: int = 0) -> dict[str, int]:
        """What the partition of a compiled graph saved, recomputed and offloaded: counts
        and bytes of the profile's saved activations (offloaded: the copies to the CPU in
        the forward graph), and forward ops run again in backward (rebuild chains
        included)."""
        self.plan  # noqa: B018 - raises when nothing was compiled
        return self.graphs[graph].applied.summary()

    def partition(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                  static_lifetime_input_indices: list[int] | None = None,
                  compiler: str = "inductor", **kwargs: Any) -> tuple[fx.GraphModule,
                                                                       fx.GraphModule]:
        """Profile, plan, tag, partition, and check the partition against the plan."""
        static = list(static_lifetime_input_indices or [])
        gm.graph.eliminate_dead_code()
        if functorch_config.cse:  # as the partitioner does first: nodes keep their names
            gm.graph = fx_graph_cse(gm.graph)
        gm.recompile()
        # NOTE [the min-cut's free rebuilds]: what plain torch.compile rebuilds, rebuilt
        baseline = min_cut(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                           static_inputs=static, compiler=compiler, **kwargs)
        joint = read_joint(gm, num_fwd_outputs, static, self.hardware, model=self._model_name,
                           fingerprint=self._fingerprint or self._model_fingerprint
                           + batch_fingerprint(_batch_inputs(gm, static)),
                           layers=self._layers, min_cut=baseline)
        plan = uniform_per_op(joint, self._plan(joint))
        check_offloadable(joint, plan)
        tag_joint(gm, joint, plan)
        offloads = Decision.OFFLOAD in plan.decisions.values()
        # NOTE [compiled offload]: the pass's synchronous path, for this partition only
        with functorch_config.patch(enable_activation_offloading=offloads,
                                    activation_offload_separate_stream=False):
            fw, bw = min_cut_rematerialization_partition(
                gm, joint_inputs, compiler=compiler, num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static, **kwargs)
        applied = applied_partition(joint, fw, bw, num_fwd_outputs)
        _check_applied(joint, plan, applied)
        self.graphs.append(PlannedGraph(joint.profile, plan, applied, joint.not_offloadable))
        return fw, bw

    def _plan(self, joint: JointGraph) -> Plan:
        """The strategy's plan under the offloading pass's rules (NOTE [compiled offload]),
        with the RNG states its rebuilt random ops save held within the budget too (NOTE
        [RNG states in the budget])."""
        if self.strategy not in STRATEGIES:
            raise InputError(f"unknown strategy '{self.strategy}'; strategies: "
                             f"{', '.join(STRATEGIES)}")
        profile = joint.profile
        budget = resolve_fit(self.budget, profile, self.hardware)
        total = resolve_budget(budget, profile.keep_all_peak)
        each = rng_state_size(profile.device)
        states = 0
        for _ in range(3):  # each plan may rebuild other random ops than the last
            ctx = PassContext(profile, self.hardware, total - states, joint.offloadable)
            attempt = self._attempt(ctx, joint)
            if attempt is None:
                break
            held = each * len(rebuilt_random_ops(profile, attempt[0]))
            if attempt[1].peak_bytes + held <= total:
                return attempt[0].model_copy(update={"budget_bytes": total})
            states = held
        if states:  # NOTE [RNG states in the budget]: random ops' outputs kept, no state
            ctx = PassContext(profile, self.hardware, total, joint.offloadable,
                              random_kept=True)
            attempt = self._attempt(ctx, joint)
            if attempt is not None:
                return attempt[0].model_copy(update={"budget_bytes": total})
        if states == 0:
            plan_profile(profile, budget, self.hardware, self.strategy)  # its error, if any
        raise InputError(
            f"budget {format_bytes(total)} is out of reach of '{self.strategy}' when only "
            f"what PyTorch's offloading pass can offload is offloaded "
            f"({len(joint.offloadable)} of {len(profile.by_name)} saved activations)"
            + (f" and the RNG states of rebuilt random ops ({format_bytes(states)}) are "
               f"held too, or their outputs kept" if states else ""))

    def _attempt(self, ctx: PassContext, joint: JointGraph) -> Any:
        """The strategy's feasible plan and its simulation in ``ctx``, or None."""
        attempt = plan_in_context(ctx, self.strategy)
        if attempt is not None and Decision.OFFLOAD in attempt[0].decisions.values():
            # a strategy may write its own reload starts, or none: the pass's are these
            plan = ctx.plan(attempt[0].strategy, attempt[0].decisions)
            attempt = plan, ctx.simulate(plan)
        if attempt is not None:  # NOTE [an op a rebuild runs again]
            uniform = uniform_per_op(joint, attempt[0])
            if uniform is not attempt[0]:
                plan = ctx.plan(attempt[0].strategy, uniform.decisions)
                attempt = plan, ctx.simulate(plan)
        if attempt is None or not attempt[1].feasible:
            return None
        check_offloadable(joint, attempt[0])
        return attempt


# NOTE [RNG states in the budget]
#     A random op the plan rebuilds saves the RNG state it drew from, from forward to its
#     rebuild in backward (NOTE [compiled recompute]): bytes no activation of the profile
#     holds (5056 per op on a CPU generator, 16 on a CUDA one). They are counted as held
#     for the whole step, on top of the plan's simulated peak (an upper bound: each is
#     made in forward and let go at its rebuild): a plan whose peak and states exceed the
#     budget is made again within the budget less the states; when none fits there, with
#     the random ops' outputs kept rather than rebuilt (no state saved, their bytes in the
#     simulation), and refused, naming the states, when that does not fit either. The plan
#     keeps the budget it was asked for.
#     Kept, a random op ends every rebuild, not only its own: an activation whose rebuild
#     would run it again (a residual add after dropout reads dropout's output, which no
#     plan saves, as backward never reads it) is kept too. Planning sees the random ops as
#     not replayable (``random_ops_kept``), so no strategy rebuilds through one; a plan
#     that did was cut by a partition that saved dropout's output instead, and refused as
#     "the partitioner did not follow the plan" (T5 at 0.8, recompute-only).
def rng_state_size(device: str) -> int:
    """Bytes of one saved RNG state on ``device``'s generator: a CPU generator's whole
    state, a CUDA one's seed and offset."""
    if device.startswith("cpu"):
        return torch.get_rng_state().numel()
    return 16


def rebuilt_random_ops(profile: StepProfile, plan: Plan) -> set[int]:
    """The random forward ops with an output ``plan`` recomputes (each saves an RNG state)."""
    return {t.producer for n, t in profile.by_name.items()
            if t.random and t.producer is not None and plan.decisions.get(n) == Decision.RECOMPUTE}


def random_ops_kept(profile: StepProfile) -> StepProfile:
    """``profile`` with its random ops not replayable: a plan of it rebuilds none, neither
    their outputs nor an activation whose rebuild would run one again (its chain passes
    through an output no plan saves, as dropout's, which backward never reads), so every
    random op is saved whole and no RNG state is (NOTE [RNG states in the budget])."""
    return profile.model_copy(update={"ops": [
        op.model_copy(update={"replayable": False}) if op.random else op
        for op in profile.ops]})


def _batch_inputs(gm: fx.GraphModule, static: list[int]) -> list[torch.Tensor]:
    """The joint graph's inputs that are the batch: not the model's state, no tangent."""
    primals = gm.graph.find_nodes(op="placeholder")
    batch = [n.meta["val"] for i, n in enumerate(primals) if i not in static
             and "tangents" not in n.name and isinstance(n.meta.get("val"), torch.Tensor)]
    if any(isinstance(s, torch.SymInt) for t in batch for s in t.shape):
        raise InputError(
            "slackswap.compile plans static shapes only, and an input's size is dynamic: "
            "compile with dynamic=False (the default here), and pass tensors no "
            "torch.compile has marked dynamic (torch._dynamo.mark_dynamic, or a compile "
            "that saw their size change: pass x.clone())")
    return batch


class PassContext(PlanContext):
    """A planning context held to what the compiled path applies (NOTE [compiled
    offload]): activations PyTorch's offloading pass would not offload are kept, each
    offload's reload starts at its first backward use, as the pass reloads, and copies
    run on the compute stream, as the pass's synchronous path runs them. With
    ``random_kept``, no random op is rebuilt, alone or in another's rebuild (NOTE [RNG
    states in the budget])."""

    def __init__(self, profile: StepProfile, hardware: Hardware, budget: int,
                 offloadable: frozenset[str], random_kept: bool = False) -> None:
        # the pass's copies run on the compute stream, and no runtime of ours runs Python
        # per op: no packs, watches, replays or unpacks on the host (NOTE [host costs])
        super().__init__(profile if not random_kept else random_ops_kept(profile),
                         with_overrides(hardware, {"host_link.stream": "compute"} | {
                             f"host.{cost}": 0.0
                             for cost in ("pack_s", "watch_s", "replay_s", "unpack_s")}),
                         budget)
        self.offloadable = offloadable

    def plan(self, strategy: str, decisions: dict[str, str],
             prefetch: dict[str, int] | None = None) -> Plan:
        """The plan with offloads the pass cannot make kept, and the pass's reload
        points."""
        decisions = {n: Decision.KEEP if d == Decision.OFFLOAD and n not in self.offloadable
                     else d for n, d in decisions.items()}
        saved = self.profile.by_name
        reloads = {n: saved[n].first_backward_use for n, d in decisions.items()
                   if d == Decision.OFFLOAD and saved[n].first_backward_use is not None}
        return super().plan(strategy, decisions, reloads)


def check_offloadable(joint: JointGraph, plan: Plan) -> None:
    """Refuse a plan that offloads what PyTorch's offloading pass would not."""
    bad = [n for n, d in plan.decisions.items()
           if d == Decision.OFFLOAD and n not in joint.offloadable]
    if bad:
        why = joint.not_offloadable.get(bad[0], "not a saved activation of this graph")
        raise InputError(
            f"the plan offloads {len(bad)} activation(s) PyTorch's offloading pass cannot "
            f"offload, e.g. '{bad[0]}' ({why}); compiled training offloads only "
            f"{len(joint.offloadable)} of this graph's saved activations")


def _check_applied(joint: JointGraph, plan: Plan, applied: Applied) -> None:
    """The partition must be the plan: the same activations rebuilt, the same offloaded
    (each reloaded in backward), the rest kept."""
    offloads = {n for n, d in plan.decisions.items()
                if d == Decision.OFFLOAD and n in joint.profile.by_name}
    if set(applied.offloaded) != offloads or set(applied.reload_at) != offloads:
        odd = sorted(set(applied.offloaded) ^ offloads) or sorted(
            offloads - set(applied.reload_at))
        raise SlackSwapError(
            f"PyTorch's offloading pass did not offload as planned ({len(odd)} "
            f"activation(s), e.g. '{odd[0]}'); please report this")
    planned = {n for n, d in plan.decisions.items()
               if d == Decision.RECOMPUTE and n in joint.profile.by_name}
    saved = {t.name for t in joint.profile.saved_activations
             if t.producer is not None and t.name not in planned | offloads}
    if set(applied.recomputed) != planned or not set(applied.kept) <= saved | set(
            n for n, d in plan.decisions.items() if d == Decision.KEEP):
        extra = sorted(set(applied.recomputed) - planned) + sorted(set(applied.kept) - saved)
        missing = sorted(planned - set(applied.recomputed))
        raise SlackSwapError(
            f"the partitioner did not follow the plan (not as planned: "
            f"{extra[:3]}; planned to recompute but kept: {missing[:3]}); please report this")


class _Partitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: the planned partition, never cached across
    calls of ``slackswap.compile`` (its uuid is new each time)."""

    def __init__(self, state: CompiledPlan) -> None:
        self.state, self._uuid = state, uuid.uuid4().hex

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.state.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return self._uuid


def _backend(name: str, state: CompiledPlan, options: dict[str, Any]) -> Any:
    if name == "inductor":
        return "inductor", {**options, "custom_partitioner_fn": _Partitioner(state)}
    if options:
        raise InputError(f"options are Inductor's; the '{name}' backend takes none")
    # NOTE [inputs freed at last use]: aot_eager's own compiler, so each graph frees
    # its inputs (backward: the saved activations) at their last use, as Inductor does
    from torch._dynamo.backends.debugging import boxed_nop

    # as torch._dynamo.backends.debugging.aot_eager, with the planned partition
    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                        partition_fn=state.partition,
                        keep_inference_input_mutations=True), None


def check_compile_args(backend: str, compile_kwargs: dict[str, Any]) -> None:
    """Refuse a backend, or ``torch.compile`` keywords, that one planned graph cannot take."""
    if backend not in _BACKENDS:
        raise InputError(f"unknown backend '{backend}'; use one of {', '.join(_BACKENDS)}")
    if compile_kwargs.get("fullgraph", True) is not True:
        raise InputError("slackswap.compile plans one graph: fullgraph=False is not supported")
    if "backend" in compile_kwargs:
        raise InputError("pass the backend as slackswap.compile(..., backend=...)")
    mode = compile_kwargs.get("mode")
    if mode not in (None, "default"):  # NOTE [a mode as options]
        if backend != "inductor":
            raise InputError(f"mode='{mode}' is Inductor's; the '{backend}' backend takes none")
        try:
            _mode_options(mode, compile_kwargs.get("dynamic", False))
        except (KeyError, RuntimeError) as e:
            raise InputError(f"unknown torch.compile mode '{mode}': {e}") from e


def planned_compile(fn: Callable[..., Any], state: CompiledPlan, backend: str,
                    compile_kwargs: dict[str, Any]) -> Any:
    """``torch.compile(fn)`` (a model or its call) to one graph of static shapes per
    batch shape, each partitioned as ``state`` plans it."""
    kwargs = {k: v for k, v in compile_kwargs.items()
              if k not in ("fullgraph", "options", "mode")}
    kwargs.setdefault("dynamic", False)
    compiler, options = _backend(backend, state, _mode_options(
        compile_kwargs.get("mode"), kwargs["dynamic"]) | (compile_kwargs.get("options") or {}))
    return torch.compile(fn, backend=compiler, fullgraph=True, options=options, **kwargs)


# NOTE [a mode as options]
#     torch.compile takes a ``mode`` or ``options``, never both, and the planned partition
#     reaches Inductor as an option (``custom_partitioner_fn``): a ``mode`` passed on raised
#     torch's "Either mode or options can be specified" from inside slackswap.compile. A
#     mode is a set of Inductor options (``torch._inductor.list_mode_options``, as
#     torch.compile applies it), so the mode's options go in with the partitioner, the
#     user's own ``options`` over them: the same Inductor configuration as
#     ``torch.compile(mode=...)``. aot_eager takes no mode (nor options).
def _mode_options(mode: str | None, dynamic: bool | None) -> dict[str, Any]:
    """The Inductor options ``torch.compile(mode=mode)`` applies (NOTE [a mode as options])."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


def compile(  # noqa: A001 - slackswap.compile mirrors torch.compile
    model: torch.nn.Module,
    batch: Batch,
    budget: str | int | float = 0.5,
    hardware: str | Path | Hardware | None = None,
    strategy: str = "slackswap",
    backend: str = "inductor",
    **compile_kwargs: Any,
) -> torch.nn.Module:
    """``torch.compile(model)`` whose partitioner saves and recomputes as a SlackSwap plan
    says (NOTE [compiled recompute]).

    Compiles by running one forward on ``batch`` (buffers and RNG state are restored
    after), so ``compiled.slackswap.plan`` and ``compiled.slackswap.applied()`` are there
    on return. Each later graph (a new batch shape) is planned the same way
    (``compiled.slackswap.graphs``). ``backend`` is ``"inductor"`` or ``"aot_eager"``;
    other keyword arguments go to ``torch.compile`` (``fullgraph`` is always True: one
    plan covers one graph, and a graph break is an :class:`InputError` naming it).
    ``strategy`` is a planner strategy (``"slackswap"`` by default, which offloads where
    the pass's copies cost less than recomputing): offloads go through PyTorch's
    activation-offloading pass, and only activations it can offload are planned to be
    (NOTE [compiled offload]).
    """
    check_compile_args(backend, compile_kwargs)
    hw = resolve_hardware(hardware)  # NOTE [assumed hardware]
    fingerprint = model_fingerprint(model) + batch_fingerprint(
        t for _, t in batch_tensors(batch))
    compiled = _planned_module(model, CompiledPlan(budget, hw, strategy, model, fingerprint),
                               backend, compile_kwargs)
    with leaves_no_trace(model), torch.enable_grad():
        try:
            _call(compiled, batch)
        except SlackSwapError:
            raise
        except Exception as e:
            raise _compile_error(e) from e
    return compiled


# NOTE [a copied compiled module]
#     A deep copy of a compiled module (``copy.deepcopy``, an EMA's ``AveragedModel``) or
#     one pickled whole (``torch.save``) is rebuilt by ``OptimizedModule.__reduce__`` as
#     ``OptimizedModule(copy of the model, copy of dynamo's context)``: the context's
#     backend still held the original's ``CompiledPlan`` (the copy's graphs were planned
#     into the original's ``graphs``, with the original's fingerprint), and what
#     ``slackswap.compile`` set on the instance was gone: ``compiled.slackswap``, and the
#     loss resolved for each call (NOTE [a loss resolved before the graph]), so a GPT-2's
#     copy broke its graph at the loss's logging and raised dynamo's error whole. A
#     compiled module is a ``PlannedModule``, whose copy is compiled again, with the same
#     budget, hardware, strategy, backend and options and a plan state of its own: each
#     of its graphs is planned at its first call, as ``attach(compile=True)`` plans.
class PlannedModule(torch._dynamo.eval_frame.OptimizedModule):
    """What :func:`compile` returns: ``torch.compile``'s module, with ``slackswap`` (the
    plans of its graphs), whose copies are compiled and planned again (NOTE [a copied
    compiled module])."""

    slackswap: CompiledPlan

    def __reduce__(self) -> Any:
        state, (backend, kwargs) = self.slackswap, self.__dict__["_planned_options"]
        return _planned_again, (self._orig_mod, state.budget, state.hardware, state.strategy,
                                backend, kwargs)


def _planned_module(model: torch.nn.Module, state: CompiledPlan, backend: str,
                    compile_kwargs: dict[str, Any]) -> PlannedModule:
    compiled = planned_compile(model, state, backend, compile_kwargs)
    compiled.__class__ = PlannedModule
    # its own: OptimizedModule sets other attributes on the model it wraps
    compiled.__dict__.update(slackswap=state, _planned_options=(backend, dict(compile_kwargs)))
    compiled.forward = with_one_line_errors(with_losses_resolved(compiled.forward, model),
                                            "slackswap.compile")
    return compiled


def _planned_again(model: torch.nn.Module, budget: str | int | float, hardware: Hardware,
                   strategy: str, backend: str, compile_kwargs: dict[str, Any]
                   ) -> PlannedModule:
    """A copy of a compiled module: compiled again, each graph planned at its first call
    (NOTE [a copied compiled module])."""
    return _planned_module(model, CompiledPlan(budget, hardware, strategy, model), backend,
                           compile_kwargs)


def with_one_line_errors(step: Callable[..., Any], who: str) -> Callable[..., Any]:
    """``step``, raising a graph break's or a plan's error as its one-line
    ``SlackSwapError`` (:func:`planning_error`), led by ``who`` and the call's tensor
    shapes, as ``slackswap.attach`` names the batch it could not plan; the model's own
    errors as they are."""

    @functools.wraps(step)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except Exception as e:  # a graph break, or the plan's error: one line
            if (error := planning_error(e)) is None:
                raise  # the model's own
            shapes = [list(t.shape) for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)]
            raise type(error)(f"{who}, planning a batch of shapes {shapes}: {error}") from e

    return call


# NOTE [a loss resolved before the graph]
#     transformers' models pick their loss function on each call from ``loss_type``
#     (``PreTrainedModel.loss_function``), and where that is unset or unknown, as on
#     ``GPT2LMHeadModel``, log a warning before falling back to the causal-LM loss: a
#     logging call Dynamo cannot trace, so a batch with labels broke the one graph
#     ``slackswap.compile`` plans. For each call of the compiled module (and only then),
#     such a module's ``loss_type`` is the fallback's, ``"ForCausalLM"``, and is put back
#     after: the same loss, no logging in the graph, and the user's model unchanged
#     outside the compiled call (called eagerly, it still warns and falls back itself).
#     Dynamo guards on ``loss_type``, which holds on every compiled call.
_FALLBACK_LOSS = "ForCausalLM"
_UNSET = object()  # no loss_type of its own


def _falling_back(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose transformers ``loss_function`` would fall back to
    the causal-LM loss, and warn (NOTE [a loss resolved before the graph])."""
    return [m for m in model.modules()
            if isinstance(getattr(type(m), "loss_function", None), property)
            and "_loss_function" not in vars(m) and not _known_loss(m)]


def _known_loss(module: torch.nn.Module) -> bool:
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # another transformers: leave the model as it is
        return True
    return getattr(module, "loss_type", None) in LOSS_MAPPING


# NOTE [a problem type resolved before the graph]
#     transformers' sequence classifiers pick their loss on their first call with labels
#     and write it to their config: ``config.problem_type``, left None, becomes
#     "regression" (one label), "single_label_classification" (integer labels) or
#     "multi_label_classification" (``modeling_bert.py``'s forward, and the shared
#     ``ForSequenceClassificationLoss``). Dynamo guards on it: the graph traced with it
#     None failed its guard on the next call, so ``slackswap.compile`` traced, profiled
#     and planned the step twice. The compiled call sets it first, by the same rule, to
#     what the model would set on that call, once: the model ends as it would have.
_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def _decides_problem_type(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers sequence classifier that sets its config's
    problem type on its first call with labels (NOTE [a problem type resolved before the
    graph])."""
    config = getattr(model, "config", None)
    return (config is not None and hasattr(config, "problem_type")
            and type(model).__name__.endswith("ForSequenceClassification"))


def resolve_problem_type(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Set ``model.config.problem_type`` as its first call with these ``labels`` would."""
    config, labels = model.config, kwargs.get("labels")
    if config.problem_type is not None or not isinstance(labels, torch.Tensor):
        return
    num_labels = getattr(model, "num_labels", config.num_labels)
    if num_labels == 1:
        config.problem_type = _PROBLEM_TYPES[0]
    elif num_labels > 1 and labels.dtype in (torch.long, torch.int):
        config.problem_type = _PROBLEM_TYPES[1]
    else:
        config.problem_type = _PROBLEM_TYPES[2]


def with_losses_resolved(forward: Callable[..., Any], model: torch.nn.Module
                         ) -> Callable[..., Any]:
    """``forward`` run with the ``loss_type`` of ``model``'s modules that would fall back
    set to the fallback's for the call, and put back after, and a sequence classifier's
    problem type set as its call would set it; ``forward`` itself when neither applies
    (NOTE [a loss resolved before the graph], NOTE [a problem type resolved before the
    graph])."""
    modules = _falling_back(model)
    decides = _decides_problem_type(model)
    if not modules and not decides:
        return forward

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        if decides:
            resolve_problem_type(model, kwargs)
        unknown = [(m, m.__dict__.get("loss_type", _UNSET)) for m in modules
                   if not _known_loss(m)]
        for m, _ in unknown:
            m.loss_type = _FALLBACK_LOSS
        try:
            return forward(*args, **kwargs)
        finally:
            for m, before in unknown:
                if before is _UNSET:
                    del m.loss_type
                else:
                    m.loss_type = before

    return call



def _call(model: Any, batch: Batch) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _compile_error(e: Exception) -> SlackSwapError:
    """A one-line error from what dynamo raised: the graph break, or the planner's error."""
    planning = planning_error(e)
    if planning is not None:
        return planning
    return SlackSwapError(f"torch.compile failed: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")


def planning_error(e: BaseException) -> SlackSwapError | None:
    """The one-line error of a graph the plan cannot cover (a graph break) or of its
    planning (the planner's error, raised inside dynamo), or None: an error of the
    model's own."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, SlackSwapError):
            return cause
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):  # raised whole before
        limit = torch._dynamo.config.recompile_limit
        return InputError(
            f"the model was compiled for {limit} graphs already (a graph per batch shape, "
            f"and per training and evaluation call), torch._dynamo.config.recompile_limit, "
            f"and this call needs another: pad batches to a few lengths "
            f"(pad_to_multiple_of), or raise torch._dynamo.config.recompile_limit")
    # a data-dependent branch (``if x.item() > 0``) is a UserError, not Unsupported: the
    # graph breaks there all the same, and attach(compile=True) raised it whole
    if isinstance(e, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        lines = str(e).strip().splitlines()
        frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
        where = f" at {frames[-1]}" if frames else ""
        return InputError(f"the model has a graph break{where}: {lines[0]}; "
                          "the compiled path plans one graph: remove the break, or train "
                          "eagerly (slackswap.attach without compile=True)")
    return None
