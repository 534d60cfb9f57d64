"""Writes autograd cannot see, and a profiled step that leaves no trace: each case
bit-identical to plain PyTorch, or refused in one line before it could differ."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import InputError, VerifyError


def _names(profile) -> list[str]:
    return [t.name for t in profile.saved_activations if t.producer is not None]


def _uniform(profile, decision: str, names) -> Plan:
    return Plan(fingerprint=profile.fingerprint, strategy=decision,
                decisions={n: decision for n in names})


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, x, plan=None, profile=None):
    """Gradients of one step, or the error it raised (type and message)."""
    model.zero_grad(set_to_none=True)
    block = slackswap.apply(model, plan, profile=profile) if plan else contextlib.nullcontext()
    try:
        with block:
            loss = model(x)
        loss.backward()
    except RuntimeError as e:
        return type(e), str(e)
    return _grads(model)


def _same(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):  # both raised, as PyTorch raises
        return isinstance(a, tuple) and isinstance(b, tuple) and a[0] is b[0]
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


class _Written(torch.nn.Module):
    """A saved sigmoid output changed after its save, in one of the ways PyTorch allows."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.c, self.b = (torch.nn.Linear(32, 64), torch.nn.Linear(64, 64),
                                  torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.c(torch.sigmoid(self.a(x)).tanh()))
        if self.how == "data":  # clamped through .data: autograd does not see it
            h.data.clamp_(0.3, 0.7)
        elif self.how == "set_":
            h.data.set_(h.data.clamp(0.3, 0.7))
        elif self.how == "numpy":  # through a NumPy view: no op at all
            h.detach().numpy()[:] *= 0.5
        elif self.how == "detach":  # autograd sees it: backward fails
            h.detach().mul_(0.5)
        elif self.how == "no_grad":
            with torch.no_grad():
                h.mul_(0.5)
        return self.b(h).square().sum()


@pytest.mark.parametrize("how", ["data", "set_", "numpy", "detach", "no_grad"])
def test_a_saved_tensor_written_after_its_save_is_never_moved(how: str) -> None:
    """The profile marks it (exact bytes for op writes, a digest for NumPy's), no planner
    moves it, a plan that does is refused in one line, and every strategy's plan gives
    plain PyTorch's gradients, or fails in backward where PyTorch fails."""
    torch.manual_seed(0)
    model, x = _Written(how), torch.randn(16, 32)
    reference = _step(model, x)
    assert isinstance(reference, tuple) == (how in ("detach", "no_grad"))
    profile = slackswap.profile(model, x, mode="traced")
    [written] = [t.name for t in profile.saved_activations if t.written_after_save]
    assert written == "(top):sigmoid:1"
    assert written not in profile.recomputable
    for decision in ("offload", "recompute"):
        with pytest.raises(InputError, match="writes in place after autograd saved it"):
            slackswap.apply(model, _uniform(profile, decision, [written]), profile=profile)
    for strategy in ("slackswap", "offload-only", "checkpoint-blocks"):
        for budget in (0.7, 0.5):
            try:
                plan = slackswap.plan(profile, budget, strategy=strategy)
            except InputError:
                continue
            assert plan.decisions.get(written, "keep") == "keep"
            assert _same(_step(model, x, plan, profile), reference), (strategy, budget)


