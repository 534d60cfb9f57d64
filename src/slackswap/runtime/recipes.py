"""Recipes: how each storage made in forward came to be, recorded so a rebuild can replay
it bit for bit (arguments by reference, RNG states, writes to buffers kept off the model)."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slackswap.profiling.naming import (
    is_attention,
    is_random,
    is_recorded,
    is_replayable,
    op_kind,
    written_arguments,
)

__all__ = ["Ref", "Step", "Node", "GeneratorState", "Scratch", "Outside", "Geometry",
           "map_args", "op_tensors", "storage_key", "detached", "geometry", "view_of",
           "no_autocast", "rng_state", "set_rng_state", "written_arguments", "op_device",
           "plain_strided", "view_or_base", "op_info", "OpInfo"]


@dataclass(slots=True)
class Geometry:
    """Everything that makes a view of a storage read the values it reads."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    conj: bool = False
    neg: bool = False


@dataclass(slots=True)
class Ref:
    """An activation argument: a view into the storage of ``node`` as it was after
    ``upto`` of its steps."""

    node: Node
    upto: int
    geometry: Geometry


def geometry(t: torch.Tensor) -> Geometry:
    # torch.Size is an immutable tuple already, and stride() returns a new tuple
    return Geometry(t.size(), t.stride(), t.storage_offset(), t.dtype, t.is_conj(),
                    t.is_neg())


@dataclass(slots=True)
class Outside:
    """A tensor from outside the recorded step (a parameter, a buffer, the batch) read by
    an op, with its version then and the writes to its storage forward had made (a write
    through ``.data`` leaves the version as it was): a replay reads it only as it was.
    ``step`` is the forward pass that read it (its writes and snapshots)."""

    tensor: torch.Tensor
    version: int
    writes: int = 0
    step: Any = None


@dataclass(slots=True)
class Step:
    func: Any  # None: a write the runtime saw but cannot replay
    args: Any  # with activation tensors replaced by Ref, outside ones by Outside
    kwargs: Any
    output: int  # which tensor output of the op is the node's storage
    rng: tuple[torch.Tensor, torch.Tensor | None] | None
    outputs: list[Node | None]  # the nodes of all the op's outputs, shared by its steps
    grad: bool = False  # grad mode the op ran in: kernels may differ by it


class Node:
    """How one storage made in forward came to be: its producer, then in-place ops."""

    __slots__ = ("name", "key", "device", "steps", "ref", "kept", "storage", "version",
                 "__weakref__")

    def __init__(self, name: str | None, step: Step, tensor: torch.Tensor) -> None:
        self.name = name
        # the version counter of a tensor over the storage after its last step: a write
        # after the block (by the caller, before backward) leaves the steps as they were
        # but not the version (see ``alive``)
        self.version = tensor._version
        storage = tensor.untyped_storage()
        self.key = storage._cdata  # storage_key(tensor)
        self.device = tensor.device
        self.steps = [step]
        self.ref = weakref.ref(tensor)
        self.kept: list[Any] = []  # weak references to saved, kept tensors over the storage
        # NOTE: a weak reference to the StorageImpl keeps its address from being reused,
        # so storage keys stay unique while this node lives.
        self.storage = StorageWeakRef(storage)

    def replayable(self) -> bool:
        """Every op that wrote the storage can be replayed exactly (its own steps)."""
        return all(s.func is not None and is_replayable(s.func) for s in self.steps)

    def unreplayable(self) -> str:
        """The first op that wrote the storage and cannot be replayed, by name."""
        for s in self.steps:
            if s.func is None or not is_replayable(s.func):
                return "an in-place write it cannot see" if s.func is None else str(s.func)
        return "nothing"

    def wrote(self, step: Step, tensor: torch.Tensor) -> None:
        """``step`` wrote the storage through ``tensor`` in place: autograd bumps the
        version counter once the kernel returns."""
        self.steps.append(step)
        self.version = tensor._version + 1

    def alive(self, upto: int) -> torch.Tensor | None:
        """A tensor over the storage as it is after ``upto`` steps, if one still lives
        and nothing has written it since (its version counter says: a caller's in-place
        write after the block, which no step records; then a rebuild makes it again)."""
        if len(self.steps) != upto:
            return None
        tensor = self.ref()
        for kept in self.kept:  # any tensor over the storage serves as the storage
            if tensor is not None:
                break
            tensor = kept()
        if tensor is not None and tensor._version != self.version:
            return None
        return tensor


