"""``slackswap.compile``: plan the joint graph torch.compile runs, and have its partitioner
save and recompute exactly as planned."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
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

from slackswap.compiled.joint import (
    Applied,
    JointGraph,
    applied_partition,
    read_joint,
    tag_joint,
    uniform_per_op,
)
from slackswap.core.hardware import Hardware, load_hardware
from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError, SlackSwapError
from slackswap.planners import plan as plan_profile
from slackswap.profiling.sharding import module_class
from slackswap.profiling.step import (
    Batch,
    batch_fingerprint,
    batch_tensors,
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
#     heuristics), partitions, and reads back from the cut graphs what was saved and
#     rebuilt; a difference from the plan is an error, never a silent change.
#     Three rules follow from the graph:
#     - a graph rebuilds an op, not one output of it: an op with any output to recompute
#       recomputes them all (the plan is made uniform per op before tagging);
#     - ops that may draw from the RNG (dropout, and attention kernels, which are tagged
#       nondeterministic_seeded) are not replayed here: the partitioner would wrap a
#       rebuilt one in run_and_save_rng_state and save an RNG state, which this module
#       does not account for yet; what they make is kept;
#     - offload is not applied yet: a plan that offloads is refused (use
#       ``strategy="recompute-only"``, the default).


@dataclass
class PlannedGraph:
    """One compiled joint graph: its profile, the plan, and what its partition applied."""

    profile: StepProfile
    plan: Plan
    applied: Applied


class CompiledPlan:
    """``compiled.slackswap``: the plans of the graphs compiled so far and what each applied."""

    def __init__(self, budget: str | int | float, hardware: Hardware, strategy: str,
                 model: torch.nn.Module, fingerprint: str) -> None:
        self.budget, self.hardware, self.strategy = budget, hardware, strategy
        self.graphs: list[PlannedGraph] = []
        self._model_name = module_class(model).__name__
        self._layers = transformer_blocks(model)
        self._fingerprint = fingerprint

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
        and bytes of the profile's saved activations, and forward ops run again in
        backward (rebuild chains included)."""
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
        joint = read_joint(gm, num_fwd_outputs, static, self.hardware, model=self._model_name,
                           fingerprint=self._fingerprint, layers=self._layers)
        plan = uniform_per_op(joint, self._plan(joint.profile))
        tag_joint(gm, joint, plan)
        fw, bw = min_cut_rematerialization_partition(
            gm, joint_inputs, compiler=compiler, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static, **kwargs)
        applied = applied_partition(joint, fw, bw, num_fwd_outputs)
        _check_applied(joint, plan, applied)
        self.graphs.append(PlannedGraph(joint.profile, plan, applied))
        return fw, bw

    def _plan(self, profile: StepProfile) -> Plan:
        plan = plan_profile(profile, self.budget, self.hardware, self.strategy)
        if offloaded := [n for n, d in plan.decisions.items() if d == Decision.OFFLOAD]:
            raise InputError(
                f"the '{self.strategy}' plan offloads {len(offloaded)} activation(s) (e.g. "
                f"'{offloaded[0]}'); compiled training recomputes only for now: use "
                "strategy='recompute-only'")
        return plan


def _check_applied(joint: JointGraph, plan: Plan, applied: Applied) -> None:
    """The partition must be the plan: the same activations rebuilt, the rest kept."""
    planned = {n for n, d in plan.decisions.items()
               if d == Decision.RECOMPUTE and n in joint.profile.by_name}
    saved = {t.name for t in joint.profile.saved_activations
             if t.producer is not None and t.name not in planned}
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
    from functorch.compile import make_boxed_func

    def nop(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return make_boxed_func(gm.forward)

    # as torch._dynamo.backends.debugging.aot_eager, with the planned partition
    return aot_autograd(fw_compiler=nop, bw_compiler=nop,
                        partition_fn=state.partition,
                        keep_inference_input_mutations=True), None


def compile(  # noqa: A001 - slackswap.compile mirrors torch.compile
    model: torch.nn.Module,
    batch: Batch,
    budget: str | int | float = 0.5,
    hardware: str | Path | Hardware | None = None,
    strategy: str = "recompute-only",
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
    Offload decisions are not applied yet: a plan that offloads is refused.
    """
    if backend not in _BACKENDS:
        raise InputError(f"unknown backend '{backend}'; use one of {', '.join(_BACKENDS)}")
    if compile_kwargs.pop("fullgraph", True) is not True:
        raise InputError("slackswap.compile plans one graph: fullgraph=False is not supported")
    if "backend" in compile_kwargs:
        raise InputError("pass the backend as slackswap.compile(..., backend=...)")
    hw = load_hardware(hardware or "a100-80gb")
    fingerprint = model_fingerprint(model) + batch_fingerprint(
        t for _, t in batch_tensors(batch))
    state = CompiledPlan(budget, hw, strategy, model, fingerprint)
    compiler, options = _backend(backend, state, compile_kwargs.pop("options", None) or {})
    compile_kwargs.setdefault("dynamic", False)
    compiled = torch.compile(model, backend=compiler, fullgraph=True, options=options,
                             **compile_kwargs)
    compiled.slackswap = state
    with _state_restored(model), torch.enable_grad():
        try:
            _call(compiled, batch)
        except SlackSwapError:
            raise
        except Exception as e:
            raise _compile_error(e) from e
    return compiled


def _call(model: Any, batch: Batch) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _compile_error(e: Exception) -> SlackSwapError:
    """A one-line error from what dynamo raised: the graph break, or the planner's error."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, SlackSwapError):
            return cause
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    if isinstance(e, torch._dynamo.exc.Unsupported):
        lines = str(e).strip().splitlines()
        frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
        where = f" at {frames[-1]}" if frames else ""
        return InputError(f"the model has a graph break{where}: {lines[0]}; "
                          "slackswap.compile plans one graph: remove the break or train "
                          "with slackswap.attach")
    return SlackSwapError(f"torch.compile failed: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")


@contextlib.contextmanager
def _state_restored(model: torch.nn.Module) -> Iterator[None]:
    """Buffers (BatchNorm statistics) and RNG state as they were: compiling runs a forward."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