class _WrittenOnSomeBatches(_Written):
    """``_Written``'s write after the save made only on batches whose first value is
    positive: the profiled step (a batch without it) saw no such write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.c(torch.sigmoid(self.a(x)).tanh()))
        y = self.b(h)
        if x[0, 0] > 0:
            if self.how == "data":
                h.data.clamp_(0.3, 0.7)
            elif self.how == "numpy":  # no op at all
                h.detach().numpy()[:] *= 0.5
            else:  # seen by autograd: plain PyTorch's backward raises
                h.mul_(0.5)
        return y.square().sum()


@pytest.mark.parametrize(("how", "decision"), [
    ("data", "offload"), ("numpy", "offload"), ("numpy", "recompute"), ("op", "offload"),
    ("op", "recompute")])
def test_verify_finds_a_write_after_the_save_on_a_step_the_profile_did_not_see(
        how: str, decision: str) -> None:
    """NOTE [verify reads as backward]: the plan moves the tensor (the profiled step did
    not write it); a later step writes it after the save, and ``verify=True`` says so,
    reading the storage as plain PyTorch's backward does (``VerifyError``), or raising
    autograd's own error where plain PyTorch raises it; a step that does not write it is
    verified and exact."""
    torch.manual_seed(0)
    model = _WrittenOnSomeBatches(how)
    quiet, writes = torch.randn(16, 32), torch.randn(16, 32)
    quiet[0, 0], writes[0, 0] = -1.0, 1.0
    profile = slackswap.profile(model, quiet, mode="traced")
    name = "(top):sigmoid:1"
    assert not next(t for t in profile.saved_activations if t.name == name).written_after_save
    plan = _uniform(profile, decision, [name])
    reference = _step(model, quiet)
    model.zero_grad(set_to_none=True)
    with slackswap.apply(model, plan, profile=profile, verify=True) as block:
        loss = model(quiet)
    loss.backward()
    assert block.stats.verified == 2  # its two saves: the sigmoid's output, b's input
    assert _same(_grads(model), reference)
    if how == "op":
        plain = _step(model, writes)
        assert isinstance(plain, tuple) and "modified by an inplace operation" in plain[1]
    error = (RuntimeError, "modified by an inplace operation") if how == "op" else (
        VerifyError, "no version counter sees")
    with pytest.raises(error[0], match=error[1]):
        with slackswap.apply(model, plan, profile=profile, verify=True):
            loss = model(writes)
        loss.backward()


class _Halves(torch.nn.Module):
    """Two halves of one storage, the second written after the first is saved: only the
    bytes written count, so the first half stays movable."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, v = self.lin(x).unsafe_chunk(2, -1)
        g = g.sigmoid_()
        v.data.mul_(2.0)
        return (g * v.tanh()).sum()


def test_only_the_bytes_written_after_a_save_count() -> None:
    torch.manual_seed(0)
    model, x = _Halves(), torch.randn(16, 32)
    profile = slackswap.profile(model, x, mode="traced")
    assert not any(t.written_after_save for t in profile.saved_activations)
    reference = _step(model, x)
    names = _names(profile)
    assert _same(_step(model, x, _uniform(profile, "offload", names), profile), reference)


class _Loaded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x * 2.0)).exp()).square().sum()


def test_a_batch_refilled_through_numpy_after_forward_is_refused_not_rebuilt_from() -> None:
    """A loader refills the NumPy buffer the batch shares after forward: a rebuild would
    read other values than forward did. Refused in one line, saying what to do; a batch
    of its own is exact."""
    torch.manual_seed(0)
    model, buffer = _Loaded(), np.random.randn(16, 32).astype(np.float32)
    x = torch.from_numpy(buffer)
    profile = slackswap.profile(model, x, mode="traced")
    plan = _uniform(profile, "recompute", [n for n in _names(profile)
                                           if n in profile.recomputable])
    assert plan.decisions

    def step(plan, refill):
        buffer[:] = np.linspace(-1, 1, buffer.size, dtype=np.float32).reshape(buffer.shape)
        model.zero_grad(set_to_none=True)
        with slackswap.apply(model, plan, profile=profile) if plan else contextlib.nullcontext():
            loss = model(x)
        if refill:
            buffer[:] = np.random.randn(*buffer.shape)
        loss.backward()
        return _grads(model)

    with pytest.raises(InputError, match="changed after forward.*batch of its own"):
        step(plan, refill=True)
    assert _same(step(plan, refill=False), step(None, refill=False))


