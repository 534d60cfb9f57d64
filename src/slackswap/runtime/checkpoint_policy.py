"""A plan as a selective-checkpoint ``policy_fn`` for ``torch.utils.checkpoint``: PyTorch's
own mechanism saves and recomputes, each op tagged by the plan's decision on what it makes.

NOTE [naming ops for torch.utils.checkpoint]
    The policy is asked about each op of a checkpointed region as the region's forward
    runs, and must answer for the plan's ids (``<module>:<op>:<k>``), which count every op
    of the step, also those outside the regions, which it never sees. So it names an op
    by its place in the profile, as the runtime does (NOTE [watch only what the plan
    rebuilds]): global module hooks, on while the model's forward runs, split that forward
    into the profile's segments (``StepProfile.module_events``), and the k-th op of a
    segment is the profile's op at the segment's start plus k, checked by kind, output
    count, shapes and dtypes. That holds only where the policy saw every op of the segment
    since it began: the segment began inside the same region, told apart by the
    saved-tensor hooks on top (non-reentrant checkpoint pushes its own per region). A
    region that begins between two ops of a module (its ops before it unseen), a step
    other than the profiled one, or an op other than the profile's is refused with a
    one-line error, never guessed.

    SAC saves or rebuilds an op's outputs all at once, and keeps exactly what it saves
    from forward to backward, so an op is tagged MUST_SAVE only when the plan keeps every
    tensor it makes (a saved activation kept, or a checkpoint kept); any other is
    MUST_RECOMPUTE. Holding no tensor the plan does not hold is the safe reading of an op
    whose outputs the plan treats differently: it costs time, never memory. Three kinds
    of op are rebuilt whatever the plan keeps, each reported by ``not_as_planned``:
    - random ops: SAC restores the RNG state once, at the region's start, and a saved op
      draws nothing when the region runs again, so every later random op of the region
      would draw other numbers (a wrong gradient, and nothing raises; checked on 2.13);
    - in-place ops, and the producers of what they change: SAC hands a saved op's
      output back in place of running it, and code that ignores an in-place op's return
      value (dropout's mask on a CPU) would go on with the unchanged tensor;
    - ops whose outputs include one the plan does not keep (``native_dropout``'s output).
    Ops that are not known to replay bit for bit (``profile.recomputable``) are saved,
    with all they make.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from slackswap.core.plan import MIN_PLANNED_BYTES, Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError, SlackSwapError
from slackswap.profiling.naming import is_recorded, module_events, op_kind, strided_tensors
from slackswap.profiling.recorder import dtype_name
from slackswap.profiling.step import batch_fingerprint, eager_module, model_fingerprint
from slackswap.runtime.checks import check_recomputable
from slackswap.runtime.watch import can_watch

__all__ = ["PlanPolicy", "checkpoint_policy"]

_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE


def _top_hooks() -> Any:
    """The saved-tensor hooks innermost now (a non-reentrant checkpoint's, in a region)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks[0] if hooks is not None else None


@dataclass
class _Step:
    """One forward of the model: where it is in the profile, and what the policy tagged."""

    error: str | None  # why this forward cannot be named (raised at the first op asked)
    segment: int = 1  # the model's own pre-hook opened segment 1
    cursor: int = 0  # the profile's index of the next op of the segment
    hooks: Any = None  # the saved-tensor hooks on top when the segment began
    regions: list[Any] = field(default_factory=list)  # their hooks, one per region seen
    tagged: dict[int, tuple[bool, int]] = field(default_factory=dict)  # op -> saved, region


class PlanPolicy:
    """``policy_fn`` for ``torch.utils.checkpoint``'s selective checkpointing that saves and
    recomputes as ``plan`` does, for ``model`` (NOTE [naming ops for torch.utils.checkpoint]).

    Call it as a policy, or pass ``context_fn=policy.context_fn`` to
    ``checkpoint(..., use_reentrant=False)``. It hooks the model's forward (``remove()``, or
    leaving ``with``, takes the hooks off); ``applied()`` and ``not_as_planned()`` tell what
    the last forward's regions saved and rebuilt. ``profile`` is the plan's, by default the
    one a plan from ``slackswap.plan(model, batch)`` carries: traced on this device.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan,
                 profile: StepProfile | None = None) -> None:
        profile = profile if profile is not None else plan._profile
        if profile is None:
            raise InputError("a checkpoint policy needs the profile the plan was made from: "
                             "pass profile=, or plan with slackswap.plan(model, batch)")
        plan.check(profile)
        check_recomputable(profile, plan)
        offloaded = [n for n, d in plan.decisions.items() if d == Decision.OFFLOAD]
        if offloaded:
            raise InputError(
                f"the plan offloads '{offloaded[0]}' ({len(offloaded)} in all), but "
                "torch.utils.checkpoint cannot offload in eager mode (its selective "
                "checkpointing rebuilds MUST_CPU_OFFLOAD ops); plan with "
                "strategy='recompute-only'")
        self.model = eager_module(model)
        params = next(iter(self.model.parameters()), None)
        device = params.device.type if params is not None else "cpu"
        if not can_watch(profile, device):
            raise InputError(
                f"the plan's profile ({profile.mode}, {profile.kernels} kernels) is not of "
                f"a step this {device} runs, so it cannot name the ops a region runs; "
                "plan with slackswap.plan(model, batch), which traces the step here")
        if model_fingerprint(self.model) != plan.fingerprint[:32]:
            raise InputError("plan was made for a different model (its modules, parameter "
                             "shapes, which parameters train, or train/eval mode differ)")
        self.plan, self.profile = plan, profile
        forward = [op for op in profile.ops if op.phase == "forward"]
        self._ops = forward
        starts = [0, *(min(e, len(forward)) for e in profile.module_events)]
        self._starts, self._ends = starts, [*starts[1:], len(forward)]
        self._tags, self._why = _tags(profile, plan, forward)
        self.context_fn: Callable[[], tuple[Any, Any]] = functools.partial(
            create_selective_checkpoint_contexts, self)
        self._step: _Step | None = None
        self._last: _Step | None = None
        self._depth = 0
        self._events = contextlib.ExitStack()
        self._handles = [
            self.model.register_forward_pre_hook(self._begin, with_kwargs=True),
            self.model.register_forward_hook(self._end, always_call=True),
        ]

    # -- the model's forward -----------------------------------------------------------
    def _begin(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._step is not None:  # the model calls itself: part of the step
            self._depth += 1
            return
        if not torch.is_grad_enabled():  # nothing is saved: checkpoint asks no policy
            return
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        got = model_fingerprint(self.model) + batch_fingerprint(tensors)
        error = None if got == self.plan.fingerprint else (
            "the checkpointed forward is not the step the plan was made for (another model "
            f"state or batch shapes: {[list(t.shape) for t in tensors]}); re-plan for it")
        self._step = _Step(error, hooks=_top_hooks())
        self._events.enter_context(module_events(self._module_event))

    def _module_event(self, *args: Any) -> None:
        step = self._step
        if step is not None:
            step.segment += 1
            step.cursor = self._starts[min(step.segment, len(self._starts) - 1)]
            step.hooks = _top_hooks()

    def _end(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._depth:
            self._depth -= 1
            return
        if self._step is None:
            return
        self._events.close()
        step, self._step = self._step, None
        step.regions = [None] * len(step.regions)  # the regions' frames may go
        step.hooks = None
        self._last = step

    # -- the policy --------------------------------------------------------------------
    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if torch.compiler.is_compiling():
            raise InputError("a plan's checkpoint policy drives eager checkpointing; for "
                             "torch.compile use slackswap.compile")
        if getattr(ctx, "is_recompute", False):
            raise SlackSwapError("this PyTorch asks the checkpoint policy again in "
                                 "recompute; PlanPolicy supports PyTorch 2.11 to 2.15")
        if not is_recorded(func):
            return _RECOMPUTE  # views and metadata: nothing of their own to hold
        step = self._step
        if step is None:
            raise InputError("the checkpoint policy ran outside a forward of the model it "
                             "was made for; make one policy per model")
        if step.error is not None:
            raise InputError(step.error)
        top = _top_hooks()
        index = self._name(step, func, ctx.op_output, top)
        tag = self._tags[index]
        region = next((k for k, h in enumerate(step.regions) if h is top), None)
        if region is None:
            region = len(step.regions)
            step.regions.append(top)
        step.tagged[index] = (tag is _SAVE, region)
        return tag

    def _name(self, step: _Step, func: Any, out: Any, top: Any) -> int:
        """The profile's index of this op (NOTE [naming ops for torch.utils.checkpoint])."""
        index, kind = step.cursor, op_kind(func)
        if step.hooks is None or step.hooks is not top:
            where = self._ops[index].module if index < len(self._ops) else ""
            raise InputError(
                f"a checkpointed region begins between two ops of '{where or '(top)'}' "
                f"(at {kind}), where the policy cannot tell which op of the step it is; "
                "checkpoint whole module calls (e.g. each transformer block)")
        if step.segment >= len(self._ends) or index >= self._ends[step.segment]:
            raise InputError(f"the checkpointed step ran {kind} where its profile has no "
                             "op: it is not the profiled step; re-plan for it")
        step.cursor += 1
        op = self._ops[index]
        outputs = strided_tensors(out)
        made = [(t, self.profile.tensors[tid]) for t, tid in zip(outputs, op.outputs,
                                                                  strict=False)
                if self.profile.tensors[tid].producer == index]
        if op.kind != kind or len(outputs) != len(op.outputs) or any(
                list(t.shape) != r.shape or dtype_name(t.dtype) != r.dtype for t, r in made):
            raise InputError(
                f"the checkpointed step ran {kind} {[list(t.shape) for t in outputs]} where "
                f"its profile has {op.kind} in '{op.module}' (op {index}): it is not the "
                "profiled step (another batch, code path or kernels); re-plan for it")
        return index

    # -- what it did -------------------------------------------------------------------
    def _split(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """The last forward's saved activations made in its regions, saved and rebuilt
        (id -> producer), and the plan's recomputed ones made elsewhere."""
        step = self._last
        if step is None:
            raise InputError("no checkpointed forward has run under this policy yet")
        kept, rebuilt, outside = {}, {}, {}
        for name, t in self.profile.by_name.items():
            if t.producer is None or t.producer >= len(self._ops):
                continue
            tagged = step.tagged.get(t.producer)
            if tagged is not None:
                (kept if tagged[0] else rebuilt)[name] = t.producer
            elif _planned(self.plan, t) == Decision.RECOMPUTE:
                outside[name] = t.producer
        return kept, rebuilt, outside

    @property
    def kept(self) -> frozenset[str]:
        """Saved activations the last forward's regions saved (SAC held them)."""
        return frozenset(self._split()[0])

    @property
    def recomputed(self) -> frozenset[str]:
        """Saved activations the last forward's regions left to be rebuilt in backward."""
        return frozenset(self._split()[1])

    def not_as_planned(self) -> dict[str, str]:
        """Id -> why the last forward did not do what the plan says with it: rebuilt
        though kept (NOTE [naming ops for torch.utils.checkpoint]), held though
        recomputed (made outside every region, or read after its own), or held with an
        op that is never replayed."""
        kept, rebuilt, outside = self._split()
        step = self._last
        assert step is not None
        why = {n: "made outside the checkpointed regions: autograd keeps it"
               for n in outside}
        tensors = self.profile.tensors
        for name, producer in rebuilt.items():
            region = step.tagged[producer][1]
            t = self.profile.by_name[name]
            if _planned(self.plan, t) == Decision.RECOMPUTE:
                if any(step.tagged.get(c, (None, -1))[1] != region
                       for c in t.forward_consumers):
                    why[name] = ("read after its checkpointed region, which returns it: "
                                 "held while what reads it holds it")
            elif name in self._why:
                why[name] = self._why[name]
        for producer, (saved, _) in step.tagged.items():
            if saved:
                for tid in self._ops[producer].outputs:
                    name = tensors[tid].name
                    if tensors[tid].producer == producer and name in self._why:
                        why[name] = self._why[name]
        return why

    def applied(self) -> dict[str, int]:
        """What the last forward's regions did with the profile's saved activations:
        ``kept`` (SAC saved them) and ``recomputed`` (rebuilt in backward), each with its
        bytes; ``planned`` counts the plan's recomputes (of at least 1 KiB, as the runtime
        moves), ``not_as_planned`` what differs from the plan."""
        kept, rebuilt, _ = self._split()
        step = self._last
        assert step is not None
        by_name = self.profile.by_name
        planned = [t for t in self.profile.saved_activations
                   if t.name is not None and _planned(self.plan, t) == Decision.RECOMPUTE]
        return {
            "regions": len(step.regions),
            "ops_saved": sum(saved for saved, _ in step.tagged.values()),
            "ops_recomputed": sum(not saved for saved, _ in step.tagged.values()),
            "kept": len(kept), "kept_bytes": sum(by_name[n].bytes for n in kept),
            "recomputed": len(rebuilt),
            "recomputed_bytes": sum(by_name[n].bytes for n in rebuilt),
            "planned": len(planned), "planned_bytes": sum(t.bytes for t in planned),
            "not_as_planned": len(self.not_as_planned()),
        }

    # -- hooks -------------------------------------------------------------------------
    def remove(self) -> None:
        """Take the policy's hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._events.close()
        self._step, self._depth = None, 0

    def __enter__(self) -> PlanPolicy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _planned(plan: Plan, t: Any) -> Decision:
    """The plan's decision on a saved activation as applied: small ones are kept."""
    if t.bytes < MIN_PLANNED_BYTES:
        return Decision.KEEP
    return plan.decisions.get(t.name, Decision.KEEP)


def _tags(profile: StepProfile, plan: Plan, forward: list) -> tuple[list[CheckpointPolicy],
                                                                    dict[str, str]]:
    """Per forward op, its tag; and per id the plan keeps but the tags do not (or holds
    though the plan does not), why (NOTE [naming ops for torch.utils.checkpoint])."""
    tensors, changed = profile.tensors, profile.changed_in_place
    checkpoints = profile.checkpointable
    tags: list[CheckpointPolicy] = []
    why: dict[str, str] = {}
    for op in forward:
        made = [t for t in dict.fromkeys(op.outputs) if tensors[t].producer == op.index]
        status = {}
        for tid in made:
            t = tensors[tid]
            if t.saved:
                status[tid] = _planned(plan, t)
            elif t.name in checkpoints and plan.decisions.get(t.name) == Decision.KEEP:
                status[tid] = Decision.KEEP
            else:
                status[tid] = None  # the plan holds it nowhere
        kept = [tid for tid, s in status.items() if s == Decision.KEEP]
        if not op.replayable and not op.inplace:
            tags.append(_SAVE)
            for tid in made:
                if status[tid] is None:
                    why[tensors[tid].name] = (f"held: made by {op.kind}, which is never "
                                              "replayed, with what the plan keeps")
            continue
        blockers = [tid for tid in made if status[tid] != Decision.KEEP or tid in changed]
        if not kept or not (blockers or op.inplace or op.random):
            tags.append(_SAVE if kept else _RECOMPUTE)
            continue
        tags.append(_RECOMPUTE)
        for tid in kept:
            if op.inplace:
                reason = "an in-place op"
            elif op.random:
                reason = "a random op (SAC restores the RNG state only at a region's start)"
            elif tid in changed:
                reason = "changed in place after it is made"
            else:
                other = next(b for b in blockers if b != tid)
                reason = (f"its {op.kind} also makes '{tensors[other].name}', which the "
                          "plan does not keep")
            why[tensors[tid].name] = f"rebuilt: {reason}"
    return tags, why


def checkpoint_policy(plan: Plan, model: torch.nn.Module,
                      profile: StepProfile | None = None) -> PlanPolicy:
    """A selective-checkpoint ``policy_fn`` for ``torch.utils.checkpoint`` that saves and
    recomputes as ``plan`` does, for ``model`` (its ``context_fn`` goes to
    ``checkpoint(..., use_reentrant=False, context_fn=...)``); ``slackswap.checkpoint_policy``.
    See :class:`PlanPolicy`."""
    return PlanPolicy(model, plan, profile)
