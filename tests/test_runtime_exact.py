"""Exact or loud: each defect of issue 9 as a small model, bit-identical or refused."""

from __future__ import annotations

import contextlib
import gc
import re
import threading
import warnings

import pytest
import torch

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import InputError, PathNotice, VerifyError
from slackswap.runtime import block


def _names(profile) -> list[str]:
    return [t.name for t in profile.saved_activations if t.producer is not None]


def _step(model, batch, plan=None, profile=None, loss_fn=None, verify=False, seed=1):
    """Loss, gradients and buffers of one step, with or without a plan."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    if not hasattr(model, "_initial_buffers"):  # each step starts from the same statistics
        model._initial_buffers = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(model._initial_buffers[n])
    runtime = slackswap.apply(model, plan, profile=profile, verify=verify) if plan else None
    with runtime or contextlib.nullcontext():
        out = model(batch)
        loss = loss_fn(out) if loss_fn else out
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers, runtime


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


def _uniform(profile, decision: str, names=None) -> Plan:
    names = _names(profile) if names is None else names
    return Plan(fingerprint=profile.fingerprint, strategy=decision,
                decisions={n: decision for n in names})


def _check_all(model, x, decisions=("offload", "recompute"), loss_fn=None) -> None:
    profile = slackswap.profile(model, x, kernels="native", loss_fn=loss_fn)
    reference = _step(model, x, loss_fn=loss_fn)
    for decision in decisions:
        names = _names(profile)
        if decision == "recompute":
            names = [n for n in names if n in profile.recomputable]
        planned = _step(model, x, _uniform(profile, decision, names), profile,
                        loss_fn=loss_fn, verify=True)
        _assert_same(planned, reference)
        assert planned[3].stats.verified > 0


class _SavedTwice(torch.nn.Module):
    """One storage saved by two in-place ops, changed between the saves."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, v = self.lin(x).unsafe_chunk(2, -1)
        g = g.sigmoid_()
        v = v.tanh_()
        return (g * v).sum()


def test_a_storage_saved_at_two_versions_comes_back_at_each() -> None:
    torch.manual_seed(0)
    _check_all(_SavedTwice(), torch.randn(16, 32))


class _Recurrent(torch.nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        self.rnn = getattr(torch.nn, cell)(16, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0]).square().mean()


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_recurrent_nets_are_exact_under_every_strategy(cell: str) -> None:
    """The CPU GRU saves one storage twice around in-place ops; the LSTM kernel is not
    replayable (outputs and workspace depend on grad mode), so it is never recomputed."""
    torch.manual_seed(0)
    model, x = _Recurrent(cell), torch.randn(4, 12, 16)
    _check_all(model, x)
    profile = slackswap.profile(model, x, kernels="native")
    reference = _step(model, x)
    for strategy in ("slackswap", "offload-only", "recompute-only"):
        try:
            plan = slackswap.plan(profile, 0.6, strategy=strategy)
        except InputError:
            continue
        _assert_same(_step(model, x, plan, profile, verify=True), reference)


class _SortedExp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sort(self.lin(x), dim=-1).values.exp().square().sum()


def test_recomputing_what_reads_an_op_that_cannot_replay_is_refused_and_says_why() -> None:
    """exp replays bit for bit, but its input, which autograd never saves, comes from
    sort, which is not known to: recomputing exp's output is refused before the model
    runs, saying that its input cannot be rebuilt; offloading it is exact."""
    torch.manual_seed(0)
    model, x = _SortedExp(), torch.randn(8, 16)
    profile = slackswap.profile(model, x, kernels="native")
    [exp] = [n for n in _names(profile) if ":exp:" in n]
    assert exp not in profile.recomputable
    with pytest.raises(InputError, match=f"cannot recompute '{re.escape(exp)}': its rebuild "
                                         "reads an input that cannot itself be rebuilt"):
        slackswap.apply(model, _uniform(profile, "recompute", [exp]), profile=profile)
    _assert_same(_step(model, x, _uniform(profile, "offload", [exp]), profile, verify=True),
                 _step(model, x))


