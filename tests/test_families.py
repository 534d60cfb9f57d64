"""Families scouted for exactness and budget: real classes from tiny configs, planned
with ``slackswap.plan(model, batch)`` and trained two SGD steps under the plan, loss and
every gradient compared bit for bit with plain PyTorch from the same seed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from memory_tracking import ActivationMemory
from test_memory_truth import SCALARS
from torch import nn
from zoo import Output

import slackswap
from slackswap.core.plan import MIN_PLANNED_BYTES, Plan


def _train(model: nn.Module, batch: tuple, plan=None, steps: int = 2) -> list:
    """Loss and gradients of each of ``steps`` SGD steps, seeded by the step's number."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        with slackswap.apply(model, plan) if plan is not None else warnings.catch_warnings():
            loss = model(*batch)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.grad is not None}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _assert_same(got: list, want: list) -> None:
    for step, ((loss, grads), (loss0, grads0)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(loss, loss0), step
        assert grads.keys() == grads0.keys(), step
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), (step, name)


# -- quantization-aware training -----------------------------------------------------------
class _QATNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, 2, padding=1), nn.BatchNorm2d(16),
                                  nn.ReLU())
        self.fc = nn.Linear(16 * 8 * 8, 10)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(self.quant(x)).flatten(1)
        return F.cross_entropy(self.dequant(self.fc(h)), y)


def _qat() -> tuple[nn.Module, tuple]:
    """A conv net prepared for quantization-aware training as torch.ao does it: fused
    conv-bn-relu, fake quantization with per-channel weight observers."""
    torch.manual_seed(0)
    model = _QATNet().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    torch.ao.quantization.fuse_modules_qat(model, [["body.0", "body.1", "body.2"],
                                                   ["body.3", "body.4", "body.5"]],
                                           inplace=True)
    torch.ao.quantization.prepare_qat(model, inplace=True)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(4, 3, 16, 16, generator=g),
                   torch.randint(0, 10, (4,), generator=g))


def test_qat_plan_leaves_the_model_as_it_was() -> None:
    """A per-channel observer's ``min_val``/``max_val`` (and its fake quantizer's
    ``scale``) are empty until the first step resizes them in place: the profiled step
    put the buffers back with ``copy_`` and raised a shape mismatch out of
    ``slackswap.plan``, leaving the model's gradients, attributes and RNG as the step
    left them. Now they are resized back, and the first step under the plan is plain
    PyTorch's bit for bit."""
    model, batch = _qat()
    reference = copy.deepcopy(model)
    assert any(b.numel() == 0 for b in model.buffers())  # what the first step resizes
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = slackswap.plan(model, batch, budget=0.8, hardware="a100-80gb")
    assert any(d != "keep" for d in plan.decisions.values())
    assert torch.equal(torch.get_rng_state(), rng)
    for (name, b), b0 in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert b.shape == b0.shape and torch.equal(b, b0), name
    assert all(p.grad is None for p in model.parameters())
    _assert_same(_train(model, batch, plan, steps=1), _train(reference, batch, steps=1))


def test_qat_trains_three_steps_under_one_plan() -> None:
    """NOTE [buffers the profiled step resized]: the first step sizes the per-channel
    observers' empty buffers, so the model's fingerprint differs from the plan's after
    it (the second step was refused as 'a different model'); the profile says which
    buffers its step resized, the runtime takes them in either shape, and every step
    stays on the profiled path, bit-identical to plain PyTorch, buffers included. A
    buffer of another shape than those two is still another model."""
    model, batch = _qat()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = slackswap.plan(model, batch, budget=0.8, hardware="a100-80gb")
    resized = plan._profile.resized_buffers
    assert resized and all(was != now for was, now in resized.values())
    assert any(d != "keep" for d in plan.decisions.values())
    block = slackswap.apply(model, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    got = []
    for step in range(3):
        torch.manual_seed(100 + step)
        with block:
            loss = model(*batch)
        loss.backward()
        assert not block.stats.off_path and block.stats.offloaded_bytes > 0, step
        got.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.grad is not None}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _assert_same(got, _train(reference, batch, steps=3))
    for (name, b), b0 in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(b, b0), name
    name = next(iter(resized))
    with torch.no_grad():
        dict(model.named_buffers())[name].resize_(3)
    with pytest.raises(slackswap.InputError, match="different model"), block:
        model(*batch)


# -- a model that returns a loss, trained on another ---------------------------------------
class _TwoHeads(nn.Module):
    """Returns its own ``.loss`` (head ``a``) and logits (head ``b``), as DAC returns its
    commitment loss beside the audio it decodes; training adds a loss on the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.b = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.a(x).square().mean(), self.b(x))


def test_an_explicit_loss_fn_is_the_loss_planned_for() -> None:
    """The profiled loss was ``output.loss`` whenever the model returned one, a
    ``loss_fn`` given used only where it returned none: the plan was made for a backward
    without head b's, and the step trained on ``loss_fn`` measured 103% of the budget
    (DAC, whose ``.loss`` is per sample, was refused as 'not a differentiable scalar')."""
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(1024, 64)

    def loss_fn(out: Output) -> torch.Tensor:
        return out.loss + out.logits.square().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = slackswap.plan(model, (x,), budget=0.97, hardware="a100-80gb", loss_fn=loss_fn)
    memory = ActivationMemory(model, x)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        with memory, slackswap.apply(model, plan):
            loss = loss_fn(model(x))
            loss.backward()
    assert memory.peak <= plan.budget_bytes + SCALARS, (memory.peak, plan.budget_bytes)


# -- Hugging Face families that draw in forward --------------------------------------------
def _informer() -> tuple[nn.Module, dict]:
    """ProbSparse attention: each training forward samples its keys with ``torch.randint``."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.InformerConfig(
        prediction_length=4, context_length=8, input_size=1, lags_sequence=[1, 2],
        num_time_features=1, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, dropout=0.1, attention_type="prob", sampling_factor=2, distil=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return transformers.InformerForPrediction(config), {
        "past_values": torch.randn(2, 10, generator=g),
        "past_time_features": torch.randn(2, 10, 1, generator=g),
        "past_observed_mask": torch.ones(2, 10),
        "future_values": torch.randn(2, 4, generator=g),
        "future_time_features": torch.randn(2, 4, 1, generator=g)}


