"""PyTorch's own edge cases for saved-tensor hooks and non-reentrant checkpointing (from
``test/test_autograd.py`` and ``torch/utils/checkpoint.py``), as small ``nn.Module`` steps.

Each factory returns ``(model, batch, loss_fn)`` like :mod:`zoo`, with a fixed seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

Case = tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class _InplaceTanh(torch.autograd.Function):
    """Changes its input in place (``ctx.mark_dirty``) and saves the changed tensor, with a
    None among the saved tensors."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x.tanh_()
        ctx.mark_dirty(x)
        ctx.save_for_backward(None, x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _, y = ctx.saved_tensors
        return grad * (1 - y * y)


class _MarkDirty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = _InplaceTanh.apply(self.a(x))
        return {"loss": self.b(h * 2).square().mean()}


def mark_dirty() -> Case:
    torch.manual_seed(0)
    return _MarkDirty(), torch.randn(32, 64), None


class _InplaceOnView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.a(x).clone()
        y[:, :2].mul_(2)  # in place through a view of the base
        z = y.exp()  # saves its output
        w = y[:, 4:].unsqueeze(1).expand(-1, 3, -1)  # a saved view of a view
        return {"loss": (self.b(z).sum() + (w * w.detach()).sum()) / 100}


def inplace_on_view() -> Case:
    torch.manual_seed(0)
    return _InplaceOnView(), torch.randn(32, 64), None


class _NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():  # a constant made from an activation, saved by the div
            scale = h.abs() + 1
            scale.mul_(0.5)
        d = torch.tanh(h).detach()  # a detached alias, saved by the mul
        return self.b(h / scale * d)


def no_grad_region() -> Case:
    torch.manual_seed(0)
    return _NoGradRegion(), torch.randn(32, 64), _mean_square


class _WeightTying(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.mix = nn.Linear(64, 64)
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), ids.flatten())}


def weight_tying() -> Case:
    torch.manual_seed(0)
    return _WeightTying(), {"ids": torch.randint(0, 100, (4, 16))}, None


class _HookInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.sigmoid(self.a(x))
        h.register_hook(lambda g: g * 0.5)  # changes the gradient flowing back
        out = self.b(h * h)
        out.register_hook(lambda g: g.clamp(-0.01, 0.01))
        return {"loss": out.square().mean()}


def hook_in_forward() -> Case:
    torch.manual_seed(0)
    return _HookInForward(), torch.randn(32, 64), None


class _IntegerTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.a, self.b = nn.Linear(64, 32), nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(ids)
        scores = self.a(h)
        idx = scores.argmax(-1, keepdim=True)  # integer activations, saved by gather
        picked = scores.gather(-1, idx)
        top, where = scores.topk(3, -1)
        h = self.b(h).masked_fill(ids.unsqueeze(-1) == 0, 0.0)
        h = h.index_select(2, where[0, 0].sort().values)
        h = h.scatter_add(1, where.clamp(max=2), top)
        return {"loss": (picked.sum() + h.square().mean() + idx.float().mean())}


def integer_tensors() -> Case:
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (8, 32))
    ids[0, 0] = 0
    return _IntegerTensors(), {"ids": ids}, None


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.angle, self.b = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z = torch.view_as_complex(self.a(x).view(x.shape[0], 32, 2))
        w = z * z.conj()  # saves a conjugate view: the conj bit must survive
        rot = torch.polar(torch.ones_like(w.real), self.angle(x))
        r = torch.view_as_real(w * rot + z.conj().exp()).flatten(1)
        return {"loss": self.b(r).square().mean()}


def complex_tensors() -> Case:
    torch.manual_seed(0)
    return _Complex(), torch.randn(32, 64) * 0.3, None


class _SavedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        g, v = self.lin(x).unsafe_chunk(2, -1)
        g = g.sigmoid_()  # saved; then the same storage changes in place again
        v = v.tanh_()
        return {"loss": (g * v).sum()}


def storage_saved_twice() -> Case:
    torch.manual_seed(0)
    return _SavedTwice(), torch.randn(32, 64), None


class _BufferChanged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(64, 64), nn.Linear(64, 64)
        self.register_buffer("shift", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x) + self.shift
        with torch.no_grad():
            self.shift.add_(1)  # after an op read it; recomputing h would read the new value
        return {"loss": self.out(torch.tanh(h)).square().mean()}


def buffer_changed_in_place() -> Case:
    torch.manual_seed(0)
    return _BufferChanged(), torch.randn(32, 64), None


class _InputChanged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.sin(x * 3)
        x.mul_(0.5)  # the batch changes after an op read it
        return {"loss": self.lin(h.exp()).square().mean()}


def input_changed_in_place() -> Case:
    torch.manual_seed(0)
    return _InputChanged(), torch.randn(32, 64), None


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        adj = torch.relu(self.a(x)).t().to_sparse()  # a sparse activation, saved
        return {"loss": torch.sparse.mm(adj, torch.tanh(self.b(x))).square().mean()}


def sparse() -> Case:
    torch.manual_seed(0)
    return _Sparse(), torch.randn(32, 64), None


class _GradInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        (g,) = torch.autograd.grad(torch.tanh(h).pow(3).sum(), h, create_graph=True)
        return {"loss": (g * self.b(h)).square().mean()}


def grad_in_forward() -> Case:
    """``torch.autograd.grad(create_graph=True)`` inside forward, as physics-informed and
    meta-learning models do: backward ops whose outputs are saved for the real backward."""
    torch.manual_seed(0)
    return _GradInForward(), torch.randn(32, 64), None


class _RandomInFunction(torch.autograd.Function):
    """Stochastic rounding inside a custom Function's forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)
        ctx.save_for_backward(noise)
        return torch.floor(x * 4 + noise) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (noise,) = ctx.saved_tensors
        return grad * (1 + noise)


class _RandomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.b(_RandomInFunction.apply(self.a(x))).square().mean()}


def random_in_function() -> Case:
    torch.manual_seed(0)
    return _RandomFunction(), torch.randn(32, 64), None


class _FunctionMadeAModuleButNotRegistered(nn.Module):
    """A function made a module that its caller keeps out of ``named_modules`` (as the
    ``kernels`` package that transformers 5.25 requires does for Llama's rotary
    embedding): module hooks see it, names do not; ``inner``, another one, runs in it."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self._inner = (inner,)  # a tuple: not a registered child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x) * x
        if self._inner[0] is not None:
            y = self._inner[0](y)
        return torch.sigmoid(y) * y


class _UnregisteredBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)
        self._fn = (_FunctionMadeAModuleButNotRegistered(_FunctionMadeAModuleButNotRegistered()),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self._fn[0](self.proj(x)))


class _Unregistered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _UnregisteredBlock()
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(x)))


def unregistered_modules() -> Case:
    torch.manual_seed(0)
    return _Unregistered(), torch.randn(32, 64), _mean_square


MODELS: dict[str, Callable[[], Case]] = {
    "mark_dirty": mark_dirty,
    "inplace_on_view": inplace_on_view,
    "no_grad_region": no_grad_region,
    "weight_tying": weight_tying,
    "hook_in_forward": hook_in_forward,
    "integer_tensors": integer_tensors,
    "complex_tensors": complex_tensors,
    "storage_saved_twice": storage_saved_twice,
    "buffer_changed_in_place": buffer_changed_in_place,
    "input_changed_in_place": input_changed_in_place,
    "sparse": sparse,
    "grad_in_forward": grad_in_forward,
    "random_in_function": random_in_function,
    "unregistered_modules": unregistered_modules,
}
