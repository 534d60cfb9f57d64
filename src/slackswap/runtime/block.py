"""The ``slackswap.apply`` block: keep, offload or recompute each saved activation of a
real step.

The block owns the step's hooks and checks; the work is split by seam:
:mod:`~slackswap.runtime.recording` watches forward (NOTE [one owner of the hooks]),
:mod:`~slackswap.runtime.saved` packs and unpacks saved tensors, and
:mod:`~slackswap.runtime.replay` rebuilds what the plan recomputes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
import weakref
from typing import Any, NamedTuple

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get_eval_frame_callback
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import (
    InputError,
    PathChanged,
    PathNotice,
    SlackSwapError,
    path_changed,
)
from slackswap.profiling.recorder import dtype_name
from slackswap.profiling.sharding import fsdp_hooks_apart, fsdp_units, rank_prefix
from slackswap.profiling.step import (
    batch_fingerprint,
    batch_tensors,
    eager_module,
    model_fingerprint,
    model_state,
    refuse_functorch,
    refuse_own_checkpointing,
    refuse_saved_tensor_hooks,
    refusing_own_checkpoint_calls,
    refusing_saved_tensor_hooks,
    wrappers,
)
from slackswap.profiling.untouched import HeldAttributes, drawn_from
from slackswap.runtime.checks import held_limit, offload_deadlines, prepare, shapes_differ
from slackswap.runtime.copies import copies_for
from slackswap.runtime.recording import Recorder
from slackswap.runtime.saved import (
    COLLECTOR,
    OffPathSaves,
    OffPathWrites,
    SavedValues,
    not_produced,
)
from slackswap.runtime.state import StateBefore, StepState
from slackswap.runtime.stats import RuntimeStats
from slackswap.runtime.watch import can_watch, watch_for

__all__ = ["apply", "RuntimeStats"]

# NOTE [a step off the profiled path]: device bytes that a step run again off the
# profiled path lets its copies to host memory hold in flight (and an eighth of the plan's
# budget at most)
OFF_PATH_IN_FLIGHT = 64 << 20
_ACTIVE: list[apply] = []  # the block open now, if any: blocks do not nest
_OPENING = threading.Lock()  # NOTE [one thread at a time]


class apply:  # noqa: N801 - used as a context manager, like torch's save_on_cpu
    """Run the forward pass inside ``with slackswap.apply(model, plan):``; backward may
    run inside or after the block. Gradients are bit-identical to training without it.

    ``slackswap.apply(model, plan)`` returns the block, a context manager that
    ``with ... as block:`` binds; after a step ``block.stats`` (a
    :class:`RuntimeStats`) says what it moved and rebuilt. Make it once and reuse it,
    one ``with`` per forward pass.

    ``profile``, when given, is the profile the plan was made for: the plan is checked
    against it before anything runs, and reloads start at the plan's prefetch points.
    A plan from ``slackswap.plan(model, batch)`` carries its profile, so it need not be
    given; without one, each reload starts when backward needs the tensor.
    ``batch``, when given, is checked against the plan's fingerprint up front; otherwise
    the model and the batch it is called with are checked before it runs. Plans name
    activations by the ids a profile of the same model, batch shape and kernels gives.

    ``verify=True`` proves the plan on this model: the runtime holds on the device every
    activation it offloads or drops, and compares every reload and rebuild byte for byte
    with it as backward would read it, raising :class:`~slackswap.VerifyError` on the
    first difference (a write after the save that no version counter sees, on a step the
    profile did not see make it, included: NOTE [verify reads as backward] in
    ``runtime/saved.py``). It holds them until backward, so use it for a step, not for
    training.

    A step that takes another code path than the profiled one (a random LayerDrop skip,
    a branch on the data) runs again as plain PyTorch from where the model was called,
    saving its activations to host memory (the same gradients, within the budget,
    slower): said once per plan (:class:`~slackswap.PathNotice`), and ``stats.off_path``
    marks it (NOTE [a step off the profiled path]).

    On CUDA the forward pass is assumed to run on one stream per device, and backward on
    the autograd engine's one thread per device (the usual single-GPU step). One block
    is open at a time in a process: another thread's is refused (NOTE [one thread at a
    time]).
    """

    def __init__(self, model: torch.nn.Module, plan: Plan,
                 profile: StepProfile | None = None, batch: Any = None,
                 verify: bool = False):  # (no "-> None": help() shows it as apply's)
        # calls of the wrappers split no segment of the model's ops
        self._wrappers = frozenset(id(w) for w in wrappers(model))
        model = eager_module(model)  # inside torch.compile's or DDP's wrapper
        profile = profile if profile is not None else plan._profile
        self._fingerprint, self._profile, self._plan = plan.fingerprint, profile, plan
        self._state: dict[str, torch.Tensor] = {}  # the model's parameters and buffers
        self._buffers: list[torch.Tensor] = []
        self._modules: list[torch.nn.Module] = []
        self._units: list[torch.nn.Module] = []  # FSDP2's
        self._before: StateBefore | None = None  # NOTE [refusals leave no trace]
        self._handling: BaseException | None = None  # handled as the model was called
        # NOTE [the model is called first]: removed as the model is called
        self._first: RemovableHandle | None = None
        self._ids: set[int] | None = None  # the model's modules', should one run first
        self._resized_seen: _Checked | None = None  # NOTE [buffers the profiled step resized]
        self._walked: tuple[_Walk, _Checked] | None = None  # see ``use_walk``
        if batch is not None:
            self._check_model(model)
            named = dict(batch_tensors(batch))
            self._check_batch(list(named.values()), named)
        # Prefetch points are profile op indices; the profile says which op needs what.
        # Without one, reloads are issued when backward needs them.
        first_use: dict[str, int] = {}
        self._checkpoints: dict[str, int] = {}  # unsaved tensors kept -> release position
        prefetch: list[tuple[str, int]] = []
        offloaded = None  # without a profile, the host-buffer pool keeps what it held
        produced_at: dict[str, int] = {}
        free_before: dict[str, int] = {}  # NOTE [offloads free where simulated]
        # NOTE [offloads issued in groups] (without a profile, each offload is issued alone)
        issued_at: dict[str, int] = {}
        if profile is not None:
            ready = prepare(profile, plan)
            first_use, self._checkpoints = ready.first_use, ready.checkpoints
            prefetch = ready.prefetch  # on a tie, in the simulator's order
            offloaded = ready.offloaded_bytes
            produced_at = ready.produced_at
            issued_at = ready.issued_at
            moved = ready.moved
        else:
            prefetch = sorted(plan.prefetch.items(), key=lambda kv: (kv[1], kv[0]))
            moved = {n: d for n, d in plan.decisions.items() if d != Decision.KEEP}
        self.model = model
        self.verify = verify
        # NOTE [watch only what the plan rebuilds]; without a profile that can guide it,
        # every forward op is watched and named by the shared rule
        params = next(iter(model.parameters()), None)
        device = params.device.type if params is not None else "cpu"
        self._device = params.device if params is not None else None
        copies = copies_for(plan, offloaded)  # NOTE [buffers held by events]
        if (profile is not None and self._device is not None
                and copies.asynchronous(self._device)):  # elsewhere copies are synchronous
            free_before = offload_deadlines(profile, plan)
        self._watch = (watch_for(profile, plan)
                       if profile is not None and can_watch(profile, device) else None)
        if self._watch is None:  # packs not named by their order: none to group by
            issued_at = {}
        self.decisions = moved  # (shared with every block of this plan: read only)
        # NOTE [buffers held by events]: host buffers are reused from step to step
        # NOTE [a longer path holds no more than the profiled step] in ``runtime/saved.py``
        held = held_limit(profile, plan) if self._watch is not None else None
        self.values = SavedValues(self.decisions, verify, self._watch, first_use, prefetch,
                                  copies, produced_at, free_before, issued_at, held)
        self.state = self.values.state  # the last forward's record
        self._calls = 0
        self._exit: contextlib.ExitStack | None = None

    @property
    def stats(self) -> RuntimeStats:
        """What the last step under this block did."""
        return self.values.stats

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> apply:
        _refuse_other_threads()
        if torch.compiler.is_compiling() or _get_eval_frame_callback() not in (None, False):
            # NOTE [compiled code runs eagerly in a block]: not from code Dynamo compiles
            raise InputError(
                "slackswap.apply: the block is opened in code torch.compile runs, whose ops "
                "a plan cannot reach; open it outside the compiled function (a compiled "
                "model then runs eagerly in it), or use slackswap.compile"
            )
        if _ACTIVE:
            raise InputError(
                "slackswap.apply blocks do not nest: a block already runs "
                f"{'this' if _ACTIVE[-1] is self else 'another'} plan; close it first "
                "(one block per forward pass)"
            )
        if not torch.is_grad_enabled():  # under no_grad nothing is saved
            return self
        refuse_saved_tensor_hooks()  # NOTE [saved-tensor hooks of the program's own]
        refuse_functorch("slackswap.apply: ")  # NOTE [a step inside a torch.func transform]
        self._check_model(self.model)
        # What earlier steps packed stays valid: their handles hold their own nodes, and
        # host copies and rebuilt storages go as they are unpacked.
        self.state = StepState(self._state)
        recorder = Recorder(self.state, self._watch, self._checkpoints, self.values,
                            self._wrappers)
        recorder.quiet = True  # until the model is called (NOTE [the model is called first])
        self.values.new_step(self.state, recorder)
        self.values.copies.begin()  # NOTE [streams resolved once per block]
        self.values.in_forward = False
        self._calls = 0
        # Every global change is undone by this stack, on every exit path.
        with contextlib.ExitStack() as stack:
            with _OPENING:  # (two threads may both have found no block open)
                _refuse_other_threads()
                self._thread = threading.get_ident()
                _ACTIVE.append(self)
            stack.callback(_ACTIVE.remove, self)
            guard_forward(self.model, stack)  # NOTE [a step off the profiled path]
            # NOTE [the model is called first]
            self._first = nn_module.register_module_forward_pre_hook(self._first_call)
            stack.callback(self._first.remove)
            # what forward left waiting for its group (NOTE [offloads issued in groups])
            stack.callback(self.values.issue_waiting)
            stack.callback(self.model.register_forward_pre_hook(
                self._check_call, with_kwargs=True).remove)
            stack.callback(self.model.register_forward_hook(
                self._forward_done, always_call=True).remove)
            stack.enter_context(refusing_own_checkpoint_calls())
            # NOTE [saved-tensor hooks of the program's own]: the model's own pair is
            # refused; the runtime's, and the pair of a step off the profiled path, not
            stack.enter_context(refusing_saved_tensor_hooks(SavedValues.pack,
                                                            OffPathSaves.pack))
            # NOTE [compiled code runs eagerly in a block]
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            recorder.enter(self.model, stack)
            # NOTE [FSDP2's hooks are not the step]
            stack.enter_context(fsdp_hooks_apart(self.model, recorder.quieted,
                                                 self.state.gathered, self._units))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                self.values.pack, self.values.unpack))
            # NOTE [no cyclic GC in forward]: the runtime keeps a small record per forward
            # op until backward, and those allocations set off Python's cyclic collector
            # over the whole heap again and again: two thirds of the runtime's cost per
            # op, on a heap as large as a training process has. Reference counting still
            # frees everything; only the cycle collector waits, until the step's backward
            # has run (NOTE [no cyclic GC until backward] in ``runtime/saved.py``), or
            # until the block ends where it packed nothing or was refused.
            COLLECTOR.release()  # (a step before whose backward never ran)
            COLLECTOR.hold(self.values)
            stack.push(self._collector_after)
            self._exit = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._exit is not None:
            stack, self._exit = self._exit, None
            stack.__exit__(*exc)
        error = exc[1]
        if error is None and self._before is not None and not self.values.checked:
            error = self._saved_after_the_block()
        # a refusal after the model returned (in the loss the profile traced), before
        # backward began: NOTE [refusals leave no trace]
        self._refused(error)
        self._before = None
        if error is not exc[1]:
            raise error

    def _saved_after_the_block(self) -> InputError | None:
        """The refusal of a step whose block closed, before backward, with activations
        the plan moves still unsaved: what makes them (a loss the plan was profiled
        with) runs after the block, where no plan reaches. Said here, where the buffers
        and the RNG can still be put back, not in backward."""
        missing = self.values.unproduced()
        if not missing:
            return None
        if not self.values.saved_later(missing):  # not by this step at all
            return not_produced(missing)
        return InputError(
            f"plan moves '{missing[0]}' (and {len(missing) - 1} more), which the step had "
            "not saved when the block closed: the loss it was profiled with runs after "
            "the block; compute the loss inside `with slackswap.apply(...)`"
        )

    def run_forward(self, forward: Any, args: tuple, kwargs: dict) -> Any:
        """The model's own forward, run again as plain PyTorch when it leaves the
        profiled path before backward began (NOTE [a step off the profiled path])."""
        self._take_before(args, kwargs)
        try:
            out = forward(*args, **kwargs)
            self.values.forward_returned()
            said = self._other_saves()
            if said is None or self._before is None or self.values.checked:
                return out
            del out  # (the first try's graph goes with it)
        except PathChanged as e:
            if self._before is None or self.values.checked or self._exit is None:
                raise
            said = str(e)  # (the error and its frames, the first try's tensors, go here)
        before, self._before, recorder = self._before, None, self.values.recorder
        assert recorder is not None
        recorder.quiet = True  # the rest of the step is the model's alone
        recorder.stop()
        self.values.drop_step()  # the first try's activations, whoever holds its graph
        before.restore()  # the buffers and RNG as the model was called
        values = self.values
        budget = self._plan.budget_bytes
        saves = OffPathSaves(values.state, values.copies, values.stats, OFF_PATH_IN_FLIGHT
                             if budget is None else min(OFF_PATH_IN_FLIGHT, budget // 8))
        self._exit.enter_context(torch.autograd.graph.saved_tensors_hooks(saves.pack,
                                                                          saves.unpack))
        values.stats.off_path = True
        if not self._plan._off_path_said:
            self._plan._off_path_said = True
            warnings.warn(f"{said[:1].upper()}{said[1:]}. This step and the next such ran "
                          "again as plain PyTorch (the same draws and gradients), saving "
                          "their activations to host memory: within the plan's budget, "
                          "but slower; set the model's LayerDrop rate to 0 to run the plan",
                          PathNotice, stacklevel=2)
        with OffPathWrites(saves):
            return forward(*args, **kwargs)

    def _other_saves(self) -> str | None:
        """What says the model returned having saved fewer tensors than in the profiled
        step (a layer skipped, whose saves matched the next one's, where no watched op
        tells); None if not, or if the plan keeps everything (nothing it does depends on
        the path but its peak, which a shorter path does not pass). A step saving more
        runs again off the path as it saves one more, under any plan (NOTE [a longer path
        holds no more than the profiled step] in ``runtime/saved.py``)."""
        watch, recorder = self._watch, self.values.recorder
        if (not self.decisions or watch is None or watch.model_packs is None
                or recorder is None or recorder.quiet
                or self._exit is None or recorder.packs_seen == watch.model_packs):
            return None
        return path_changed(f"it returned after {recorder.packs_seen} saves where the "
                            f"profiled step made {watch.model_packs}")

    def _collector_after(self, kind: Any, error: Any, trace: Any) -> None:
        """The block closes: the collector stays paused until backward only when forward
        packed what backward will unpack (NOTE [no cyclic GC until backward])."""
        if error is not None or not self.values.handles:
            COLLECTOR.release()

    def _refused(self, error: BaseException | None) -> None:
        """Put back what the step changed when the runtime refuses it in forward."""
        before = self._before
        if before is not None and isinstance(error, SlackSwapError) and not self.values.checked:
            self._before = None
            recorder = self.values.recorder  # the runtime's own writes, not the model's
            with recorder.quieted() if recorder is not None else contextlib.nullcontext():
                before.restore()

    # -- what the plan was made for ----------------------------------------------------
    def use_walk(self, walked: tuple[_Walk, _Checked]) -> None:
        """The walk of the model :func:`walk_model` made just now (``slackswap.attach``
        keys its plans by the fingerprint it gives), taken by this block's next entry
        instead of a walk of its own: NOTE [the model checked in one walk]."""
        self._walked = walked

    def _check_model(self, model: torch.nn.Module) -> None:
        # NOTE [the model checked in one walk]
        walked, self._walked = self._walked, None
        walk, seen = walked if walked is not None else walk_model(model)
        refuse_own_checkpointing(model, walk.named_as_seen())
        if seen.digest != self._fingerprint[:32] and not self._resized_by_step(model, seen):
            raise InputError(
                f"{rank_prefix()}plan was made for a different model (its modules, "
                "parameter shapes, which parameters train, or train/eval mode differ); "
                "re-plan for this model"
            )
        self._state = dict(zip(seen.names, walk.tensors, strict=True))
        self._buffers, self._modules = walk.buffers, walk.modules
        self._units = [walk.modules[i] for i in seen.units]

    def _resized_by_step(self, model: torch.nn.Module, seen: _Checked) -> bool:
        """Whether the model is the one planned but for buffers its profiled step
        resized, each in its shape before that step or after (NOTE [buffers the profiled
        step resized]); once per model walk a block sees."""
        resized = self._profile.resized_buffers if self._profile is not None else None
        if not resized:
            return False
        if seen is self._resized_seen:
            return True
        named = list(model.named_modules())
        state = model_state(model, named)
        before = {}
        for name, (was, now) in resized.items():
            t = state.get(name)
            if t is None or list(t.shape) not in (was, now):
                return False
            before[name] = was
        if model_fingerprint(model, named, state, before) != self._fingerprint[:32]:
            return False
        self._resized_seen = seen
        return True

    def _first_call(self, module: torch.nn.Module, args: tuple) -> None:
        """NOTE [the model is called first]: a global forward pre-hook, from the block's
        entry until the model is called: a module of the model called before it is
        refused before it runs."""
        if module is self.model:  # the step begins: nothing more to see
            if self._first is not None:
                self._first.remove()
                self._first = None
                if self.values.recorder is not None:
                    self.values.recorder.quiet = False
            return
        if self._ids is None:
            self._ids = {id(m) for m in self._modules}
        if id(module) in self._ids:
            name = next((n for n, m in self.model.named_modules() if m is module), "?")
            raise InputError(
                f"{rank_prefix()}the model's module '{name}' ({type(module).__name__}) "
                f"ran in the block before the model was called: {_CALL_THE_MODEL}")

    def _check_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the model runs: it runs once in the block, on the plan's batch."""
        self._before = None  # a refusal here comes before this call changed anything
        if self._calls:
            raise InputError(
                "the model ran twice in one `with slackswap.apply(...)` block, but a plan "
                "covers one forward pass: open one block per forward (per micro-batch)"
            )
        self._calls += 1
        self.values.in_forward = True
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        self._check_batch(tensors, dict(kwargs) or dict(enumerate(args)))
        for t in tensors:  # the batch is from outside the step
            if t.layout == torch.strided:
                self.state.mark_external(t)
        self._handling = sys.exc_info()[1]  # the model may be called in an except block

    def _take_before(self, args: tuple, kwargs: dict) -> None:
        """What the step may change, as its forward is called (NOTE [refusals leave no
        trace]): after every forward pre-hook of the model, the user's included (a hook
        that draws noise, or counts calls, is not run again by a step run again off the
        profiled path, so what it changed stays: NOTE [the state a second try starts
        from])."""
        recorder = self.values.recorder
        with recorder.quieted() if recorder is not None else contextlib.nullcontext():
            # the modules' generators too where the profiled step drew from one, or with
            # no profile to say (Python's and NumPy's streams under every plan: NOTE [the
            # state a second try starts from])
            drew = self._profile is None or self._profile.host_random
            # generators passed to the call, and those the profiled step drew from
            # (NOTE [generators a profiled step drew from])
            # and the Python attributes it set (NOTE [a step off the profiled path])
            changed = self._profile.changed_attributes if self._profile is not None else None
            held = (HeldAttributes(self.model, changed, self.values.copies.snapshot)
                    if changed else None)
            self._before = StateBefore(self._buffers, self._device, self.values.copies,
                                       self._modules if drew else [],
                                       (*args, *kwargs.values(), *drawn_from(self.model)),
                                       held, self._modules)

    def _forward_done(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.values.in_forward = False
        # called as the model raises too (``always_call``): a refusal in its forward
        error = sys.exc_info()[1]
        if error is not self._handling:
            self._refused(error)

    def _check_batch(self, tensors: list[torch.Tensor], named: dict | None = None) -> None:
        if batch_fingerprint(tensors) == self._fingerprint[32:]:
            return
        if self._profile is not None and named:
            shapes = {t.name: t.shape for t in self._profile.tensors if t.kind == "input"}
            for key, t in named.items():
                planned = shapes.get(f"input:{key}")
                if isinstance(t, torch.Tensor) and planned not in (None, list(t.shape)):
                    raise InputError(f"{rank_prefix()}plan was made for batch '{key}' of "
                                     f"shape {planned}, not {list(t.shape)}; {_REPLAN}")
        given = [(list(t.shape), dtype_name(t.dtype)) for t in tensors]
        raise InputError(f"{rank_prefix()}{shapes_differ(self._profile, given)}; {_REPLAN}")


# NOTE [a step off the profiled path]
#     A plan names what a step saves by the order of its saves, checked against the
#     profiled step's sizes and ops. A model that skips layers at random (LayerDrop:
#     Whisper's encoder_layerdrop, Wav2Vec2's layerdrop, OPT's) or branches on its data
#     takes another path on some steps; the runtime finds it in forward, at the first
#     save or watched op that differs, as it saves one tensor more than the profiled step
#     had by the model's return (``StepProfile.model_saves``) or holds more saved bytes
#     than the plan simulated (NOTE [a longer path holds no more than the profiled step]
#     in ``runtime/saved.py``), or as the model returns having saved fewer tensors than
#     the profiled step (a skipped layer whose saves matched the next one's). The
#     model's forward is called through a guard (``guard_forward``): there, before
#     backward began, the step's changes are put back (the buffers and the RNG, NOTE
#     [refusals leave no trace]), the plan steps aside for the rest of the block, and the
#     model's forward runs again as plain PyTorch, drawing what it drew, under
#     saved-tensor hooks of its own
#     (``OffPathSaves`` in ``runtime/saved.py``; said once per plan object,
#     ``PathNotice``; ``stats.off_path``).
#     Kept as plain PyTorch keeps them, that step's activations peaked at plain PyTorch's
#     peak, over the budget (on a GPU, the out-of-memory error the plan was made to
#     avoid). So each activation it saves (not a parameter, buffer or batch tensor:
#     ``StepState.is_external``; 1 KiB or more) is copied whole to host memory as it is
#     saved, with the plan's own host copies and pool, once per value of its storage,
#     and reloaded when backward unpacks it: the step holds no saved activation of 1 KiB
#     or more on the device but those backward is reading, beside what the model itself
#     holds (its locals, a cache it returns). Gradients are plain PyTorch's bit for bit
#     (the same bytes come back, as the same view). It is slower: every copy out and
#     back is on the step's path, none prefetched. Autograd's own check that a saved tensor was not
#     changed in place before backward, which hooks switch off, is kept: each handle
#     holds a tensor with no storage that shares the saved tensor's version counter, and
#     backward raises as autograd would. Host buffers go back to the pool as autograd
#     lets go of their last handle (after backward, or with a graph dropped).
#     On CUDA the copies are asynchronous, and each holds its device tensor until it is
#     done: where the link is slower than compute those would pile up to the step's
#     whole activation memory. So what copies in flight hold is bounded
#     (``OFF_PATH_IN_FLIGHT``, 64 MiB, and an eighth of the plan's budget at most: a few
#     milliseconds of a PCIe link, copies overlapping the next ops): past it, the compute
#     stream waits for the oldest copies and their tensors go (``HostCopies.
#     hold_in_flight``; ``stats.offload_waits``), as at an offload's deadline (NOTE
#     [offloads free where simulated]). The host never waits: memory in issue order, as
#     the caching allocator counts it, stays bounded. Measured (``benchmarks/
#     off_path_memory.py --seeds 4``, SlackSwap's plan at 50%; the worst off-path step
#     against the budget): Switch 41,284 B where plain PyTorch peaks at 325,692 B
#     (budget 162,846 B), Whisper 63,236 B against 173,352 B (budget 68,516 B). A path
#     that runs layers the profiled one skipped holds more in the model's own hands
#     (its locals, OPT's key-value cache) than the budget was made for: Wav2Vec2's
#     profile skipped all three encoder layers, OPT's two of three, and their off-path
#     steps peak at 146,213 B and 45,220 B (plain 868,854 B and 147,656 B) over budgets
#     of 95,163 B and 36,388 B, but under the smallest plan SlackSwap finds for those
#     paths themselves (155,944 B and 47,048 B): set the LayerDrop rate to 0 to run the
#     plan.
#     What the first try made goes with its error, and before the second try begins the
#     runtime lets go of all it holds for the first try's saves (``SavedValues.
#     drop_step``: kept and small activations, host copies, checkpoints), even where
#     something keeps the first try's autograd nodes alive: a backward hook whose
#     closure holds them (``register_multi_grad_hook``, as ``MemTracker``'s module
#     tracker registers on every module's inputs) makes a cycle through autograd that no
#     collector frees, and held the kept half of the first try through the second.
#     Backward from a tensor kept from the first try is refused in one line. What the
#     second try starts from, beyond the buffers and the RNG: NOTE [the state a second
#     try starts from] in ``runtime/state.py`` (a container filled in place, or a
#     parameter written in place, by a path the profiled step did not take is not put
#     back). A saved activation written after it was
#     saved where no version counter sees (through ``.data``, an op's ``out=`` there) is
#     read by plain PyTorch's backward as written, not as saved: the second try runs
#     under a dispatch mode that sees only its writes (``OffPathWrites``, one Python call
#     per op), and a storage written while a host copy holds its value is held on the
#     device from then on, its handles reading it there. Writes by no op (a NumPy array
#     over the storage), and writes after the model returned, are not seen, as in the
#     profiled step (NOTE [written after it was saved]).


def guard_forward(model: torch.nn.Module, stack: contextlib.ExitStack | None) -> None:
    """Call ``model``'s forward through the open block's :meth:`apply.run_forward` (NOTE
    [a step off the profiled path]); with ``stack``, until it closes, else until
    :func:`unguard`. Bound to the model, so a copy of it calls its own forward."""
    if "_slackswap_own_forward" in model.__dict__:
        return
    model.__dict__["_slackswap_own_forward"] = model.__dict__.get("forward")
    model.forward = types.MethodType(_guarded, model)  # type: ignore[method-assign]
    if stack is not None:
        stack.callback(unguard, model)


def _guarded(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    own = model.__dict__.get("_slackswap_own_forward")
    forward = own if own is not None else type(model).forward.__get__(model)
    block = _ACTIVE[-1] if _ACTIVE else None
    if block is None or block.model is not model:
        return forward(*args, **kwargs)
    if not block._calls:  # NOTE [the model is called first]: not through its hooks
        raise InputError(f"{rank_prefix()}the model's forward was called directly, not "
                         f"through its hooks: {_CALL_THE_MODEL}")
    try:
        return block.run_forward(forward, args, kwargs)
    except BaseException:
        # NOTE [no cyclic GC until backward]: forward raised. Under ``attach`` the block
        # closes in a forward hook that is told of no error (or, on Ctrl-C, runs not at
        # all), while the traceback, which an interactive session keeps, holds the graph
        COLLECTOR.release()
        raise


# NOTE [a guard pickled by name]
#     The guard is a method bound to the model, which pickle stores as the name of its
#     function looked up on the model again as the file loads, before the model's own
#     attributes are back: named ``forward``, it is found as the model's class's forward,
#     so a model pickled under ``attach`` (NOTE [a copied model] in ``runtime/attach.py``)
#     loads calling its own forward, and ``unguard`` (from the copy's dropped hooks, or
#     ``attach``) lets go of the rest. (``copy.deepcopy`` rebinds the function itself.)
_guarded.__name__ = "forward"


def unguard(model: torch.nn.Module) -> None:
    """Undo :func:`guard_forward`: the model's forward is what it was."""
    if "_slackswap_own_forward" not in model.__dict__:
        return
    own = model.__dict__.pop("_slackswap_own_forward")
    current = model.__dict__.get("forward")
    func = getattr(current, "__func__", None)
    # the guard, or what it loads as (NOTE [a guard pickled by name]): the class's own
    loaded = (own is None and func is getattr(type(model), "forward", None)
              and getattr(current, "__self__", None) is model)
    if func is not _guarded and not loaded:
        return  # wrapped again since (accelerate's wrappers call the guard): left as is
    if own is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = own  # type: ignore[method-assign]


# NOTE [the model checked in one walk]
#     The block checks the model every step (its fingerprint against the plan's, no
#     gradient checkpointing of its own, FSDP2's units) and takes its parameters and
#     buffers by name. Those checks walk the module tree five times, with names built
#     for every module: about 0.3 ms a step on gpt2-xl@12 on this CPU
#     (``benchmarks/host_work.py``). One walk without names gives everything they read:
#     each module's class and child, parameter and buffer names, each tensor's shape,
#     dtype and requires_grad (and which tensors appear twice), the train mode. When
#     that key is the one last seen for this model, the names, fingerprint and FSDP2
#     units found then still hold; the tensors themselves come from this walk, so a
#     parameter replaced by another of its shape is this step's. The key holds no module
#     or tensor (a model dropped is not kept alive by it). ``slackswap.attach`` keys its
#     plans by the model's fingerprint: it takes it from the same walk (``walk_model``)
#     and hands the walk to the block it opens (``apply.use_walk``), so a step walks the
#     model once and hashes nothing (a ``model_fingerprint`` of its own cost 0.7 ms a
#     step on gpt2-xl@12 on this project's CPU, the walk 0.6 ms). A step that planned
#     walks again: the profiled step may have resized buffers.


class _Checked(NamedTuple):
    """What the full checks found for a model whose walk gave ``key``."""

    key: list[Any]
    names: list[str]  # model_state's names, in the walk's tensor order
    digest: str  # model_fingerprint
    units: list[int]  # FSDP2 units, as positions in the walk's modules


_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, _Checked] = weakref.WeakKeyDictionary()


def walk_model(model: torch.nn.Module) -> tuple[_Walk, _Checked]:
    """NOTE [the model checked in one walk]: one walk of ``model`` (its eager module), and
    the names, fingerprint (``_Checked.digest``: ``model_fingerprint(model)``) and FSDP2
    units found when its key was last seen, worked out again where the key changed."""
    walk = _Walk(model)
    seen = _CHECKED.get(model)
    if seen is None or seen.key != walk.key:
        named = list(model.named_modules())
        state = model_state(model, named)
        digest = model_fingerprint(model, named, state)
        units = {id(u) for u in fsdp_units(model, walk.modules)}
        seen = _CHECKED[model] = _Checked(walk.key, list(state), digest, [
            i for i, m in enumerate(walk.modules) if id(m) in units])
    return walk, seen


class _Walk:
    """The model's modules as ``named_modules()`` orders them (each once); its
    parameters then buffers as ``model_state`` orders them; the key of NOTE [the model
    checked in one walk]."""

    __slots__ = ("key", "modules", "tensors", "buffers")

    def __init__(self, model: torch.nn.Module) -> None:
        modules: list[torch.nn.Module] = []
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        seen: set[int] = set()
        # tensor -> its position in the key, for a repeat; parameters and buffers apart
        firsts: tuple[dict[int, int], dict[int, int]] = ({}, {})
        key: list[Any] = [model.training]
        add, stack = key.append, [model]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            modules.append(m)
            attrs = m.__dict__
            children = attrs["_modules"]
            add((type(m), tuple(children)))
            for held, kind, first in ((params, attrs["_parameters"], firsts[0]),
                                      (buffers, attrs["_buffers"], firsts[1])):
                add(tuple(kind))
                for t in kind.values():
                    if t is None:
                        continue
                    if id(t) in first:  # tied: model_state names it once
                        add(first[id(t)])
                        continue
                    first[id(t)] = len(key)
                    add((t.shape, t.dtype, t.requires_grad))
                    held.append(t)
            if children:
                stack.extend([c for c in reversed(children.values()) if c is not None])
        self.key, self.modules, self.buffers = key, modules, buffers
        self.tensors = params + buffers

    def named_as_seen(self) -> list[tuple[str, torch.nn.Module]]:
        return [("", m) for m in self.modules]


# NOTE [the model is called first]
#     A plan covers one call of the model, ``model(batch)``, and what the step may change
#     before the runtime refuses it is taken as the model's forward pre-hook runs (NOTE
#     [refusals leave no trace]), there and not as the block opens: a step run again off
#     the profiled path must draw from where the model was called, after whatever the
#     program drew in the block before it. Code that runs the model's modules another
#     way (a method of the model other than forward, ``model.features(x)``; a submodule
#     called alone; ``model.forward(x)``, past the hooks) calls no pre-hook of the model:
#     nothing was taken, and a refusal half way (another code path, saves the plan does
#     not name) left BatchNorm's running statistics updated and the RNG drawn. So from
#     the block's entry until the model is called a global forward pre-hook sees every
#     module call: one of the model's modules (not the model's wrappers) is refused in
#     one line before it runs, and so is the model's forward called directly (its guard,
#     ``guard_forward``, sees it). The hook removes itself as the model is called (one
#     Python call a step; modules called before the model that are not the model's, a
#     data augmentation, pay one more each). What such a method computes before it calls
#     a module of the model runs as the program's own code would before the model's call
#     (a draw there is not undone). That code is not the step's: until the model is
#     called the recorder is quiet (no op checked or recorded, no save named, no module
#     event counted), as the profiled step had nothing before the model's call. (A
#     module called there, an ``nn.Identity`` even, was counted as a module event of
#     the step in a block's first step, and the step ran again off the profiled path.)
_CALL_THE_MODEL = ("a plan covers the model's own call (model(batch)), not another method "
                   "of it or a submodule called alone; call the model as the plan was "
                   "profiled, or profile and plan the module that runs")

# NOTE [buffers the profiled step resized]
#     A plan is checked against the model every step by its fingerprint, which holds each
#     parameter's and buffer's shape. Some buffers are sized by the first step that runs:
#     a per-channel quantization observer's ``min_val`` and ``max_val`` and its fake
#     quantizer's ``scale`` and ``zero_point`` (torch.ao's QAT) are empty, or of one
#     element, until then. The profiled step puts them back as they were (NOTE [a profiled
#     step leaves no trace]), so the first step under the plan is the one profiled, and
#     the second, on a model those buffers now size, was refused as another model. The
#     profile keeps which buffers its step resized, with their shapes before and after it
#     (``StepProfile.resized_buffers``), and a model whose fingerprint differs from the
#     plan's is still the planned one when those buffers, each in one of its two shapes,
#     account for all of it (the fingerprint taken again with their shapes as before).
#     Worked out when the model's walk changes (once, as the first step sizes them), not
#     every step. Whether the step after the first still takes the profiled path (an
#     observer that has seen a step runs other ops: a running min and max) is the path
#     checks' business, as on any step: saves, watched ops and the model's count of saves
#     (NOTE [a step off the profiled path]). The bytes those buffers grow by, a few per
#     channel, are not in the profile's model state.

# what to do about a batch the plan was not made for
_REPLAN = ("re-plan for this batch, or let slackswap.auto(model, budget) (or "
           "slackswap.attach) plan each new batch shape once")


# NOTE [compiled code runs eagerly in a block]
#     A plan names the ops of an eager step, so while a block is open every
#     ``torch.compile``'d function (the model's wrapper, a compiled submodule) runs as eager
#     Python: ``torch.compiler.set_stance("force_eager")``, once as the block opens, undone
#     as it closes. The runtime's dispatch mode alone would not do it: where the plan has
#     nothing to watch the mode is off (NOTE [watch only what the plan rebuilds]), and
#     Dynamo would then compile the forward, inlining the block's module hooks and the
#     runtime's Python they call (breaking its graph on ``TorchDispatchMode.__enter__``,
#     warning, and dropping a half-built ``StorageWeakRef`` whose ``__del__`` prints an
#     unraisable traceback), with kernels other than the ones the plan was made for; and
#     the frames it saw there stayed cached as eager for the rest of training. With the
#     stance, Dynamo looks at no frame in a block, and compiles after it as it would
#     without SlackSwap. (Per module call nothing is added: ``torch.compiler.disable`` on
#     the hooks would cost about 5 us per call.) A block opened in code Dynamo compiles
#     could not make that code eager (torch refuses a stance set there): refused.


# NOTE [one thread at a time]
#     A block changes state the whole process shares: the module hooks that count the
#     forward's module calls are global (``register_module_forward_pre_hook``: another
#     thread's model would move this block's count), the guard against the model's own
#     checkpointing replaces a function of ``torch.utils.checkpoint`` for every thread,
#     and a rebuild replays the RNG state of the default generators every thread draws
#     from. So one block is open at a time in a process: a second thread's is refused in
#     one line, never run wrong. (Backward may still run after the block, in any thread.)
def _refuse_other_threads() -> None:
    if _ACTIVE and getattr(_ACTIVE[-1], "_thread", None) != threading.get_ident():
        raise InputError(
            "slackswap.apply runs one thread's block at a time: another thread's block is "
            "open (its module hooks, checkpoint guard and replayed RNG state are "
            "process-wide); run the threads' forward passes one after another, or train "
            "in separate processes"
        )