class _NearestCode(torch.nn.Module):
    """A vector quantizer's lookup: ``cdist`` saves its output for a backward that never
    runs (``argmin`` cuts the graph), so that output is let go of in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.codes = torch.nn.Parameter(torch.randn(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        index = torch.cdist(h, self.codes).argmin(-1)
        q = torch.nn.functional.embedding(index, self.codes)
        return (h + (q - h).detach()).square().sum() + (q - h.detach()).square().sum()


def test_recomputing_from_a_saved_tensor_that_backward_never_reads_is_refused_up_front(
        ) -> None:
    """argmin's output (saved by the embedding) replays bit for bit, but its input, the
    distances, is saved only for a backward that never runs: gone after forward, a rebuild
    would make it again by ``_euclidean_dist``, which is not known to replay. Recomputing
    argmin is refused before the model runs (it was allowed, and failed in backward)."""
    torch.manual_seed(0)
    model, x = _NearestCode(), torch.randn(512, 16)
    profile = slackswap.profile(model, x, kernels="native")
    [argmin] = [n for n in _names(profile) if ":argmin:" in n]
    assert argmin not in profile.recomputable
    with pytest.raises(InputError, match=f"cannot recompute '{re.escape(argmin)}'"):
        slackswap.apply(model, _uniform(profile, "recompute", [argmin]), profile=profile)
    _assert_same(_step(model, x, _uniform(profile, "offload", [argmin]), profile, verify=True),
                 _step(model, x))


def test_recomputing_a_kernel_that_cannot_replay_is_refused_up_front() -> None:
    torch.manual_seed(0)
    model, x = _Recurrent("LSTM"), torch.randn(4, 12, 16)
    profile = slackswap.profile(model, x, kernels="native")
    [lstm] = [n for n in _names(profile) if "mkldnn_rnn_layer" in n][:1]
    assert lstm not in profile.recomputable
    with pytest.raises(InputError, match="cannot recompute .*mkldnn_rnn_layer"):
        slackswap.apply(model, _uniform(profile, "recompute", [lstm]), profile=profile)
    with pytest.raises(InputError, match="cannot recompute"):  # without the profile: at save
        _step(model, x, _uniform(profile, "recompute", [lstm]))
    for strategy in ("recompute-only", "slackswap", "capuchin"):
        with contextlib.suppress(InputError):
            plan = slackswap.plan(profile, 0.5, strategy=strategy)
            assert all(plan.decisions.get(n) != "recompute" for n in _names(profile)
                       if n not in profile.recomputable)


class _InPlaceCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.act = torch.nn.Hardswish(inplace=True)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv1(x)))
        return self.relu(self.conv2(h)).mean()


def test_recompute_through_in_place_activations_is_exact() -> None:
    """Once refused by an in-place check; rebuilding each value at its version is exact."""
    torch.manual_seed(0)
    model, x = _InPlaceCNN(), torch.randn(2, 3, 16, 16)
    profile = slackswap.profile(model, x, kernels="native")
    assert set(_names(profile)) <= profile.recomputable
    _check_all(model, x)


class _Complex(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(self.lin(x).view(x.shape[0], 16, 2))
        return torch.view_as_real(z * z.conj() * z).square().sum()


def test_conjugate_views_survive_offload_and_recompute() -> None:
    torch.manual_seed(0)
    _check_all(_Complex(), torch.randn(8, 16))


class _Shifted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("shift", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x) + self.shift)
        with torch.no_grad():
            self.shift.add_(1.0)  # a running statistic, updated after it was read
        return (h * h).sum()


def test_an_outside_tensor_changed_in_forward_is_read_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = _Shifted(), torch.randn(8, 16)
    profile = slackswap.profile(model, x, kernels="native")
    plan = _uniform(profile, "recompute")
    reference = _step(model, x)
    model.shift.zero_()
    planned = _step(model, x, plan, profile, verify=True)
    model.shift.zero_()
    again = _step(model, x)
    _assert_same(planned, again)
    assert torch.equal(reference[0], again[0])


def test_a_batch_tensor_changed_before_backward_stops_a_rebuild() -> None:
    torch.manual_seed(0)
    model, x = _InPlaceCNN(), torch.randn(2, 3, 16, 16)
    profile = slackswap.profile(model, x, kernels="native")
    with slackswap.apply(model, _uniform(profile, "recompute"), profile=profile):
        loss = model(x)
    x.mul_(2.0)  # the batch, changed in place after forward read it
    with pytest.raises(InputError, match="changed in place after forward read it"):
        loss.backward()


class _Sparse(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.lin(x))
        s = (a * (a > 0.5)).to_sparse()
        return torch.sparse.mm(s, self.lin.weight).square().sum()


def test_sparse_saved_tensors_are_kept() -> None:
    torch.manual_seed(0)
    model, x = _Sparse(), torch.randn(8, 16)
    profile = slackswap.profile(model, x, kernels="native")
    reference = _step(model, x)
    for decision in ("keep", "offload", "recompute"):
        names = [n for n in _names(profile)
                 if decision != "recompute" or n in profile.recomputable]
        _assert_same(_step(model, x, _uniform(profile, decision, names), profile), reference)


class _OwnCheckpoint(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.lin(t)), x,
                                              use_reentrant=self.reentrant)
        return h.square().sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_that_checkpoints_itself_is_refused(reentrant: bool) -> None:
    model, x = _OwnCheckpoint(reentrant), torch.randn(8, 16, requires_grad=reentrant)
    with pytest.raises(InputError, match="torch.utils.checkpoint"):
        slackswap.profile(model, x, kernels="native")
    from slackswap.profiling.step import fingerprint

    plan = Plan(fingerprint=fingerprint(model, x), strategy="x", decisions={})
    with pytest.raises(InputError, match="torch.utils.checkpoint"), \
            slackswap.apply(model, plan):
        model(x)
    assert gc.isenabled()
    torch.utils.checkpoint.checkpoint(torch.tanh, x, use_reentrant=False)  # restored


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_one_call_planning_takes_a_loss_over_real_targets() -> None:
    torch.manual_seed(0)
    model, x, target = _Plain(), torch.randn(8, 16), torch.randn(8, 16)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target)

    plan = slackswap.plan(model, x, budget=1.0, loss_fn=loss_fn)
    _assert_same(_step(model, x, plan, loss_fn=loss_fn), _step(model, x, loss_fn=loss_fn))


def test_a_forward_that_returns_its_loss_needs_no_loss_fn() -> None:
    model, x = _SavedTwice(), torch.randn(16, 32)
    profile = slackswap.profile(model, x, kernels="native")
    assert profile.saved_activations


def test_apply_blocks_do_not_nest_and_leave_nothing_behind() -> None:
    torch.manual_seed(0)
    model, x = _InPlaceCNN(), torch.randn(2, 3, 16, 16)
    profile = slackswap.profile(model, x, kernels="native")
    plan = _uniform(profile, "offload")
    reference = _step(model, x)
    outer = slackswap.apply(model, plan)
    for inner in (outer, slackswap.apply(model, plan)):
        with pytest.raises(InputError, match="do not nest"), outer, inner:
            pass
    for interrupt in (RuntimeError("inside"), KeyboardInterrupt()):
        with pytest.raises(type(interrupt)), slackswap.apply(model, plan):
            model(x)
            raise interrupt
    assert gc.isenabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    assert not model._forward_pre_hooks
    _assert_same(_step(model, x), reference)  # plain steps run as before
    _assert_same(_step(model, x, plan), reference)


def test_a_second_threads_block_is_refused_while_one_is_open() -> None:
    """Issue 50, item 9 (NOTE [one thread at a time]): the runtime's module hooks,
    checkpoint guard and replayed RNG state are process-wide, so while one thread's block
    is open another thread's is refused in one line, leaving both models as they were;
    blocks opened one after another, in any threads, are bit-identical to plain steps."""
    torch.manual_seed(0)
    models, x = [_InPlaceCNN(), _InPlaceCNN()], torch.randn(2, 3, 16, 16)
    profile = slackswap.profile(models[0], x, kernels="native")
    plans = [_uniform(profile, "offload"), _uniform(profile, "recompute")]
    references = [_step(m, x) for m in models]
    inside, tried = threading.Event(), threading.Event()

    def wait_inside(*_):
        inside.set()
        assert tried.wait(60)

    hook = models[0].register_forward_pre_hook(wait_inside)
    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["first"] = _step(models[0], x, plans[0])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            results["first"] = e
        finally:
            inside.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(60)
        with pytest.raises(InputError) as info:
            _step(models[1], x, plans[1])
        assert str(info.value).startswith("slackswap.apply runs one thread's block at a "
                                          "time: another thread's block is open")
        assert "\n" not in str(info.value)
        assert not models[1]._forward_pre_hooks and not models[1]._forward_hooks
    finally:
        tried.set()
        thread.join(60)
    hook.remove()
    assert not isinstance(results["first"], BaseException), results["first"]
    _assert_same(results["first"], references[0])
    assert not block._ACTIVE

    def later(i: int) -> None:
        results[i] = _step(models[i], x, plans[i])

    for i in (1, 0):  # a block in each thread, one after the other
        thread = threading.Thread(target=later, args=(i,))
        thread.start()
        thread.join(60)
        _assert_same(results[i], references[i])
    _assert_same(_step(models[1], x, plans[1]), references[1])  # and in this thread


def test_a_plan_for_all_trainable_parameters_refuses_a_frozen_model() -> None:
    model, x = _InPlaceCNN(), torch.randn(2, 3, 16, 16)
    plan = slackswap.plan(model, x, budget=1.0)
    model.conv1.weight.requires_grad_(False)
    with pytest.raises(InputError, match="which parameters train"):
        slackswap.apply(model, plan, batch=x)


def test_verify_catches_a_reload_that_differs(monkeypatch) -> None:
    from slackswap.runtime.copies import HostCopies
    from slackswap.runtime.streams import bytes_of

    torch.manual_seed(0)
    model, x = _InPlaceCNN(), torch.randn(2, 3, 16, 16)
    profile = slackswap.profile(model, x, kernels="native")
    reload = HostCopies.reload

    def corrupt(self, host, device):
        out = reload(self, host, device)
        bytes_of(out)[:4] ^= 1  # one flipped bit
        return out

    monkeypatch.setattr(HostCopies, "reload", corrupt)
    with pytest.raises(VerifyError, match="differs from the original as backward reads it"):
        _step(model, x, _uniform(profile, "offload"), profile, verify=True)


class _GradInForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        (g,) = torch.autograd.grad(torch.tanh(h).pow(3).sum(), h, create_graph=True)
        return (g * self.b(h)).square().mean()


def test_backward_inside_forward_is_refused() -> None:
    """A plan covers one forward pass, then one backward; autograd.grad inside forward
    unpacks saved tensors before forward ends, so it is refused, not half-planned."""
    from slackswap.profiling.step import fingerprint

    model, x = _GradInForward(), torch.randn(32, 64)
    with pytest.raises(InputError, match="backward inside its forward"):
        slackswap.profile(model, x, kernels="native")
    plan = Plan(fingerprint=fingerprint(model, x), strategy="x", decisions={})
    with pytest.raises(InputError, match="backward inside its forward"), \
            slackswap.apply(model, plan):
        model(x)


class _ShiftedThroughData(_Shifted):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x) + self.shift)
        self.shift.data.add_(1.0)  # through .data: the version counter does not move
        return (h * h).sum()


def test_an_outside_tensor_changed_through_data_is_read_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = _ShiftedThroughData(), torch.randn(8, 16)
    profile = slackswap.profile(model, x, kernels="native")
    model.shift.zero_()
    planned = _step(model, x, _uniform(profile, "recompute"), profile, verify=True)
    model.shift.zero_()
    _assert_same(planned, _step(model, x))


class _LogitsAndHidden(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 100)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.b(torch.tanh(h)), h


def test_backward_inside_the_block_after_a_loss_whose_logsumexp_is_recomputed() -> None:
    """The docstring lets backward run inside the block. Past the traced step's forward
    (model and loss), ``loss.backward()`` makes its gradient seed and the loop may write
    in place: not ops of the step, so no longer refused as a path the profile does not
    have (NOTE [after the step's forward]); a write there to a tensor a rebuild reads
    still counts, so the rebuild reads the value it was made with."""
    torch.manual_seed(0)
    model, x = _LogitsAndHidden(), torch.randn(512, 64)
    target = torch.randint(0, 100, (512,))

    def loss_fn(out):  # a loss over logsumexp, computed in the block, outside the model
        logits = out[0]
        return (torch.logsumexp(logits, -1) - logits.gather(1, target[:, None])[:, 0]).mean()

    profile = slackswap.profile(model, x, mode="traced", loss_fn=loss_fn)
    assert "(top):logsumexp:0" in profile.recomputable
    plan = _uniform(profile, "recompute", [n for n in _names(profile)
                                           if n in profile.recomputable])

    def step(runtime=None):
        model.zero_grad(set_to_none=True)
        with runtime or contextlib.nullcontext():
            out = model(x)
            loss = loss_fn(out)
            out[1].mul_(2.0)  # read by the rebuild of tanh's output: made again
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, {}

    reference = step()
    runtime = slackswap.apply(model, plan, profile=profile, verify=True)
    _assert_same(step(runtime), reference)
    assert runtime.stats.recomputed_ops > 0 and runtime.stats.verified > 0


class _LayerDrop(torch.nn.Module):
    """BatchNorm, dropout, and a middle layer run or skipped by a random draw."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn1 = torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)
        self.l2, self.bn2 = torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)
        self.l3, self.drop = torch.nn.Linear(64, 64), torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.bn1(self.l1(x))))
        if torch.rand(()) > 0.5:
            h = h + torch.tanh(self.bn2(self.l2(h)))
        return self.l3(h).pow(2).mean()


