"""Training patterns beside the model, each bit-identical to plain PyTorch over steps with
an optimizer step between them, or refused in one line: sparse gradients, intermediate
gradients read after backward, module backward hooks, backward to some inputs only, and
several forwards, each in its own block, before one backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import slackswap
from slackswap.core.plan import Plan

Step = Callable[[nn.Module, torch.Tensor, Callable[[], Any]], dict[str, torch.Tensor]]


class _Net(nn.Module):
    """Token ids through an embedding (``sparse=True`` gives sparse gradients), GELU
    blocks, and a head; the middle activation is kept on the module for the pattern."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32, sparse=sparse)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32))
                                    for _ in range(4))
        self.head = nn.Linear(32, 100)
        self.mid: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for i, block in enumerate(self.blocks):
            h = h + block(h)
            if i == 1:
                self.mid = h
        return F.cross_entropy(self.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _model(sparse: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return _Net(sparse).train()


def _ids(rows: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (rows, 12), generator=torch.Generator().manual_seed(1))


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    if p.grad is None:
        return None
    return p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad.clone()


def _train(model: nn.Module, ids: torch.Tensor, step: Step, plan: Plan | None = None,
           steps: int = 3) -> list[dict[str, torch.Tensor | None]]:
    """What each step leaves (its tensors, every parameter's gradient), SGD between."""
    block = slackswap.apply(model, plan) if plan is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(steps):
        torch.manual_seed(i)
        got = step(model, ids, lambda: block if block is not None else contextlib.nullcontext())
        got.update({n: _grad(p) for n, p in model.named_parameters()})
        out.append({k: None if v is None else v.detach().clone() for k, v in got.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _assert_identical(got: list[dict], want: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys()
        for k in b:
            assert (a[k] is None) == (b[k] is None), (step, k)
            assert b[k] is None or torch.equal(a[k], b[k]), (step, k)


def _uniform(model: nn.Module, ids: torch.Tensor, decision: str) -> Plan:
    """Every saved activation offloaded, or every one that replays recomputed."""
    profile = slackswap.profile(model, ids, mode="traced")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={
        t.name: decision for t in profile.saved_activations if t.producer is not None
        and (decision == "offload" or t.name in profile.recomputable)})
    plan._profile = profile
    return plan


def _plain(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any]) -> dict:
    with block():
        loss = model(ids)
    loss.backward()
    return {"loss": loss}


@pytest.mark.parametrize("strategy", ["slackswap", "offload-only"])
def test_sparse_embedding_gradients(strategy: str) -> None:
    """``nn.Embedding(sparse=True)``: its gradient is a sparse tensor, which has no
    storage of its own. Profiling marked weight gradients by their storage and raised
    NotImplementedError from inside backward before any plan was made."""
    want = _train(_model(sparse=True), _ids(), _plain)
    model = _model(sparse=True)
    plan = slackswap.plan(model, _ids(), budget=0.5, hardware="a100-80gb", strategy=strategy)
    assert any(d != "keep" for d in plan.decisions.values())
    got = _train(model, _ids(), _plain, plan)
    _assert_identical(got, want)


def _retain_grad(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any]) -> dict:
    with block():
        loss = model(ids)
        mid = model.mid
        mid.retain_grad()
    loss.backward()
    model.mid = None
    return {"loss": loss, "mid.grad": mid.grad}


def _partial(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any]) -> dict:
    with block():
        loss = model(ids)
    loss.backward(inputs=[model.blocks[0][0].weight, model.head.bias])
    return {"loss": loss}


def _micro_batches(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any]) -> dict:
    """Two micro-batches, each forward in its own block, one backward of their sum."""
    losses = []
    for part in (ids, ids.flip(0)):
        with block():
            losses.append(model(part))
    (losses[0] + losses[1] / 2).backward()
    return {"loss": losses[0], "second loss": losses[1]}


