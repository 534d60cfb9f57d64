"""Small models named as ``factories:NAME`` by the tests (custom-model path and error cases)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.act(self.up(self.norm(x)))))


class TinyMLP(nn.Module):
    """Residual MLP blocks with a mean-square loss on its output."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class WithMSE(nn.Module):
    """Returns ``{"loss": mean square of the output}`` like a model with a built-in loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.model(x).pow(2).mean()}


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return WithMSE(TinyMLP()), torch.randn(4, 8, 16)


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("shape mismatch in custom block")


def raises() -> tuple[nn.Module, torch.Tensor]:
    return _Raises(), torch.randn(2, 4)


class _NoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(x)}


def no_loss() -> tuple[nn.Module, torch.Tensor]:
    return _NoLoss(), torch.randn(2, 4)


class _FrozenLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.lin(x).sum()}


def frozen() -> tuple[nn.Module, torch.Tensor]:
    return _FrozenLoss(), torch.randn(2, 4)


def empty_batch() -> tuple[nn.Module, torch.Tensor]:
    """A batch of no examples."""
    torch.manual_seed(0)
    return WithMSE(TinyMLP()), torch.randn(0, 8, 16)


def mlp_no_loss() -> tuple[nn.Module, torch.Tensor]:
    """The residual MLP returning its output, not a loss: profiled with a ``--loss``."""
    torch.manual_seed(0)
    return TinyMLP(), torch.randn(4, 8, 16)


def mean_square(output: torch.Tensor) -> torch.Tensor:
    """A loss for ``mlp_no_loss``: ``--loss factories:mean_square``."""
    return output.pow(2).mean()


not_a_function = 3