def _path(model: torch.nn.Module, x: torch.Tensor, seed: int) -> bool:
    """Whether plain PyTorch runs the middle layer under ``seed`` (state left as it was)."""
    import copy

    torch.manual_seed(seed)
    ran = []
    twin = copy.deepcopy(model)
    twin.bn2.register_forward_hook(lambda *_: ran.append(True))
    twin(x)
    return bool(ran)


@pytest.mark.parametrize(("decision", "ran"), [("recompute", False), ("recompute", True),
                                               ("offload", True)])
def test_a_step_off_the_profiled_path_runs_as_plain_pytorch(decision: str, ran: bool) -> None:
    """NOTE [a step off the profiled path]: a LayerDrop-style skip drawn otherwise than in
    the profiled step (which ``ran`` the middle layer or not) is found half way through
    forward (a watched op or a save that differs), or as the model returns having saved
    less or more (a layer skipped or run whose saves matched the next one's, where no
    watched op tells), after BatchNorm updated its running statistics and dropout and the skip drew
    from the RNG; the step runs again as plain PyTorch from the state the model was
    called in, so its loss, gradients, statistics and the RNG after it are plain
    PyTorch's; said once per plan."""
    torch.manual_seed(0)
    model, x = _LayerDrop().train(), torch.randn(256, 64)
    torch.manual_seed(next(s for s in range(100, 150) if _path(model, x, s) == ran))
    profile = slackswap.profile(model, x, mode="traced")
    assert any(op.module == "bn2" for op in profile.ops) == ran
    other = next(s for s in range(2, 50) if _path(model, x, s) != ran)
    same = next(s for s in range(2, 50) if _path(model, x, s) == ran)
    plan = _uniform(profile, decision, [n for n in _names(profile)
                                        if decision == "offload" or n in profile.recomputable])
    with pytest.warns(PathNotice, match="different code path than in the profiled step"):
        planned = _step(model, x, plan, profile, seed=other)
    rng = torch.get_rng_state()
    _assert_same(planned, _step(model, x, seed=other))
    assert torch.equal(rng, torch.get_rng_state())
    assert planned[3].stats.off_path and planned[3].stats.recomputed_ops == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for seed in (other, same):  # the path the profile took runs with the plan
            planned = _step(model, x, plan, profile, seed=seed, verify=True)
            _assert_same(planned, _step(model, x, seed=seed))
            assert planned[3].stats.off_path == (seed == other)
    assert planned[3].stats.recomputed_ops + planned[3].stats.offloaded_bytes > 0


