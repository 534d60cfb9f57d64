"""Models that draw from random streams outside torch in forward: Python's ``random`` and
NumPy's global generator (Hugging Face's wav2vec2, HuBERT and their kin draw SpecAugment's
masks from ``np.random`` in every training forward), or a NumPy generator they hold.

Planning in one call (``slackswap.plan(model, batch)``), ``attach`` and a step run again
off the profiled path leave those streams as plain PyTorch would: the training after is
plain PyTorch's, bit for bit (NOTE [a profiled step leaves no trace], NOTE [refusals
leave no trace])."""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import slackswap
from slackswap.errors import PathNotice


class _SpecAugment(nn.Module):
    """Time masks drawn from ``np.random`` and a jitter from ``random`` (as
    ``transformers``' ``_compute_mask_indices``), from NumPy and torch generators of its
    own, then
    residual blocks, the third of which a LayerDrop-style ``torch.rand`` draw skips."""

    def __init__(self, layerdrop: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mask_embed = nn.Parameter(torch.randn(32))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
            for _ in range(4))
        self.out = nn.Linear(32, 8)
        self.layerdrop = layerdrop
        self.own = np.random.default_rng(3)
        self.noise = torch.Generator().manual_seed(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        spans = np.random.rand(h.shape[0], h.shape[1]) < 0.3
        spans |= self.own.random((h.shape[0], h.shape[1])) < 0.1
        mask = torch.from_numpy(spans).unsqueeze(-1)
        h = torch.where(mask, self.mask_embed.to(h.dtype), h) * (1 + random.random())
        h = h + 0.01 * torch.randn(h.shape, generator=self.noise)
        for i, block in enumerate(self.blocks):
            if not (i == 2 and self.training and torch.rand([]) < self.layerdrop):
                h = h + block(h)
        return self.out(h).logsumexp(-1).mean()


def _streams() -> tuple:
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def _train(model: nn.Module, x: torch.Tensor, steps: int, run) -> list:
    """Loss and every gradient of each SGD step, the streams seeded once up front as a
    training script seeds them."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        loss = run(model, x)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _assert_same(got: list, want: list) -> None:
    for step, ((loss, grads), (loss0, grads0)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(loss, loss0), (step, loss, loss0)
        assert grads.keys() == grads0.keys(), step
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), (step, name)


def test_planning_in_one_call_leaves_the_host_random_streams_as_they_were() -> None:
    torch.manual_seed(0)
    model, x = _SpecAugment().train(), torch.randn(4, 24, 16)
    random.seed(5)
    np.random.seed(5)
    before, own, noise = _streams(), model.own.bit_generator.state, model.noise.get_state()
    plan = slackswap.plan(model, x, budget=0.5, hardware="a100-80gb")
    after = _streams()
    assert after[0] == before[0]
    assert np.array_equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert model.own.bit_generator.state == own and torch.equal(model.noise.get_state(), noise)
    assert plan._profile.host_random  # the step drew from them, and the profile says so


def test_attach_trains_a_model_drawing_from_numpy_as_plain_pytorch() -> None:
    torch.manual_seed(0)
    model, x = _SpecAugment().train(), torch.randn(4, 24, 16)
    reference = copy.deepcopy(model)
    with slackswap.attach(model, budget=0.5, hardware="a100-80gb") as attached:
        got = _train(model, x, 3, _plain)
    assert attached.plans
    _assert_same(got, _train(reference, x, 3, _plain))


def test_a_step_run_again_off_the_profiled_path_draws_the_host_streams_again() -> None:
    """The LayerDrop-style skip drawn otherwise than profiled is found after the masks
    were drawn: the step runs again from where the model was called, with NumPy's and
    Python's streams put back as torch's are."""
    torch.manual_seed(0)
    model, x = _SpecAugment(layerdrop=0.5).train(), torch.randn(4, 24, 16)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    plan = slackswap.plan(model, x, budget=0.5, hardware="a100-80gb")
    blocks = []

    def planned(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        block = slackswap.apply(model, plan)
        blocks.append(block)
        with block:
            return model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PathNotice)
        got = _train(model, x, 6, planned)
    off = [b.stats.off_path for b in blocks]
    assert any(off) and not all(off), off  # steps on and off the profiled path
    _assert_same(got, _train(reference, x, 6, _plain))


@pytest.mark.heavy  # six steps of two trainings (17 s on two loaded cores)
def test_whisper_with_specaugment_and_layerdrop_trains_as_plain_pytorch() -> None:
    """transformers' Whisper draws SpecAugment's masks from ``np.random`` (writing them
    into the batch's features) and skips layers by ``torch.rand``: planned steps that
    leave the profiled path run again with the masks plain PyTorch draws, and ``attach``'s
    profiled step leaves NumPy's generator where plain training has it."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, d_model=32, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
        encoder_layerdrop=0.5, decoder_layerdrop=0.5, pad_token_id=0,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, apply_spec_augment=True,
        mask_time_prob=0.3, mask_time_length=2, mask_feature_prob=0.3, mask_feature_length=2)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(1)
    batch = {"input_features": torch.randn(2, 8, 32, generator=g),
             "labels": torch.randint(3, 100, (2, 6), generator=g)}

    def whisper(model: nn.Module, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    def fresh() -> tuple[nn.Module, dict]:  # SpecAugment writes into the batch
        return copy.deepcopy(model), copy.deepcopy(batch)

    want = _train(*fresh(), 4, whisper)
    planning, planned_batch = fresh()
    torch.manual_seed(100)
    plan = slackswap.plan(planning, planned_batch, budget=0.5, hardware="a100-80gb")
    blocks = []

    def planned(model: nn.Module, batch: dict) -> torch.Tensor:
        blocks.append(slackswap.apply(model, plan))
        with blocks[-1]:
            return model(**batch).loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PathNotice)
        _assert_same(_train(*fresh(), 4, planned), want)
    assert any(b.stats.off_path for b in blocks)
    attached, attached_batch = fresh()
    with slackswap.attach(attached, budget=0.5, hardware="a100-80gb"):
        _assert_same(_train(attached, attached_batch, 4, whisper), want)


_GLOBAL = torch.Generator()  # a generator the model reaches by no attribute of its own


class _Noised(nn.Module):
    """Noise drawn from a ``torch.Generator`` passed to the call (diffusers'
    ``AutoencoderKL(x, generator=g)`` samples its latent so) and (with no layerdrop, or
    ``global_draw``) from a global one, then a block that a LayerDrop-style
    ``torch.rand`` draw skips."""

    def __init__(self, layerdrop: float = 0.0, global_draw: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
            for _ in range(4))
        self.layerdrop, self.global_draw = layerdrop, global_draw

    def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        h = self.inp(x)
        h = h + torch.randn(h.shape, generator=generator)
        if not self.layerdrop or self.global_draw:
            h = h * (torch.rand(h.shape, generator=_GLOBAL) > 0.2)
        for i, block in enumerate(self.blocks):
            if not (i == 2 and self.training and torch.rand([]) < self.layerdrop):
                h = h + block(h)
        return self.out(h).logsumexp(-1).mean()


def test_planning_leaves_a_generator_passed_to_the_call_or_global_as_it_was() -> None:
    torch.manual_seed(0)
    model, x, passed = _Noised().train(), torch.randn(4, 24, 16), torch.Generator()
    passed.manual_seed(3)
    _GLOBAL.manual_seed(4)
    before = passed.get_state(), _GLOBAL.get_state()
    slackswap.plan(model, {"x": x, "generator": passed}, budget=0.5, hardware="a100-80gb")
    assert torch.equal(passed.get_state(), before[0])
    assert torch.equal(_GLOBAL.get_state(), before[1])


@pytest.mark.parametrize("global_draw", [False, True], ids=["passed", "passed-and-global"])
def test_a_step_run_again_off_the_profiled_path_draws_its_generators_again(
        global_draw: bool) -> None:
    """The skip drawn otherwise than profiled is found after the noise was drawn from the
    call's ``generator`` (and a global one): the step runs again with those put back too
    (NOTE [generators a profiled step drew from])."""
    torch.manual_seed(0)
    _GLOBAL.manual_seed(5)
    model, x = _Noised(layerdrop=0.5, global_draw=global_draw).train(), torch.randn(4, 24, 16)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    plan = slackswap.plan(model, {"x": x, "generator": torch.Generator()}, budget=0.5,
                          hardware="a100-80gb")
    assert set(plan.decisions.values()) - {"keep"}  # it moves something
    blocks = []

    def run(planned: bool):
        passed = torch.Generator().manual_seed(3)

        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if not planned:
                return model(x, generator=passed)
            blocks.append(slackswap.apply(model, plan))
            with blocks[-1]:
                return model(x, generator=passed)
        return step

    _GLOBAL.manual_seed(6)
    want = _train(reference, x, 6, run(False))
    _GLOBAL.manual_seed(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PathNotice)
        got = _train(model, x, 6, run(True))
    off = [b.stats.off_path for b in blocks]
    assert any(off) and not all(off), off
    _assert_same(got, want)
