"""Saved-tensor hooks of the program's own (``torch.autograd.graph.save_on_cpu``, any
``saved_tensors_hooks`` pair), entered in the model's forward or active around the step,
are refused in one line, leaving the model, its gradients, the batch and the RNG as they
were (NOTE [saved-tensor hooks of the program's own] in ``slackswap/profiling/step.py``).
They used to be obeyed or replaced silently: inside, the plan offloaded the region's
tensors as checkpoints that freed nothing, and the step measured 140% of its budget.
Without them the same model trains under its plan exactly and within its budget."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
import transformers
from memory_tracking import ActivationMemory
from torch import nn

import slackswap
from slackswap.errors import InputError

INSIDE = (r"^the model enters saved-tensor hooks of its own in forward \(a saved_tensors_hooks "
          r"pair such as torch.autograd.graph.save_on_cpu, at test_saved_tensor_hooks.py:\d+: "
          r"with region:\), which hide what they save from the plan; remove them")
AROUND = r"^saved-tensor hooks of your own \(torch.autograd.graph.save_on_cpu, or another"
ATTACH = r"^slackswap.attach, planning a batch of shapes \[\[256, 64\]\]: "
SCALARS = 64  # the loss and autograd's seed gradient, held past their last use
_PUSH = torch._C._autograd._push_saved_tensors_default_hooks


class _Region(nn.Module):
    """A residual block (batch norm: buffers; dropout: the RNG) whose forward wraps its
    body in ``save_on_cpu`` when ``on_cpu`` is set."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.act = nn.BatchNorm1d(width), nn.Linear(width, 4 * width), nn.GELU()
        self.drop, self.down = nn.Dropout(0.1), nn.Linear(4 * width, width)
        self.on_cpu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = (torch.autograd.graph.save_on_cpu(pin_memory=False) if self.on_cpu
                  else contextlib.nullcontext())
        with region:
            return x + self.drop(self.down(self.act(self.up(self.norm(x)))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Region(64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        return {"loss": x.pow(2).mean()}


def _net() -> tuple[_Net, torch.Tensor]:
    torch.manual_seed(0)
    return _Net(), torch.randn(256, 64, generator=torch.Generator().manual_seed(1))


def _state(model: nn.Module, x: torch.Tensor) -> list[Any]:
    """Everything a refused step must leave as it was."""
    return [{n: t.clone() for n, t in model.state_dict().items()},
            {n: p.grad for n, p in model.named_parameters()}, torch.get_rng_state(),
            x.clone(), x._version]


def _assert_unchanged(before: list[Any], after: list[Any]) -> None:
    for a, b in zip(before[:2], after[:2], strict=True):
        assert a.keys() == b.keys()
        assert all((a[k] is None and b[k] is None) or torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    assert before[4] == after[4]
    assert torch._C._autograd._push_saved_tensors_default_hooks is _PUSH  # put back


def _grads(model: nn.Module, x: torch.Tensor, plan: Any = None,
           memory: ActivationMemory | None = None) -> dict[str, torch.Tensor]:
    """One step's gradients, under ``plan`` if given."""
    model.zero_grad(set_to_none=True)
    with memory or contextlib.nullcontext():
        with slackswap.apply(model, plan) if plan is not None else contextlib.nullcontext():
            loss = model(x)["loss"]
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _seeded(model: nn.Module, x: torch.Tensor, plan: Any = None,
            memory: ActivationMemory | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)  # dropout draws the same masks in either step
    return _grads(model, x, plan, memory)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_hooks_in_forward_are_refused_by_the_profile_and_attach() -> None:
    """A block whose forward runs under ``save_on_cpu``: planning it is refused as the
    block enters its hooks, part way through the profiled forward (the batch norm before
    it has run), and the model, gradients, batch and RNG are as they were."""
    model, x = _net()
    model.blocks[1].on_cpu = True
    before = _state(model, x)
    with pytest.raises(InputError, match=INSIDE) as refused:
        slackswap.plan(model, x, budget=0.5)
    assert "\n" not in str(refused.value)
    _assert_unchanged(before, _state(model, x))
    with slackswap.attach(model, budget=0.5) as attached, pytest.raises(
            InputError, match=ATTACH + INSIDE[1:]):
        model(x)
    assert not attached.plans
    _assert_unchanged(before, _state(model, x))


def test_hooks_in_forward_under_a_plan_are_refused_and_the_plan_holds_without_them() -> None:
    """A plan made for the model, applied (by ``apply``, then by ``attach``) to a step
    whose block enters ``save_on_cpu``: refused in forward, everything put back. Without
    the hooks the same plan trains exactly (``torch.equal`` with plain PyTorch) and within
    its budget (measured)."""
    model, x = _net()
    plain = copy.deepcopy(model)
    plan = slackswap.plan(model, x, budget=0.5)
    assert any(d != "keep" for d in plan.decisions.values())
    model.blocks[1].on_cpu = True
    before = _state(model, x)
    with pytest.raises(InputError, match=INSIDE):
        _grads(model, x, plan)
    _assert_unchanged(before, _state(model, x))
    model.blocks[1].on_cpu = False
    memory = ActivationMemory(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        got = _seeded(model, x, plan, memory)
    _assert_same(got, _seeded(plain, x))
    assert memory.peak <= plan.budget_bytes + SCALARS, (memory.peak, plan.budget_bytes)
    # under attach, the shape planned already: the runtime refuses, attach closes its block
    with slackswap.attach(model, budget=0.5, strategy="offload-only") as attached:
        _seeded(model, x)
        model.blocks[1].on_cpu = True
        before = _state(model, x)  # the last step's gradients among it
        with pytest.raises(InputError, match=INSIDE):
            model(x)
        _assert_unchanged(before, _state(model, x))
        model.blocks[1].on_cpu = False
        _assert_same(_seeded(model, x), _seeded(plain, x))
        assert len(attached.plans) == 1 and attached.stats.offloaded_bytes > 0


def test_hooks_around_the_step_are_refused_before_it_starts() -> None:
    """``save_on_cpu`` (or any pair) around the whole step: the plan's hooks would replace
    them for its forward, so profiling, ``apply`` and ``attach`` refuse before the model
    runs; outside them the step is exact."""
    model, x = _net()
    plain = copy.deepcopy(model)
    plan = slackswap.plan(model, x, budget=0.5)
    before = _state(model, x)
    packed = []
    for around in (torch.autograd.graph.save_on_cpu(pin_memory=False),
                   torch.autograd.graph.saved_tensors_hooks(packed.append, lambda t: t)):
        with around:
            with pytest.raises(InputError, match=AROUND):
                slackswap.plan(model, x, budget=0.5)
            with pytest.raises(InputError, match=AROUND):
                _grads(model, x, plan)
            with slackswap.attach(model, budget=0.5), pytest.raises(
                    InputError, match=ATTACH + AROUND[1:]):
                model(x)
        _assert_unchanged(before, _state(model, x))
    assert not packed  # the model never ran
    _assert_same(_seeded(model, x, plan), _seeded(plain, x))


def test_a_transformers_step_under_save_on_cpu_is_refused_under_attach() -> None:
    """A Hugging Face model trained ``with save_on_cpu(): loss = model(**batch).loss``
    under ``attach``: refused in one line at the first forward, nothing planned, and the
    model trains exactly once the step runs outside the hooks."""
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    plain = copy.deepcopy(model)
    with slackswap.attach(model, budget=0.6, strategy="recompute-only") as attached:
        with torch.autograd.graph.save_on_cpu(pin_memory=False), pytest.raises(
                InputError, match=r"^slackswap.attach, planning .*: " + AROUND[1:]):
            model(**batch)
        assert not attached.plans
        for net in (model, plain):
            torch.manual_seed(2)
            net(**batch).loss.backward()
        assert len(attached.plans) == 1 and attached.stats.recomputed_ops > 0
    _assert_same({n: p.grad for n, p in model.named_parameters()},
                 {n: p.grad for n, p in plain.named_parameters()})