def test_a_refusal_in_forward_puts_back_buffers_and_the_rng() -> None:
    """A step refused half way through forward (here under another autocast than its
    plan's), after BatchNorm updated its running statistics, puts them back and the RNG
    (NOTE [refusals leave no trace]), so the loop can go on as if the call had not been
    made."""
    torch.manual_seed(0)
    model, x = _LayerDrop().train(), torch.randn(256, 64)
    torch.manual_seed(1)
    profile = slackswap.profile(model, x, mode="traced")
    plan = _uniform(profile, "offload")

    def refused() -> None:
        with pytest.raises(InputError, match="autocast"), \
                slackswap.apply(model, plan, profile=profile), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)

    for outer in (False, True):  # called in an except block too
        torch.manual_seed(2)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        rng = torch.get_rng_state()
        if outer:
            try:
                raise ValueError("handled")
            except ValueError:
                refused()
        else:
            refused()
        assert torch.equal(torch.get_rng_state(), rng)
        for name, b in model.named_buffers():
            assert torch.equal(b, buffers[name]), name


def test_a_path_change_after_the_model_returned_is_refused_saying_so() -> None:
    """A loss that branches on a draw, computed in the block after the model returned:
    the step cannot run again from inside the model's call, so it is refused in one line
    that names the code path and what to do, with the model's buffers and the RNG put
    back (NOTE [a step off the profiled path], NOTE [refusals leave no trace])."""
    torch.manual_seed(0)
    model, x = _LayerDrop().train(), torch.randn(256, 64)
    model.forward = lambda h: torch.tanh(model.bn1(model.l1(h)))  # its first layer only

    def loss_fn(h: torch.Tensor) -> torch.Tensor:
        wide = torch.cat([h, h], 1) if torch.rand(()) > 0.5 else h
        return wide.pow(2).mean()

    def wide(seed: int) -> bool:
        torch.manual_seed(seed)
        return bool(torch.rand(()) > 0.5)

    torch.manual_seed(1)
    profile = slackswap.profile(model, x, mode="traced", loss_fn=loss_fn)
    other = next(s for s in range(2, 50) if wide(s) != wide(1))
    plan = _uniform(profile, "offload")
    torch.manual_seed(other)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    with pytest.raises(InputError) as refused, slackswap.apply(model, plan, profile=profile):
        loss_fn(model(x))
    message = str(refused.value)
    assert message.startswith("the model took a different code path than in the profiled "
                              "step (it saved ") and "\n" not in message
    assert "LayerDrop" in message and "config.layerdrop=0" in message
    assert torch.equal(torch.get_rng_state(), rng)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name