def _hooked(model: nn.Module) -> nn.Module:
    """Module backward hooks that scale, clamp and record the gradients they see."""
    model.seen = []
    model.blocks[0].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    model.blocks[2].register_full_backward_pre_hook(lambda m, go: (go[0].clamp(-1e-3, 1e-3),))
    model.blocks[1][0].register_full_backward_hook(
        lambda m, gi, go: model.seen.append(go[0].clone()))
    return model


def _recorded(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any]) -> dict:
    model.seen.clear()
    out = _plain(model, ids, block)
    return {**out, **{f"seen {i}": g for i, g in enumerate(model.seen)}}


PATTERNS: dict[str, tuple[Callable[[], nn.Module], Step]] = {
    "retain_grad": (_model, _retain_grad),
    "backward(inputs=)": (_model, _partial),
    "micro-batches": (_model, _micro_batches),
    "module backward hooks": (lambda: _hooked(_model()), _recorded),
}


@pytest.mark.parametrize("decision", ["offload", "recompute"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_patterns_every_activation_moved(pattern: str, decision: str) -> None:
    make, step = PATTERNS[pattern]
    want = _train(make(), _ids(), step)
    assert want[0]["loss"] is not None
    model = make()
    plan = _uniform(model, _ids(), decision)
    assert sum(d == decision for d in plan.decisions.values()) >= 10
    _assert_identical(_train(model, _ids(), step, plan), want)


class _Normed(nn.Module):
    """A model with running statistics, whose loss is computed after it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(32, 256), nn.BatchNorm1d(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x))


def _loss_network(out: torch.Tensor) -> torch.Tensor:
    """A loss of many ops after the model (as a perceptual loss is): plans move what it
    saves."""
    h = out
    for _ in range(6):
        h = torch.tanh(h * 1.1) + torch.sigmoid(h)
    return h.square().mean()


def _normed() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Normed().train(), torch.randn(128, 32, generator=torch.Generator().manual_seed(1))


def _loss_after_the_model(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[dict]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        loss = _loss_network(model(x))
        loss.backward()
        out.append({"loss": loss.detach(), **{n: p.grad.clone()
                                              for n, p in model.named_parameters()}})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


class _Deep(nn.Module):
    """An MLP whose loss (``_loss_network``) is computed after it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 512),
                                  nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                                  nn.Linear(512, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_attach_with_a_loss_fn_whose_saves_the_plan_moves() -> None:
    """attach's block covers the model's call, and a ``loss_fn`` runs after it: the plan
    leaves what only the loss saves as autograd saved it (``StepProfile.out_of_reach``),
    and training is plain PyTorch's. At 60% the plan moved one of the loss's saves,
    and every step was refused as the model returned."""

    def deep() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        return _Deep(), torch.randn(128, 32, generator=torch.Generator().manual_seed(1))

    want = _loss_after_the_model(*deep())
    model, x = deep()
    with slackswap.attach(model, budget=0.6, hardware="a100-80gb",
                          loss_fn=_loss_network) as attached:
        got = _loss_after_the_model(model, x)
    _assert_identical(got, want)
    (plan,) = attached.plans.values()
    moved = {n for n, d in plan.decisions.items() if d != "keep"}
    assert moved and not any(n.startswith("(top)") for n in moved), moved


def test_a_loss_after_the_block_is_refused_before_it_changes_the_model() -> None:
    """A plan that moves what the loss saves, the loss computed after the block: refused
    as the block closes, with the BatchNorm statistics and the RNG put back (it was
    refused in backward, saying the plan was made for another model, the forward's
    changes left in place)."""
    model, x = _normed()
    plan = slackswap.plan(model, x, budget=0.5, hardware="a100-80gb", loss_fn=_loss_network)
    assert any(n.startswith("(top)") and d != "keep" for n, d in plan.decisions.items())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(slackswap.InputError, match="runs after the block"), \
            slackswap.apply(model, plan):
        model(x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    with slackswap.apply(model, plan):  # the loss inside the block: the plan runs
        loss = _loss_network(model(x))
    loss.backward()
    got = [{"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}]
    _assert_identical(got, _loss_after_the_model(_normed()[0], x, steps=1))


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_step_inside_a_torch_func_transform_is_refused_in_one_line(transform: str) -> None:
    """``torch.func.grad`` (or ``vmap``) over ``functional_call`` of an attached model, or
    around an ``apply`` block: one ``InputError`` line, the model, its gradients and the
    RNG untouched; outside the transform the attached model trains as plain PyTorch. It
    raised PyTorch's multi-line error from inside the runtime (``requires_grad_()`` inside
    a transform while copying the batch to plan it; saved-tensor hooks pushed under
    ``grad``)."""
    model, ids = _model(), _ids()
    params = dict(model.named_parameters())

    def loss_of(p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    def run() -> Any:
        if transform == "grad":
            return torch.func.grad(loss_of)(params, ids)
        return torch.func.vmap(loss_of, in_dims=(None, 0))(params, ids[:, None])

    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with slackswap.attach(model, budget=0.5, hardware="a100-80gb") as attached:
        with pytest.raises(slackswap.InputError, match="inside a torch.func transform"):
            run()
        assert not attached.plans
        plan = slackswap.plan(_model(), ids, budget=0.5, hardware="a100-80gb")
    with pytest.raises(slackswap.InputError, match="^slackswap.apply: the step runs inside"):
        torch.func.grad(lambda p: _in_block(model, plan, p, ids))(params)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    step = _plain_step
    want = _train(_model(), ids, step)
    with slackswap.attach(model, budget=0.5, hardware="a100-80gb"):
        _assert_identical(_train(model, ids, step), want)


def _in_block(model: nn.Module, plan: Plan, params: dict, ids: torch.Tensor) -> torch.Tensor:
    with slackswap.apply(model, plan):
        return torch.func.functional_call(model, params, (ids,))


def _plain_step(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any],
                ) -> dict[str, torch.Tensor]:
    loss = model(ids)
    loss.backward()
    return {"loss": loss}


class _Skipping(_Net):
    """``_Net`` whose forward passes over the block a flag names (set between steps)."""

    skip: int | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                h = F.dropout(h + block(h), 0.1)
        return F.cross_entropy(self.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("budget", [0.8, 0.6])
def test_a_block_skipped_by_a_flag_runs_off_the_path_exactly(budget: float) -> None:
    """A flag set after planning skips a block shaped as the next one: the next block's
    saves come under the skipped one's names, with no recipe (their ops ran where the
    watch was dark). The step runs again as plain PyTorch (``stats.off_path``),
    gradients bit-identical; it was refused as a plan recomputing an op that cannot
    replay ("an in-place write it cannot see")."""

    def skipping() -> nn.Module:
        torch.manual_seed(0)
        return _Skipping().train()

    def flagged(model: nn.Module, ids: torch.Tensor, block: Callable[[], Any],
                ) -> dict[str, torch.Tensor]:
        model.skip = 1
        with block():
            loss = model(ids)
        loss.backward()
        return {"loss": loss}

    ids = _ids()
    want = _train(skipping(), ids, flagged)
    model = skipping()
    plan = slackswap.plan(model, ids, budget=budget, hardware="a100-80gb",
                          strategy="recompute-only")
    assert any(d == "recompute" for d in plan.decisions.values())
    with pytest.warns(slackswap.PathNotice):
        _assert_identical(_train(model, ids, flagged, plan), want)
    model.skip = None
    with slackswap.attach(skipping(), budget=budget, hardware="a100-80gb",
                          strategy="recompute-only") as attached:
        attached.model(ids).backward()  # planned on the full path, then the flag is set
        attached.model.zero_grad(set_to_none=True)
        with pytest.warns(slackswap.PathNotice):
            _assert_identical(_train(attached.model, ids, flagged), want)
    assert attached.stats.off_path