# NOTE: aten arguments are scalars, tensors and flat lists of them (a schema never nests
# deeper), so two small functions replace torch.utils._pytree here: the dispatch mode runs
# them on every op of the forward pass, and pytree's generality costs about 10x more.
def map_args(fn: Any, x: Any) -> Any:
    kind = type(x)
    if kind is tuple or kind is list:
        out = [map_args(fn, y) if type(y) in _SEQUENCES else fn(y) for y in x]
        return tuple(out) if kind is tuple else out
    if isinstance(x, (tuple, list)):  # a named tuple or a list subclass
        return kind(map_args(fn, y) for y in x)
    return fn(x)


_SEQUENCES = (tuple, list)


def op_tensors(out: Any) -> list[torch.Tensor]:
    """The strided tensor outputs of an op, in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.layout == torch.strided else []
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    return []


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


_UNSEEN = torch._C._DisableTorchDispatch
_dispatch_modes = torch._C._len_torch_dispatch_stack


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` for the runtime's own use (it shares ``t``'s version counter), out
    of sight of dispatch modes: the recorder's own mode would pay a whole watched call
    for an alias it has no use for. Plain tensors only (no subclass dispatches). Outside
    a watched segment no mode is on, and the guard (a context of its own, per saved
    tensor) is not entered."""
    if not _dispatch_modes():
        return t.detach()
    with _UNSEEN():
        return t.detach()


def view_of(base: torch.Tensor, g: Geometry) -> torch.Tensor:
    """A view over ``base``'s storage as ``g`` says, conjugate and negative bits included."""
    if (base.dtype == g.dtype and not g.conj and not g.neg and not base.is_conj()
            and not base.is_neg()):  # the common case, at half the cost
        return base.as_strided(g.size, g.stride, g.offset)
    out = base.new_empty(0, dtype=g.dtype).set_(base.untyped_storage(), g.offset, g.size,
                                                 g.stride)
    if g.conj:
        out = out.conj()
    if g.neg:
        out = torch._neg_view(out)
    return out


def view_or_base(base: torch.Tensor, g: Geometry) -> torch.Tensor:
    """:func:`view_of`, or ``base`` itself when it already reads what ``g`` reads (an
    op's whole output, the usual input of a replayed op): replay only reads inputs."""
    if (base.dtype == g.dtype and base.storage_offset() == g.offset and not g.conj
            and not g.neg and base.size() == g.size and base.stride() == g.stride
            and not base.is_conj() and not base.is_neg()):
        return base
    return view_of(base, g)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_strided(t: torch.Tensor) -> bool:
    """A plain dense tensor whose values are its storage's bytes read through its geometry:
    the only kind the runtime moves or rebuilds (sparse, nested, quantized and subclass
    tensors are kept as autograd saved them)."""
    return (type(t) in _PLAIN and t.layout == torch.strided and not t.is_quantized
            and not t.is_nested)


def no_autocast() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    return stack


def rng_state(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state, and the CUDA generator's of ``device`` (the op's)."""
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None],
                   device: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass(frozen=True, slots=True)
class GeneratorState:
    """A ``torch.Generator`` argument as it was before the op drew from it: replay draws
    from a fresh generator in that state, since the user's own has moved on."""

    device: torch.device
    state: torch.Tensor

    def generator(self) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.set_state(self.state)
        return generator


@dataclass(frozen=True, slots=True)
class Scratch:
    """A tensor from outside the step that the op writes (a BatchNorm running statistic):
    a replay writes to a copy, so rebuilding an activation leaves the model as it was."""

    tensor: torch.Tensor


class OpInfo(tuple):
    """What the runtime asks of an op overload on every call, worked out once:
    ``(recorded, kind, draws from the RNG, mutable, written arguments)``."""

    __slots__ = ()


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        kind = op_kind(func)
        # attention kernels draw from the RNG when they have dropout
        info = _OP_INFO[func] = OpInfo((
            is_recorded(func), kind, is_random(func) or is_attention(kind),
            func._schema.is_mutable, written_arguments(func)))
    return info


def op_device(args: tuple) -> torch.device | None:
    for x in args:
        if isinstance(x, torch.Tensor):
            return x.device
    return None
