"""slackswap.checkpoint_policy: torch.utils.checkpoint's selective checkpointing saving and
recomputing as a plan says, on CPU."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import slackswap
from slackswap.core.plan import Decision
from slackswap.errors import InputError
from slackswap.models.presets import build_model
from slackswap.runtime.checkpoint_policy import PlanPolicy


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class _Net(nn.Module):
    """Not a preset: residual blocks, checkpointed one by one when ``context_fn`` is set."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.context_fn: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.context_fn is None else checkpoint(
                block, x, use_reentrant=False, context_fn=self.context_fn)
        return x.pow(2).mean()


class _HeldBytes(TorchDispatchMode):
    """Bytes of the storages forward made that are still alive when it ends: what the
    step holds for backward (and its outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                s = t.untyped_storage()
                self.made.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def alive(self) -> int:
        return sum(n for ref, n in self.made.values() if not ref.expired())


def _step(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    """One training step from fresh gradients: the loss and the bytes held after forward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout draws the same in both runs
    with _HeldBytes() as held:
        out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = out.loss if hasattr(out, "loss") else out
    held_bytes = held.alive()
    loss.backward()
    return loss.detach(), held_bytes


def _checkpoint_blocks(model: nn.Module, policy: PlanPolicy) -> None:
    if isinstance(model, _Net):
        model.context_fn = policy.context_fn
        return
    kwargs = {"use_reentrant": False, "context_fn": policy.context_fn}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _build(name: str) -> tuple[nn.Module, Any]:
    if name == "custom":
        torch.manual_seed(0)
        return _Net(), torch.randn(64, 32)
    return build_model(name, fake=False, dtype="fp32")


@pytest.mark.parametrize("name", ["custom", "llama-7b-tiny", "gpt2-xl-tiny", "bert-large-tiny"])
def test_policy_trains_exactly_and_follows_the_plan(name: str) -> None:
    model, batch = _build(name)
    reference = copy.deepcopy(model)
    plan = slackswap.plan(model, batch, budget=0.7, strategy="recompute-only")
    planned = {n for n, d in plan.decisions.items() if d == Decision.RECOMPUTE}
    assert planned
    policy = slackswap.checkpoint_policy(plan, model)
    _checkpoint_blocks(model, policy)
    ref_loss, ref_held = _step(reference, batch)
    loss, held = _step(model, batch)

    # bit-identical: loss and every gradient (dropout included: checkpoint replays the RNG)
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)

    # the regions rebuilt what the plan recomputes, and anything else only for a reason
    applied = policy.applied()
    why = policy.not_as_planned()
    assert applied["regions"] == len(model.blocks if name == "custom" else plan._profile.layers)
    outside = {n for n, w in why.items() if w.startswith("made outside")}
    rebuilt = {n for n, w in why.items() if w.startswith("rebuilt")}
    assert policy.recomputed == (planned - outside) | rebuilt
    assert not rebuilt & planned
    assert not (policy.kept & planned)
    if name in ("custom", "llama-7b-tiny"):  # no dropout, no op saving and dropping at once
        assert policy.recomputed == planned - outside
        assert not set(why) - outside
    # what it held after forward is less by what it rebuilds, less what outlives its region
    # (checkpoint also holds its regions' inputs: llama's int64 positions, 256 bytes)
    by_name = plan._profile.by_name
    outlives = sum(by_name[n].bytes for n, w in why.items() if w.startswith("read after"))
    assert 0 <= applied["recomputed_bytes"] - outlives - (ref_held - held) <= 1024
    print(f"{name}: held after forward {ref_held} -> {held} bytes; {applied}")


def test_policy_refuses_another_batch_and_model() -> None:
    model, x = _build("custom")
    plan = slackswap.plan(model, x, budget=0.7, strategy="recompute-only")
    policy = slackswap.checkpoint_policy(plan, model)
    model.context_fn = policy.context_fn
    with pytest.raises(InputError, match="not the step the plan was made for") as error:
        model(torch.randn(32, 32))
    assert "\n" not in str(error.value)
    model(x).backward()  # the planned batch still runs
    with pytest.raises(InputError, match="different model") as error:
        slackswap.checkpoint_policy(plan, _Net(width=16))
    assert "\n" not in str(error.value)
    policy.remove()
    # a region another policy's plan was not made for: named ops differ from its profile
    other, y = _Net(depth=2), torch.randn(64, 32)
    other_plan = slackswap.plan(other, y, budget=0.7, strategy="recompute-only")
    with slackswap.checkpoint_policy(other_plan, other) as stale:
        model.context_fn = stale.context_fn
        with pytest.raises(InputError, match="outside a forward of the model"):
            model(x)


def test_policy_refuses_a_region_that_begins_between_ops() -> None:
    model, x = _build("custom")
    plan = slackswap.plan(model, x, budget=0.7, strategy="recompute-only")
    with slackswap.checkpoint_policy(plan, model) as policy:
        model.forward = lambda x: checkpoint(  # type: ignore[method-assign]
            lambda y: _Net.forward(model, y * 1.0), x, use_reentrant=False,
            context_fn=policy.context_fn)
        with pytest.raises(InputError, match="begins between two ops") as error:
            model(x)
        assert "\n" not in str(error.value)


def test_policy_refuses_ops_other_than_the_profiles() -> None:
    model, x = _build("custom")
    plan = slackswap.plan(model, x, budget=0.7, strategy="recompute-only")
    with slackswap.checkpoint_policy(plan, model) as policy:
        model.context_fn = policy.context_fn
        with torch.no_grad():  # no region asks the policy: evaluation runs as it did
            model(x)
        block = model.blocks[1]  # same modules and shapes, another op
        block.forward = lambda y: y + block.down(torch.relu(block.up(block.norm(y))))
        with pytest.raises(InputError, match="ran relu .* where its profile has gelu") as error:
            model(x)
        assert "\n" not in str(error.value)


def test_policy_refuses_offload_and_analytic_profiles() -> None:
    model, x = _build("custom")
    plan = slackswap.plan(model, x, budget=0.7, strategy="offload-only")
    assert Decision.OFFLOAD in plan.decisions.values()
    with pytest.raises(InputError, match="cannot offload in eager mode") as error:
        slackswap.checkpoint_policy(plan, model)
    assert "\n" not in str(error.value)
    analytic = slackswap.profile(model, x, mode="analytic", loss_fn=lambda out: out)
    with pytest.raises(InputError, match="cannot name the ops"):
        slackswap.checkpoint_policy(slackswap.plan(analytic, 0.7, strategy="recompute-only"),
                                    model, profile=analytic)


def test_cached_random_op_shifts_later_draws_in_torch() -> None:
    """Why the policy rebuilds every random op: PyTorch's SAC, saving one random op and
    rebuilding a later one in the same region, gives another gradient, silently."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)

    def region(x: torch.Tensor) -> torch.Tensor:
        return ((x @ w) * torch.rand(4, 16) @ w * torch.rand(4, 16)).sum()

    def save_first_rand(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        first = op is torch.ops.aten.rand.default and not save_first_rand.seen
        save_first_rand.seen |= first
        policy = torch.utils.checkpoint.CheckpointPolicy
        return policy.MUST_SAVE if first else policy.MUST_RECOMPUTE

    save_first_rand.seen = False
    torch.manual_seed(1)
    expected = torch.autograd.grad(region(x), w)[0]
    torch.manual_seed(1)
    loss = checkpoint(region, x, use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, save_first_rand))
    assert not torch.equal(torch.autograd.grad(loss, w)[0], expected)