class _Features(torch.nn.Module):
    """BatchNorm and dropout in a method of their own, which forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn1 = torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)
        self.l2, self.bn2 = torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)
        self.drop, self.l3 = torch.nn.Dropout(0.1), torch.nn.Linear(64, 64)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.bn1(self.l1(x))))
        return torch.tanh(self.bn2(self.l2(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.features(x)).pow(2).mean()


@pytest.mark.parametrize("decision", ["offload", "recompute"])
def test_another_method_than_the_profiled_call_is_refused_before_it_runs(decision) -> None:
    """NOTE [the model is called first]: a plan made on ``model(x)``, and in the block
    a method of the model other than forward, a submodule called alone, or forward
    called past the model's hooks: refused in one line before any module of the model
    runs, so BatchNorm's running statistics and the RNG are as before the block; the
    block then runs the planned call as plain PyTorch does, and a module that is not the
    model's, called in the block before it, is the program's own."""
    torch.manual_seed(0)
    model, x = _Features().train(), torch.randn(256, 64)
    reference = _Features().train()
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    profile = slackswap.profile(model, x, mode="traced")
    names = [n for n in _names(profile) if decision == "offload" or n in profile.recomputable]
    plan = _uniform(profile, decision, names)
    model.load_state_dict(reference.state_dict())  # the buffers as before profiling
    others = {
        "features": (lambda: model.features(x).sum(), r"module 'l1' \(Linear\) ran"),
        "submodule": (lambda: model.l3(model.drop(x)).sum(), r"module 'drop' \(Dropout\)"),
        "forward": (lambda: model.forward(x), "forward was called directly"),
    }
    block = slackswap.apply(model, plan, profile=profile)
    for call, said in others.values():
        torch.manual_seed(2)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        rng = torch.get_rng_state()
        with pytest.raises(InputError, match=said) as refused, block:
            call()
        assert "\n" not in str(refused.value)
        assert "not another method" in str(refused.value)
        assert torch.equal(torch.get_rng_state(), rng)
        assert buffers.keys() == {n for n, _ in model.named_buffers()}
        for name, b in model.named_buffers():  # running_mean/var, num_batches_tracked
            assert torch.equal(b, buffers[name]), name
    # code of the program's own before the model's call (a module not the model's, a
    # draw, saves): not the step's, so the first step under the block stays on its path
    aux = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Dropout(0.5))
    got = []
    for m in (model, reference):
        torch.manual_seed(3)
        with block if m is model else contextlib.nullcontext():
            loss = aux(x).pow(2).mean() + m(x)
        loss.backward()
        got.append((loss.detach(), [p.grad.clone() for p in aux.parameters()]))
        aux.zero_grad(set_to_none=True)
    assert not block.stats.off_path
    assert block.stats.offloaded_bytes + block.stats.recomputed_ops > 0
    assert torch.equal(got[0][0], got[1][0])
    for g, h in zip(got[0][1], got[1][1], strict=True):
        assert torch.equal(g, h)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(b, c), name