def _patchtst() -> tuple[nn.Module, dict]:
    """Masked pretraining: each training forward masks patches from ``torch.rand``."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=2, ffn_dim=32, dropout=0.1,
        attention_dropout=0.1, path_dropout=0.1, ff_dropout=0.1, random_mask_ratio=0.4,
        do_mask_input=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return transformers.PatchTSTForPretraining(config), {
        "past_values": torch.randn(2, 32, 3, generator=g)}


class _Loss(nn.Module):
    """Calls a Hugging Face model with a dict batch and returns its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(**batch).loss


@pytest.mark.parametrize(("factory", "strategy", "budget"), [
    (_informer, "recompute-only", 0.7), (_informer, "slackswap", 0.6),
    (_patchtst, "recompute-only", 0.7),
    pytest.param(_patchtst, "slackswap", 0.5, marks=pytest.mark.heavy)])  # (9 s)
def test_a_family_that_draws_in_forward_trains_as_plain_pytorch_within_budget(
        factory, strategy: str, budget: float) -> None:
    model, batch = factory()
    model = _Loss(model).train()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = slackswap.plan(model, (batch,), budget=budget, hardware="a100-80gb",
                              strategy=strategy)
    assert any(d != "keep" for d in plan.decisions.values())
    measured = copy.deepcopy(model)
    memory = ActivationMemory(measured, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        with memory, slackswap.apply(measured, plan):
            measured(batch).backward()
    assert memory.peak <= plan.budget_bytes + SCALARS, (memory.peak, plan.budget_bytes)
    _assert_same(_train(model, (batch,), plan), _train(reference, (batch,)))


def _t5() -> tuple[nn.Module, dict]:
    """T5's layer norm saves its input twice (``pow`` and ``mul``); under a recompute
    plan the first save can come before any watched op read it."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, dropout_rate=0.1,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 12), generator=g)
    return transformers.T5ForConditionalGeneration(config), {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_a_storage_saved_twice_as_one_value_is_resident_once() -> None:
    """The runtime counted a kept storage twice (as ``(storage, 0)``, saved before a
    watched op read it, and ``(storage, 1)`` after): T5 under this plan held 299,136
    saved bytes by its stats, over the simulated peak of 297,704, though the memory was
    not there (slackswap's recompute-only plan at half the peak: 217,344 over 209,768)."""
    model, batch = _t5()
    model = _Loss(model).train()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = slackswap.profile(model, (batch,), mode="traced")
    names = [t.name for t in profile.saved_activations
             if t.producer is not None and t.bytes >= MIN_PLANNED_BYTES]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "recompute" for n in names[2::3]})
    block = slackswap.apply(model, plan, profile=profile)
    with block:
        torch.manual_seed(100)
        loss = model(batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    assert block.stats.resident_bytes == 0
    assert 0 < block.stats.peak_resident_bytes <= slackswap.simulate(profile, plan).peak_bytes
    _assert_same(_train(model, (batch,), plan), _train(reference, (batch,)))


class _GrowingCache(nn.Module):
    """A cache the forward registers again, longer, when a batch outgrows it, as a
    dynamic RoPE's ``inv_freq`` (transformers' ``rope_type="dynamic"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
        self.register_buffer("freq", torch.linspace(0.5, 1.5, 32), persistent=False)
        self.cached = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.cached:  # the same shape, other values
            self.register_buffer("freq", self.freq * 8 / x.shape[1], persistent=False)
            self.cached = x.shape[1]
        h = F.gelu(self.a(x) * self.freq)
        return self.b(F.dropout(h, 0.1, self.training)).logsumexp(-1).mean()


def test_a_buffer_the_step_registers_again_is_put_back() -> None:
    """The profiled step's buffers were compared by the tensor each name held before the
    step, so a buffer the step replaced (``register_buffer`` again) raised a KeyError out
    of ``slackswap.plan`` (Llama with ``rope_scaling={"rope_type": "dynamic"}`` on a batch
    longer than its positions). Now the old buffer and the module's counter are put back,
    and training under the plan is plain PyTorch's bit for bit."""
    torch.manual_seed(0)
    model = _GrowingCache().train()
    reference = copy.deepcopy(model)
    batch = (torch.randn(32, 12, 16, generator=torch.Generator().manual_seed(1)),)
    freq = model.freq
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = slackswap.plan(model, batch, budget=0.8, hardware="a100-80gb")
    assert model.freq is freq and model.cached == 8
    assert any(d != "keep" for d in plan.decisions.values())
    _assert_same(_train(model, batch, plan, steps=3), _train(reference, batch, steps=3))
