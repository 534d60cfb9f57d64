"""``StepProfile``: the ops and tensors of one training step, as planners and simulators see it."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import Field, NonNegativeFloat, NonNegativeInt

from slackswap.core.jsonio import JsonFile
from slackswap.core.units import MAX_BYTES

__all__ = ["OpRecord", "TensorRecord", "StepProfile", "Phase", "OpCategory", "TensorKind",
           "MIN_PLANNED_BYTES"]

# Saved tensors this small are never moved, whatever a plan says (torchtune's
# ``min_offload_size`` default): the copy's fixed cost outweighs the bytes. Planners do
# not plan them, the simulator and the runtime keep them.
MIN_PLANNED_BYTES = 1024

Phase = Literal["forward", "backward"]
# How the cost model prices an op: GEMM-like, fused attention, memory-bound, or free
# (views and bare allocations launch no kernel).
OpCategory = Literal["matmul", "attention_forward", "attention_backward", "memory", "free"]
# ``gradient``: a weight gradient, made in backward, that becomes (or is accumulated into)
# a parameter's ``.grad``. Like parameters it is model state, not activation memory.
TensorKind = Literal["activation", "input", "parameter", "buffer", "gradient"]


Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
# No kernel runs longer than a day or does more FLOPs than this (a year of a 3e19 FLOP/s
# machine): larger figures are damage, and their sums overflow the simulator's clock.
MAX_OP_SECONDS = 86_400.0
MAX_OP_FLOPS = 1e27


def _at_most(high: float, what: str) -> pydantic.AfterValidator:
    def check(value: float) -> float:
        if value > high:
            raise ValueError(f"{value:g} is not a kernel's {what}: none is over {high:g}; "
                             "fix the file or profile the step again")
        return value
    return pydantic.AfterValidator(check)


OpSeconds = Annotated[NonNegativeFloat, _at_most(MAX_OP_SECONDS, "time in seconds")]
OpFlops = Annotated[NonNegativeFloat, _at_most(MAX_OP_FLOPS, "FLOPs")]
T = TypeVar("T")


class _Record(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)


class OpRecord(_Record):
    """One kernel of the step, in execution order."""

    index: NonNegativeInt
    name: str  # aten overload, e.g. "aten.addmm.default"
    kind: str  # short name used in activation ids, e.g. "addmm"
    phase: Phase
    module: str  # innermost module path, "" for the top level
    category: OpCategory
    dtype: str  # compute dtype: "bf16", "fp16", "fp32", ...
    flops: OpFlops
    bytes_read: Bytes
    bytes_written: Bytes
    time_s: OpSeconds  # on the target (analytic) or as measured
    inputs: list[NonNegativeInt]  # tensor ids
    outputs: list[NonNegativeInt]  # tensor ids (an in-place op lists the tensor it mutates)
    random: bool = False  # draws from the RNG (dropout): recompute must replay RNG state
    inplace: bool = False
    replayable: bool = True  # pure and deterministic: recompute may replay it


class TensorRecord(_Record):
    """One storage: views are resolved to their base, so each saved storage is counted once."""

    id: NonNegativeInt
    name: str | None = None  # stable readable id; set for saved activations
    kind: TensorKind
    bytes: Bytes
    dtype: str
    shape: list[NonNegativeInt]
    producer: NonNegativeInt | None = None  # op index; None for inputs, parameters and buffers
    forward_consumers: list[NonNegativeInt] = []
    backward_consumers: list[NonNegativeInt] = []
    saved: bool = False  # saved for backward by autograd
    first_backward_use: NonNegativeInt | None = None  # the backward op that first needs it
    random: bool = False  # produced or mutated by a random op
    # an op wrote it after autograd saved it and before backward read it back: no plan
    # moves it (NOTE [written after it was saved] in ``slackswap.profiling.recorder``).
    # Left out of the file when false, so profiles without such writes are as before.
    written_after_save: bool = Field(default=False, exclude_if=lambda v: not v)
    # the op after which the step let go of it, where that is after the last op that
    # reads it: the end of the backward node that last unpacked it (BmmBackward holds
    # both its inputs through both its matmuls), a zero gradient autograd made for a
    # node (NOTE [held until let go] in ``slackswap.profiling.recorder``). Left out of
    # the file when unset.
    released_after: NonNegativeInt | None = Field(default=None,
                                                  exclude_if=lambda v: v is None)
    # a saved activation: the forward op after which the program itself let go of it
    # (autograd still held it). A plan that moves it frees it no earlier; unset in a
    # real step's profile, held through forward (NOTE [dropped by the program] in
    # ``slackswap.profiling.recorder``). Left out of the file when unset.
    dropped_after: NonNegativeInt | None = Field(default=None,
                                                 exclude_if=lambda v: v is None)

    @property
    def is_parameter(self) -> bool:
        """Parameters and buffers are model state: never planned."""
        return self.kind in ("parameter", "buffer")

    @property
    def last_backward_read(self) -> int | None:
        """The last backward op that reads (or unpacks) this tensor; None if none does."""
        uses = [*self.backward_consumers,
                *(() if self.first_backward_use is None else (self.first_backward_use,)),
                *(() if self.released_after is None else (self.released_after,))]
        return max(uses) if uses else None

    def gone_before(self, op: int) -> bool:
        """A saved activation backward has read for the last time before ``op``: autograd
        holds it no more (NOTE [gone tensors] in ``slackswap.sim.schedule``)."""
        last = self.last_backward_read
        return self.saved and self.producer is not None and last is not None and last < op


def _fail(problem: str) -> None:
    raise ValueError(f"{problem}; fix the file or profile the step again")


def _in_range(where: str, ids: Iterable[int | None], what: str, count: int) -> None:
    if (bad := next((i for i in ids if i is not None and i >= count), None)) is not None:
        _fail(f"{where}: {what} {bad} is not in the profile, which has {count} {what}s")


def _check_graph(p: StepProfile) -> None:
    """What planners and simulators rely on: each op and tensor at its own index, ids in
    range, forward ops before backward ones, and every tensor as the ops say (below)."""
    if not p.ops:
        _fail("ops: there are none, so there is no step to simulate or plan")
    # who reads and who writes each tensor, as sets: a tensor's checks look an op up in
    # them, not in the op's lists, which a file can make long (one op listing every
    # tensor made the checks quadratic: minutes for a few MB)
    readers: dict[tuple[str, int], set[int]] = defaultdict(set)
    writers: dict[int, set[int]] = defaultdict(set)
    for i, op in enumerate(p.ops):
        if op.index != i:
            _fail(f"ops.{i}.index is {op.index}: ops are listed in execution order")
        if op.phase == "forward" and i and p.ops[i - 1].phase == "backward":
            _fail(f"ops.{i} runs forward after backward began")
        _in_range(f"ops.{i}.inputs", op.inputs, "tensor", len(p.tensors))
        _in_range(f"ops.{i}.outputs", op.outputs, "tensor", len(p.tensors))
        for t in op.inputs:
            readers[op.phase, t].add(i)
        for t in op.outputs:
            writers[t].add(i)
    names: dict[str, int] = {}
    for i, t in enumerate(p.tensors):
        if t.id != i:
            _fail(f"tensors.{i}.id is {t.id}: tensors are listed in id order")
        if t.name is not None and names.setdefault(t.name, i) != i:
            _fail(f"tensors.{i}.name '{t.name}' is tensor {names[t.name]}'s too")
        _check_tensor(p, t, readers, writers)
    if not math.isfinite(sum(op.time_s for op in p.ops)):
        _fail("ops: their times add up to more than a number holds")
    _in_range("saves", (t for t, _ in p.saves if t >= 0), "tensor", len(p.tensors))
    _in_range("saves", (n - 1 for _, n in p.saves), "op", len(p.ops))
    _in_range("module_events", (n - 1 for n in p.module_events), "op", len(p.ops))


def _check_tensor(p: StepProfile, t: TensorRecord,
                  readers: dict[tuple[str, int], set[int]],
                  writers: dict[int, set[int]]) -> None:
    """An activation or gradient that is read is made by an op that lists it as an output,
    read only after that by the ops that list it as an input, first used in backward by a
    backward op; a saved activation has a name."""
    where = f"tensors.{t.id}"
    for field in ("producer", "forward_consumers", "backward_consumers", "first_backward_use",
                  "released_after", "dropped_after"):
        ids = getattr(t, field)
        _in_range(f"{where}.{field}", ids if isinstance(ids, list) else [ids], "op", len(p.ops))
    made = -1 if t.producer is None else t.producer
    used = t.saved or t.forward_consumers or t.backward_consumers
    if made < 0 and used and t.kind in ("activation", "gradient"):
        _fail(f"{where}.producer is missing: an {t.kind} that is read is made by an op")
    if made >= 0 and made not in writers[t.id]:
        _fail(f"{where}.producer: op {made} does not list tensor {t.id} as an output")
    if made >= 0 and made in readers[p.ops[made].phase, t.id]:  # (a rebuild needs it)
        _fail(f"{where}.producer: op {made} reads tensor {t.id}, which it makes")
    for phase in ("forward", "backward"):
        if set(getattr(t, f"{phase}_consumers")) != readers[phase, t.id]:
            _fail(f"{where}.{phase}_consumers are not the {phase} ops that read it")
    first = t.first_backward_use
    released = t.released_after
    if min([made, *t.forward_consumers, *t.backward_consumers]) < made or (
            first is not None and (first < made or p.ops[first].phase != "backward")) or (
            released is not None and (released < made or first is not None
                                      and released < first)):
        _fail(f"{where} is read before it is made, or its first_backward_use is not a "
              "backward op, or it is released before it is made or first read in backward")
    if t.saved and not t.is_parameter and t.name is None:
        _fail(f"{where}.name is missing: a plan names each saved activation")


class StepProfile(JsonFile, _Record):
    """Ops in execution order (forward, then backward) and the tensors they read and write."""

    # 2: weight gradients are their own tensor kind (``gradient``), out of activation
    # memory. A version-1 file still loads; its weight gradients count as activations.
    # 3: ``saves`` and ``module_events``, which let the runtime find a plan's tensors
    # without watching every op. Older files load without them (the runtime then watches
    # every forward op).
    schema_version: int = 3
    model: str
    fingerprint: str  # hash of module structure, parameter and batch shapes and dtypes
    hardware: str
    mode: Literal["analytic", "measured", "traced"]
    kernels: Literal["cuda", "native"]
    device: str
    layers: list[str]  # module paths of the transformer blocks, in order
    model_state_bytes: Bytes  # parameters and buffers (model states are not planned)
    ops: list[OpRecord]
    tensors: list[TensorRecord]
    # Forward only, in order: at each pack, the tensor id autograd saved (-1: not strided)
    # and the number of ops run before it; before each module call's pre- or post-hook
    # fired, the number of ops run.
    saves: list[tuple[Annotated[int, Field(ge=-1)], NonNegativeInt]] = []
    module_events: list[NonNegativeInt] = []
    # how many of ``saves`` the model's forward made before it returned (the rest: the
    # loss after it); a step that made fewer took another path. Left out when unknown.
    model_saves: NonNegativeInt | None = Field(default=None, exclude_if=lambda v: v is None)
    # whether the step drew from Python's ``random`` or NumPy's global generator (the
    # runtime then puts them back with the step it puts back); left out when it did not
    host_random: bool = Field(default=False, exclude_if=lambda v: not v)
    # the loss runs after the block that applies the plan (``slackswap.attach``'s block
    # covers the model's call): what only the loss saves is out of the runtime's reach
    # (``out_of_reach``); left out when not
    loss_outside: bool = Field(default=False, exclude_if=lambda v: not v)
    # buffers the step resized in place, by name: their shapes before it (those of the
    # fingerprint) and after (a per-channel quantization observer's ``min_val``, empty
    # until its first step); the runtime takes either (NOTE [buffers the profiled step
    # resized] in ``runtime/block.py``). Left out when none
    resized_buffers: dict[str, tuple[list[NonNegativeInt], list[NonNegativeInt]]] = Field(
        default_factory=dict, exclude_if=lambda v: not v)
    # the modules' Python attributes the step set (a call counter, a cache's length), by
    # module name: the runtime puts them back with the buffers before it runs a step
    # again off the profiled path (NOTE [a step off the profiled path]). Left out when none
    changed_attributes: dict[str, list[str]] = Field(default_factory=dict,
                                                     exclude_if=lambda v: not v)

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> StepProfile:
        _check_graph(self)
        return self

    def derived(self, key: str, make: Callable[[], T]) -> T:
        """``make()``, worked out once per profile under ``key``: tables the simulator and
        runtime derive from the step whatever the plan (a profile is not changed once
        made, as its cached properties assume)."""
        cache = self._derived
        if key not in cache:
            cache[key] = make()
        return cache[key]

    @cached_property
    def _derived(self) -> dict[str, Any]:
        return {}

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> StepProfile:
        """A copy, with nothing derived from this profile: pydantic's copy would share
        the cached tables, stale once ``update`` changes ops or tensors."""
        copy = super().model_copy(update=update, deep=deep)
        for name in _cached_names(type(self)):
            copy.__dict__.pop(name, None)
        return copy

    @cached_property
    def saved_activations(self) -> list[TensorRecord]:
        """Tensors saved for backward that a plan may decide on (not parameters or buffers)."""
        return [t for t in self.tensors if t.saved and not t.is_parameter]

    @cached_property
    def by_name(self) -> dict[str, TensorRecord]:
        """Saved activations by id: what a plan decides on."""
        return {t.name: t for t in self.saved_activations if t.name is not None}

    @cached_property
    def checkpointable(self) -> dict[str, TensorRecord]:
        """Forward activations autograd does not save, by id: a plan may keep them as
        checkpoints to recompute from (the inputs of checkpointed blocks)."""
        return {t.name: t for t in self.tensors
                if t.kind == "activation" and not t.saved and t.name is not None}

    @cached_property
    def offloadable_checkpoints(self) -> frozenset[str]:
        """Checkpoints a plan may offload: forward does not change them in place after
        making them. The runtime copies a checkpoint to the host as it is made, and a
        rebuild may read it at a later value; one that is changed can be kept as a
        checkpoint or left out, never offloaded (``Plan.check`` refuses it, and
        ``PlanContext.plan`` holds every strategy to it)."""
        changed = self.changed_in_place
        return frozenset(n for n, t in self.checkpointable.items() if t.id not in changed)

    @cached_property
    def unmovable(self) -> frozenset[str]:
        """What no strategy moves though it is saved and large enough: what the program
        holds past the step (``held_past_step``) and what the runtime never sees saved
        (``out_of_reach``)."""
        return self.held_past_step | self.out_of_reach

    @cached_property
    def out_of_reach(self) -> frozenset[str]:
        """With ``loss_outside``: activations only the loss saves, after the model returned
        (``model_saves``), where no block applies the plan; autograd keeps them."""
        if not self.loss_outside or self.model_saves is None:
            return frozenset()
        ms = self.model_saves
        inside = {t for t, _ in self.saves[:ms]}
        return frozenset(self.tensors[t].name for t, _ in self.saves[ms:]
                         if t >= 0 and t not in inside)

    @cached_property
    def held_past_step(self) -> frozenset[str]:
        """Saved activations and checkpoints the program itself still held when the step
        ended (a module that caches a tensor it made, as Wav2Vec2-Conformer's rotary
        embedding and Mask2Former's sine position embedding are), in a real step's
        profile (NOTE [held until let go]): moving one frees nothing, so no strategy
        moves it (``PlanContext``)."""
        if self.mode == "analytic" or not self.ops:
            return frozenset()
        last = len(self.ops) - 1
        return frozenset(n for n, t in (self.by_name | self.checkpointable).items()
                         if t.released_after == last and t.dropped_after is None
                         and t.producer is not None)

    @cached_property
    def never_saved(self) -> frozenset[int]:
        """Activations made in forward that autograd never saved and backward never reads:
        rebuilding anything made from one needs it made again first (or kept since forward
        as a checkpoint). One backward reads (the loss, say) is still resident then."""
        return frozenset(t.id for t in self.tensors
                         if t.kind == "activation" and not t.saved and t.producer is not None
                         and not t.backward_consumers
                         and self.ops[t.producer].phase == "forward")

    @cached_property
    def changed_in_place(self) -> frozenset[int]:
        """Tensors a forward op other than their producer writes in place."""
        return frozenset(t for op in self.ops if op.phase == "forward" and op.inplace
                         for t in op.outputs if self.tensors[t].producer != op.index)

    @cached_property
    def recomputable(self) -> frozenset[str]:
        """Saved activations a plan may recompute: every op that wrote them in forward (the
        producer, then in-place ops) is replayable, and so, transitively, is every input
        those ops read that a rebuild may have to make again (one autograd never saved,
        one saved for a backward op that never runs, as a distance before ``argmin``, let
        go of with its node in forward, one changed in place later, read at an earlier
        value, or one backward has read for the last time before the rebuild: autograd
        holds it no more). No op on the
        way reads a tensor the step made by no op (unnamed, not the batch's) that is too
        large for the runtime to hold (NOTE [small unseen tensors] in
        ``slackswap.runtime.recording``)."""
        mutated = self.changed_in_place
        writers: dict[int, list[int]] = {}  # activation -> the forward ops that wrote it
        for op in self.ops:
            if op.phase != "forward":
                break
            for t in op.outputs:  # its producer, or an op that writes it in place
                if (op.inplace or self.tensors[t].producer == op.index) and \
                        self.tensors[t].kind == "activation":
                    writers.setdefault(t, []).append(op.index)

        def rebuildable(root: TensorRecord) -> bool:
            at, seen, todo = root.first_backward_use, set(), [root.id]
            while todo:
                t = todo.pop()
                if t in seen:
                    continue
                seen.add(t)
                for index in writers.get(t, ()):
                    op = self.ops[index]
                    if not op.replayable or any(
                            # read before or after a write no op may have made: a rebuild
                            # could not tell which value forward read
                            self.tensors[u].written_after_save and u not in op.outputs
                            for u in op.inputs) or any(  # NOTE [small unseen tensors]
                            self.tensors[u].kind == "input" and self.tensors[u].name is None
                            and self.tensors[u].bytes >= MIN_PLANNED_BYTES for u in op.inputs):
                        return False
                    todo += [u for u in op.inputs
                             if u not in op.outputs
                             and self.tensors[u].kind == "activation"
                             and (not self.tensors[u].saved or u in mutated
                                  or self.tensors[u].last_backward_read is None
                                  or at is not None and self.tensors[u].gone_before(at))]
            return True

        return frozenset(t.name for t in self.saved_activations
                         if t.name is not None and t.id in writers
                         and not t.written_after_save and rebuildable(t))

    @cached_property
    def keep_all_peak(self) -> int:
        """Peak activation memory with every activation kept and no limit.

        Each activation is resident from the start of its producer to the end of its last
        use (forward or backward consumer, or the backward op that unpacks it).
        """
        last_use: dict[int, int] = {}
        for t in self.tensors:
            if t.kind == "activation" and t.producer is not None:
                uses = [t.producer, *t.forward_consumers, *t.backward_consumers]
                if t.first_backward_use is not None:
                    uses.append(t.first_backward_use)
                if t.released_after is not None:
                    uses.append(t.released_after)
                last_use[t.id] = max(uses)
        frees: dict[int, int] = defaultdict(int)
        for tid, op in last_use.items():
            frees[op] += self.tensors[tid].bytes
        used = peak = 0
        for op in self.ops:
            used += sum(self.tensors[t].bytes for t in dict.fromkeys(op.outputs)
                        if self.tensors[t].producer == op.index and t in last_use)
            peak = max(peak, used)
            used -= frees[op.index]
        return peak

    @cached_property
    def gradient_bytes(self) -> int:
        """Bytes of the weight gradients the step makes (model state, reported apart from
        activation memory): the parameters' ``.grad`` storages and any gradient that was
        accumulated into one."""
        return sum(t.bytes for t in self.tensors if t.kind == "gradient")

    @cached_property
    def working_set(self) -> tuple[int, int]:
        """The largest set of activations one op needs at once (inputs and outputs), and
        that op: no plan goes below it."""
        best, where = 0, 0
        for op in self.ops:
            ids = {tid for tid in (*op.inputs, *op.outputs)
                   if self.tensors[tid].kind == "activation"}
            size = sum(self.tensors[tid].bytes for tid in ids)
            if size > best:
                best, where = size, op.index
        return best, where

    def layer_index(self, module: str) -> int | None:
        """Index of the transformer block that contains ``module``, or None."""
        if module not in self._layer_of:
            self._layer_of[module] = next(
                (i for i, layer in enumerate(self.layers)
                 if module == layer or module.startswith(layer + ".")), None)
        return self._layer_of[module]

    @cached_property
    def _layer_of(self) -> dict[str, int | None]:
        return {}

    def phase_time(self, phase: Phase) -> float:
        return sum(op.time_s for op in self.ops if op.phase == phase)

    def phase_flops(self, phase: Phase) -> float:
        return sum(op.flops for op in self.ops if op.phase == phase)

    def saved_bytes_by(self, key: Literal["layer", "kind", "module"]) -> dict[str, int]:
        """Saved activation bytes grouped by producing layer, op kind, or module."""
        groups: dict[str, int] = defaultdict(int)
        for t in self.saved_activations:
            op = self.ops[t.producer] if t.producer is not None else None
            if key == "kind":
                label = op.kind if op else "input"
            elif key == "module":
                label = op.module if op else "input"
            else:
                idx = self.layer_index(op.module) if op else None
                label = self.layers[idx] if idx is not None else "(outside blocks)"
            groups[label] += t.bytes
        return dict(groups)

    def summary(self) -> dict[str, object]:
        """The figures other tools read (names are stable)."""
        by_layer = self.saved_bytes_by("layer")
        return {
            "model": self.model,
            "hardware": self.hardware,
            "mode": self.mode,
            "fingerprint": self.fingerprint,
            "saved_bytes_total": sum(t.bytes for t in self.saved_activations),
            "saved_bytes_per_layer": [by_layer.get(layer, 0) for layer in self.layers],
            "num_saved_tensors": len(self.saved_activations),
            "forward_flops": self.phase_flops("forward"),
            "backward_flops": self.phase_flops("backward"),
            "forward_time_s": self.phase_time("forward"),
            "backward_time_s": self.phase_time("backward"),
            "num_ops": len(self.ops),
            "model_state_bytes": self.model_state_bytes,
            "gradient_bytes": self.gradient_bytes,
        }


def _cached_names(cls: type) -> list[str]:
    """The cached properties of ``cls`` and its bases."""
    return [name for klass in cls.__mro__ for name, value in vars(klass).items()
            if isinstance(value, cached_property)]
