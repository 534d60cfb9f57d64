"""The refusal of a batch unlike the plan's names the batch's shapes and dtypes only: a
model that reads a tensor from outside the step (a constant cached at module level, as
``transformers``' BEiT caches its relative position index in an ``lru_cache``) has that
tensor among its profile's inputs, but it is not part of the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slackswap
from slackswap import InputError

_INDEX = torch.tensor([3, 1, 0, 2])  # made once, outside every step


class _Gathers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x[:, _INDEX]))).square().mean()


@pytest.fixture(scope="module")
def planned() -> tuple[nn.Module, slackswap.Plan]:
    torch.manual_seed(0)
    model = _Gathers()
    plan = slackswap.plan(model, {"x": torch.randn(32, 4)}, budget=1.0, hardware="a100-80gb")
    assert [t.shape for t in plan._profile.tensors if t.kind == "input"] != [[32, 4]]
    return model, plan


def test_a_batch_of_other_shapes_is_named_by_the_batch_shapes_alone(planned) -> None:
    model, plan = planned
    with pytest.raises(InputError, match=r"made for a batch of shapes \[\[32, 4\]\], not "
                                         r"\[\[16, 4\]\]; re-plan"):
        slackswap.apply(model, plan, batch=(torch.randn(16, 4),))  # by position: no names


def test_a_batch_of_other_dtypes_is_named_by_its_dtypes(planned) -> None:
    model, plan = planned
    with pytest.raises(InputError, match=r"made for a batch of dtypes \['fp32'\], not "
                                         r"\['fp64'\] \(shapes \[\[32, 4\]\]\); re-plan"):
        slackswap.apply(model, plan, batch=(torch.randn(32, 4, dtype=torch.float64),))