class _Stateful(torch.nn.Module):
    """A forward that changes what it can: a parameter decayed in place, renormalised
    embedding rows, a batch tensor, a Python counter and list, a module's own generator,
    batch-norm statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, max_norm=1.0)
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(8)
        self.calls = 0
        self.seen: list[int] = []
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(self.calls)
        with torch.no_grad():
            self.lin.weight.mul_(0.99)
        x.mul_(2)
        noise = torch.rand(1, generator=self.gen) * self.calls
        h = self.norm(self.emb(ids) + x + noise)
        return torch.nn.functional.dropout(self.lin(h).tanh(), 0.1).square().sum()


def _state(model: _Stateful, batch: dict) -> list:
    return [*(t.clone() for t in model.state_dict().values()), model.calls, list(model.seen),
            model.gen.get_state(), torch.get_rng_state(), *(t.clone() for t in batch.values())]


@pytest.mark.parametrize("how", ["analytic", "traced", "plan", "attach"])
def test_profiling_leaves_the_model_the_batch_and_the_rng_as_they_were(how: str) -> None:
    torch.manual_seed(0)
    model = _Stateful()
    batch = {"ids": torch.randint(0, 50, (4, 8)), "x": torch.randn(4, 8, 16)}
    twin, twin_batch = copy.deepcopy(model), copy.deepcopy(batch)
    before = _state(model, batch)
    if how == "attach":
        with slackswap.attach(model, budget=1.0):
            model(**batch).backward()
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(before[-3])
        twin(**twin_batch).backward()
        twin.zero_grad(set_to_none=True)
        # one training step each: the same state after it
        for a, b in zip(_state(model, batch), _state(twin, twin_batch), strict=True):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        return
    if how == "plan":
        slackswap.plan(model, batch, 1.0)
    else:
        slackswap.profile(model, batch, mode=how)
    after = _state(model, batch)
    for a, b in zip(before, after, strict=True):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)


class _ReturnsHidden(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 100)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.a(x)
        loss = torch.nn.functional.cross_entropy(self.b(torch.tanh(h)), y)
        return loss, h


def test_a_tensor_the_caller_changes_after_the_block_is_rebuilt_not_read() -> None:
    """``h``, which autograd does not save, is what rebuilds read; the caller changes it
    in place after the block and before backward. A rebuild makes it again (its version
    is not the one forward left), so the gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = _ReturnsHidden()
    x, y = torch.randn(512, 64), torch.randint(0, 100, (512,))
    profile = slackswap.profile(model, (x, y), mode="traced", loss_fn=lambda o: o[0])
    plan = _uniform(profile, "recompute", [n for n in _names(profile)
                                           if n in profile.recomputable])
    assert "(top):tanh:0" in plan.decisions

    def step(plan):
        model.zero_grad(set_to_none=True)
        with slackswap.apply(model, plan, profile=profile) if plan else contextlib.nullcontext():
            loss, h = model(x, y)
        h.add_(1)
        loss.backward()
        return _grads(model)

    assert _same(step(plan), step(None))


class _LazyCache(torch.nn.Module):
    """Makes a cache on its first call, a length and the tensor it covers together."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cached_len") or self.cached_len < x.shape[0]:
            self.cached_len = x.shape[0]
            self.cache = torch.arange(x.shape[0], dtype=x.dtype)
        return (self.lin(x) * self.cache[: x.shape[0], None]).tanh().sum()


def test_a_cache_the_profiled_step_made_goes_with_it() -> None:
    """Both halves of a cache the profiled step made are removed, never one alone, so
    the next call makes it again as plain PyTorch's first call does."""
    torch.manual_seed(0)
    model, x = _LazyCache(), torch.randn(4, 8)
    slackswap.profile(model, x, mode="traced")
    assert not hasattr(model, "cached_len") and not hasattr(model, "cache")
    model(x).backward()
    assert model.cached_len == 4


class _HooksOnFirstCall(torch.nn.Module):
    """Registers a forward hook on each block on its first call and marks itself hooked,
    as transformers' ``capture_outputs`` does; the hooks collect the blocks' outputs,
    which the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.outputs: list[torch.Tensor] = []

    def _collect(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.outputs.append(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_hooked", False):
            for block in self.blocks:
                block.register_forward_hook(self._collect)
            self._hooked = True
        for block in self.blocks:
            x = block(x).tanh()
        loss = sum(o.square().mean() for o in self.outputs)
        self.outputs.clear()
        return loss


def _hooks_on_first_call():
    torch.manual_seed(0)
    return _HooksOnFirstCall(), torch.randn(64, 16), None


def _segformer():
    import zoo

    return zoo.segformer()


def _loss_of(model, batch, loss_fn):
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    return loss_fn(out) if loss_fn else getattr(out, "loss", out)


@pytest.mark.parametrize("build", [_hooks_on_first_call, _segformer])
def test_hooks_the_profiled_step_registered_go_with_its_flags(build) -> None:
    """The profiled step registers hooks and sets the flag that says so: both are
    undone, never the flag alone (the next call would register every hook twice). So
    ``slackswap.plan(model, batch)`` then training that model, under the plan or not,
    is plain PyTorch's training bit for bit."""
    model, batch, loss_fn = build()
    twin = copy.deepcopy(model)
    hooks = [len(m._forward_hooks) for m in model.modules()]
    plan = slackswap.plan(model, batch, 0.85, loss_fn=loss_fn)
    assert [len(m._forward_hooks) for m in model.modules()] == hooks
    for under_plan in (False, True):
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            with slackswap.apply(model, plan) if under_plan and m is model \
                    else contextlib.nullcontext():
                loss = _loss_of(m, batch, loss_fn)
            loss.backward()
        assert _same(_grads(model), _grads(twin))
