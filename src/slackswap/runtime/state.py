"""What one forward pass under a plan leaves for its backward: the storages it made and
how (nodes), which storages came from outside the step, and how forward changed those."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slackswap.profiling.untouched import (
    REBINDABLE,
    HeldAttributes,
    HostRandom,
    held_generators,
)
from slackswap.runtime.recipes import (
    Node,
    Step,
    detached,
    rng_state,
    set_rng_state,
    storage_key,
)

__all__ = ["StepState", "StateBefore", "unseen_step"]


def unseen_step() -> Step:
    """A write the runtime saw but cannot replay (or a storage made where it did not
    watch): a rebuild that needs it stops."""
    return Step(None, (), {}, 0, None, [None])


class StepState:
    """One forward pass's record, kept by its recipes for as long as backward may replay
    them (a second forward of the same block gets a state of its own)."""

    __slots__ = ("nodes", "model_state", "state_keys", "external", "outside_read",
                 "outside_writes", "snapshots", "kept_refs", "packs", "written",
                 "units", "frozen", "unchanged", "__weakref__")

    def __init__(self, model_state: dict[str, torch.Tensor]) -> None:
        self.nodes: dict[int, Node] = {}  # storage -> how it was made, this step
        # held through the step, so the model's storage keys stay its own without a weak
        # reference each (parameters, buffers)
        self.model_state = model_state
        self.state_keys = {storage_key(t) for t in model_state.values()
                           if t.layout == torch.strided}
        # other storages from outside the step (the batch): never named
        self.external: dict[int, StorageWeakRef] = {}
        self.outside_read: set[int] = set()  # outside storages that recipes read
        self.outside_writes: dict[int, int] = {}  # outside storage -> writes in forward
        # outside storages as they were before forward changed them: (storage, writes)
        self.snapshots: dict[tuple[int, int], torch.Tensor] = {}
        self.kept_refs: dict[int, Any] = {}  # storage -> a kept tensor over it, unwatched
        self.packs: dict[int, list[Any]] = {}  # storage -> its moved packed handles
        self.written: list[Any] = []  # packed handles over storages just written
        self.units: dict[int, Any] = {}  # gathered parameter's storage -> its FSDP2 unit
        # host tensors from outside the step that recipes read, a digest of each as read:
        # (storage, forward's writes to it then, its version, the view) -> the digest
        # (NOTE [inputs read by rebuilds]); the values a rebuild has found unchanged since
        self.frozen: dict[tuple[Any, ...], torch.Tensor | None] = {}
        self.unchanged: set[tuple[Any, ...]] = set()

    def is_external(self, key: int) -> bool:
        if key in self.state_keys:
            return True
        ref = self.external.get(key)
        return ref is not None and not ref.expired()

    def mark_external(self, t: torch.Tensor) -> None:
        # the weak reference keeps the storage's key from being reused while it is held
        self.external[storage_key(t)] = StorageWeakRef(t.untyped_storage())

    def gathered(self, p: torch.Tensor, unit: torch.nn.Module) -> None:
        """A parameter FSDP2 gathered for ``unit``: from outside the step, and gathered
        again should a rebuild read it after FSDP2 freed it."""
        self.mark_external(p)
        self.units[storage_key(p)] = weakref.ref(unit)

    def kept(self, t: torch.Tensor, key: int, node: Node | None) -> torch.Tensor:
        """``t`` detached, as autograd will hold it: a rebuild may read the storage
        through it after ``t`` died (or through a node a watched op makes for it later)."""
        kept = detached(t)
        if node is not None:
            node.kept.append(weakref.ref(kept))
        else:
            self.kept_refs[key] = weakref.ref(kept)
        return kept

    def unwatched_node(self, t: torch.Tensor, key: int) -> Node:
        """A storage made where the runtime did not watch: its first step is one no
        replay repeats, so it is read back as it is, or from a saved handle, never made."""
        node = self.nodes[key] = Node(None, unseen_step(), t)
        kept = self.kept_refs.get(key)
        if kept is not None:
            node.kept.append(kept)
        return node


class StateBefore:
    """NOTE [refusals leave no trace]: what a step may change before the runtime refuses
    it half way through forward (a path its profile does not have, say a LayerDrop skip
    drawn differently): the model's buffers (BatchNorm's running statistics) and the
    RNG (dropout, the skip's own draw). Taken as the model is called, once per step,
    into host memory (the device's is the plan's budget): the buffers are few and small
    in the models planned (none in gpt2, two in llama and bert), and copying them costs
    a copy each. Put back when the runtime refuses the
    step before backward began, or runs it again off the profiled path; dropped when the
    block ends. ``host_random``, the modules of a step whose profile drew from random
    streams besides torch's own (SpecAugment's masks in wav2vec2): Python's ``random``,
    NumPy's global generator and the generators those modules hold too, drawn again by a
    step run again (reading NumPy's costs about 0.1 ms, so not for every model). A
    ``torch.Generator`` passed to the model's call (diffusers' ``generator=``), or that
    the model's profiled step drew from (a global: NOTE [generators a profiled step drew
    from]), is put back too."""

    __slots__ = ("buffers", "copies", "rng", "device", "host_random", "generators",
                 "attributes", "rebound")

    def __init__(self, buffers: list[torch.Tensor], device: torch.device | None,
                 host: Any, host_random: list[torch.nn.Module] | None = None,
                 arguments: Iterable[Any] = (),
                 attributes: HeldAttributes | None = None,
                 modules: Iterable[torch.nn.Module] = ()) -> None:
        # the Python attributes the profiled step set (a call counter): a step run again
        # would set them twice
        self.attributes = attributes
        # and those another path may rebind (NOTE [the state a second try starts from])
        self.rebound = ReboundAttributes(modules, attributes)
        self.device = device if device is not None and device.type == "cuda" else None
        self.rng = rng_state(self.device)
        self.host_random = HostRandom() if host_random is not None else None
        # a ``torch.Generator`` passed to the model's call is drawn from again too
        self.generators = held_generators(host_random or (), arguments)
        self.buffers = buffers
        # in host memory (``HostCopies.snapshot``): the device's is the plan's
        with torch.no_grad():
            self.copies = [host.snapshot(b, slot) for slot, b in enumerate(buffers)]

    def restore(self) -> None:
        with torch.no_grad():
            for b, copy in zip(self.buffers, self.copies, strict=True):
                if b.shape != copy.shape:  # resized in place (a quantization observer's
                    b.resize_(copy.shape)  # empty min_val, sized by its first step)
                if b.dtype == copy.dtype:
                    b.copy_(copy, non_blocking=True)  # after the snapshot, in stream order
        set_rng_state(self.rng, self.device)
        if self.attributes is not None:
            self.attributes.restore()
        self.rebound.restore()
        if self.host_random is not None:
            self.host_random.restore()
        for generator in self.generators:
            generator.restore()


# NOTE [the state a second try starts from]
#     A step that leaves the profiled path runs the model's forward again (NOTE [a step
#     off the profiled path] in ``runtime/block.py``), and plain PyTorch runs it once:
#     whatever the first try changed outside the device's tensors must be put back for
#     the second to start where the first did. The profiled step says what its own path
#     changes (the buffers, torch's generators, the generators modules hold, the Python
#     attributes it set); a new path may change more, and nothing of it can be known
#     before it runs. So, taken under every plan as the model's forward is called (after
#     its forward pre-hooks: what a user's hook draws or counts is not drawn again, as
#     the second try runs forward only):
#     - Python's ``random`` and NumPy's global generator (``HostRandom``: about 0.1 ms a
#       step on this project's 2-core CPU, the cost of reading NumPy's state): a path
#       that draws from them where the profiled one did not (Wav2Vec2's SpecAugment
#       turned on by ``mask_time_prob`` after the plan was made) drew twice before;
#     - each module's attributes, by identity (``ReboundAttributes``: a shallow copy of
#       each module's ``__dict__``, 76 us on gpt2-xl@12's 164 modules): an attribute a
#       new path rebinds (a call counter, a flag, a cached tuple) is put back, one it adds
#       is taken away if a scalar, a tuple or a tensor, as the profiled step's own are
#       (``HeldAttributes``, whose attributes this leaves to it: a tensor it holds is held
#       by a weak reference, and the copy lets go of its own strong one). Public names
#       only: a private flag a step set as it registered hooks (transformers' output
#       capturing) taken away alone would have the second try register them twice.
#       Nor the model's ``forward``: the block's guard (``guard_forward``), which the
#       block takes away as it closes, before a refusal there puts the rest back.
#     A buffer a new path rebinds (an EMA assigned anew, which ``nn.Module`` keeps in
#     ``_buffers``) is put back as the tensor it was, its values as they were.
#     Not put back: a container filled in place (a list appended to), a generator a
#     module holds drawn by a path the profiled step did not take, and a tensor attribute
#     written in place; a new path that does any of these runs its second try from
#     there, as before (``verify=True`` does not see it either).
class ReboundAttributes:
    """Each module's attributes by identity, as the model's forward is called: NOTE [the
    state a second try starts from]."""

    __slots__ = ("before", "buffers")

    def __init__(self, modules: Iterable[torch.nn.Module],
                 held: HeldAttributes | None = None) -> None:
        # a shallow copy each (one C call a module): the values, not what is in them
        self.before = [(attrs, attrs.copy()) for attrs in map(vars, modules)]
        # and the buffers each registers: one rebound (``self.ema = 0.9 * self.ema + ...``
        # goes to ``_buffers``) is put back as the tensor it was, whose values
        # ``StateBefore`` puts back
        self.buffers = [(b, b.copy()) for _, attrs in self.before
                        if (b := attrs.get("_buffers"))]
        if held is not None and self.before:  # those put back by ``held``, not here
            copies = {id(attrs): copy for attrs, copy in self.before}
            for attrs, name, _, _ in held.values:
                copy = copies.get(id(attrs))
                if copy is not None:
                    copy[name] = _HELD  # (no strong reference to a tensor held weakly)

    def restore(self) -> None:
        for buffers, before in self.buffers:
            if len(buffers) != len(before) or any(buffers.get(k) is not v
                                                  for k, v in before.items()):
                buffers.clear()
                buffers.update(before)
        for attrs, before in self.before:
            if len(attrs) == len(before) and all(
                    v is _HELD or attrs.get(k, _HELD) is v for k, v in before.items()):
                continue
            for name, value in before.items():
                if (value is not _HELD and not name.startswith("_") and name != "forward"
                        and attrs.get(name, _HELD) is not value):
                    attrs[name] = value
            for name in [n for n in attrs if n not in before and not n.startswith("_")
                         and n != "forward"]:
                if isinstance(attrs[name], REBINDABLE):
                    del attrs[name]


_HELD = object()  # an attribute ``HeldAttributes`` puts back (or, read, none at all)
