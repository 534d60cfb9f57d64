"""Models that skip layers at random in training (LayerDrop), in their real
``transformers`` classes from tiny configs: a step whose draw takes another path than the
profiled step runs as plain PyTorch (NOTE [a step off the profiled path]), so training
under a plan or ``attach`` gives plain PyTorch's gradients on every step."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import random
import warnings
from collections import Counter

import numpy
import pytest
import torch
import zoo
from memory_tracking import ActivationMemory
from test_memory_truth import SCALARS

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import PathNotice
from slackswap.runtime.streams import stand_ins

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _whisper():
    config = transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, d_model=32, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
        encoder_layerdrop=0.5, decoder_layerdrop=0.5, pad_token_id=0,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)
    model = transformers.WhisperForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1)
    return model, {"input_features": torch.randn(2, 8, 32, generator=g),
                   "labels": torch.randint(3, 100, (2, 6), generator=g)}


def _wav2vec2():
    config = transformers.Wav2Vec2Config(
        vocab_size=20, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, layerdrop=0.5,
        mask_time_prob=0.0, pad_token_id=0)
    model = transformers.Wav2Vec2ForCTC(config)
    g = torch.Generator().manual_seed(1)
    return model, {"input_values": torch.randn(2, 800, generator=g),
                   "labels": torch.randint(1, 20, (2, 5), generator=g)}


def _opt():
    config = transformers.OPTConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=3, ffn_dim=64,
        num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
        layerdrop=0.5)
    model = transformers.OPTForCausalLM(config)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _train(model, batch, steps: int, plan=None) -> list:
    """Loss and gradients of each of ``steps`` SGD steps, seeded by the step's number."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        block = slackswap.apply(model, plan) if plan is not None else None
        with block if block is not None else warnings.catch_warnings():
            loss = model(**batch).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.grad is not None},
                    block.stats.off_path if block is not None else None))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _assert_same(got: list, want: list) -> None:
    for step, ((loss, grads, _), (loss0, grads0, _)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(loss, loss0), step
        assert grads.keys() == grads0.keys(), step
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), (step, name)


@pytest.mark.parametrize("factory", [_whisper, _wav2vec2, _opt])
def test_a_plan_trains_a_layerdrop_model_as_plain_pytorch(factory) -> None:
    torch.manual_seed(0)
    model, batch = factory()
    model.train()
    reference = copy.deepcopy(model)
    torch.manual_seed(100)
    # offload-only: SlackSwap's own plan at half the peak offloads only on these models
    # (Whisper's is this plan; OPT's keeps two more, wav2vec2's more), and the runtime
    # runs a plan's decisions whatever made them; the search took 5-12 s a model, most of
    # the test (tests/test_runtime.py and test_host_work.py run SlackSwap's plans)
    plan = slackswap.plan(model, batch, budget=0.5, hardware="a100-80gb",
                          strategy="offload-only")
    assert any(d != "keep" for d in plan.decisions.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PathNotice)
        got = _train(model, batch, 6, plan)
    _assert_same(got, _train(reference, batch, 6))
    off = [o for _, _, o in got]
    assert any(off) and not all(off), off  # steps on and off the profiled path


def test_attach_trains_a_layerdrop_model_as_plain_pytorch() -> None:
    torch.manual_seed(0)
    model, batch = _whisper()
    model.train()
    reference = copy.deepcopy(model)
    forward = model.forward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # offload-only: SlackSwap's plan of Whisper's step (as in the test above)
        with slackswap.attach(model, budget=0.5, hardware="a100-80gb",
                              strategy="offload-only") as attached:
            got = _train(model, batch, 5)
    _assert_same(got, _train(reference, batch, 5))
    assert attached.plans and "forward" not in model.__dict__ and model.forward == forward


def _switch():
    model, batch, _ = zoo.switch()  # other tokens reach each expert under another seed
    return model, batch


def _measured(model, batch, seed: int, plan=None, profile=None) -> tuple:
    """One step from ``seed``: its activation peak, measured apart from the runtime's
    accounting (``MemTracker``), its block (None for plain PyTorch), loss and gradients."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    memory = ActivationMemory(model, batch)
    block = slackswap.apply(model, plan, profile=profile) if plan is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PathNotice; MemTracker on a CPU-only build
        with memory:
            with block if block is not None else contextlib.nullcontext():
                loss = model(**batch)["loss"]  # (a ModelOutput, or a dict)
            loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return memory.peak, block, (loss.detach(), grads, None)


@functools.cache
def _planned(factory):
    """The model, batch, its profile from seed 0 and SlackSwap's plan at half its peak
    (Switch's: the offload-only plan, which is the plan SlackSwap's search makes for it,
    decision for decision, in 0.2 s rather than 7 s)."""
    torch.manual_seed(0)
    model, batch = factory()
    model.train()
    torch.manual_seed(0)
    profile = slackswap.profile(copy.deepcopy(model), copy.deepcopy(batch), mode="traced")
    strategy = "offload-only" if factory is _switch else "slackswap"
    return model, batch, profile, slackswap.plan(profile, 0.5, strategy=strategy)


def _off_path_step(model, batch, plan, profile):
    """The first seed's step that leaves the profiled path, under ``plan``: its measured
    peak, its block and plain PyTorch's peak, its gradients checked against plain
    PyTorch's."""
    for seed in range(1, 6):
        peak, block, got = _measured(model, batch, seed, plan, profile)
        if block.stats.off_path:
            break
    assert block.stats.off_path, "no seed took another path"
    plain, _, want = _measured(model, batch, seed)
    _assert_same([got], [want])
    return peak, block, plain


@pytest.mark.parametrize("factory", [pytest.param(_switch, marks=pytest.mark.heavy),
                                     _whisper])  # (switch: 14 s on two loaded cores)
def test_a_step_off_the_path_holds_no_more_than_plain_pytorch(factory) -> None:
    """The first try of a step that leaves the profiled path is let go of before the
    second: measured by the tracker, whose own backward hooks keep the first try's graph
    alive (as any hook holding its nodes would), the step peaks no higher than plain
    PyTorch (keep and offload in turn on Switch: 22% over before)."""
    model, batch, profile, _ = _planned(factory)
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("keep", "offload")[i % 2] for i, n in enumerate(names)})
    peak, _, plain = _off_path_step(model, batch, plan, profile)
    assert peak <= plain * 1.01, (peak, plain)


@pytest.mark.parametrize(("factory", "policy"), [(_switch, None), (_whisper, None),
                                                  (_whisper, "behind")])
def test_a_step_off_the_path_stays_within_the_plans_budget(factory, policy) -> None:
    """NOTE [a step off the profiled path]: the step run again saves its activations to
    host memory, so it peaks within the plan's budget (as ``test_memory_truth`` measures
    it: 1.01 of the budget, and the scalars backward holds), with plain PyTorch's
    gradients, and gives every host buffer back. ``behind``: asynchronous copies that
    never finish before the compute stream waits for them (a link slower than compute)
    hold no more device memory than the bound on what is in flight."""
    model, batch, profile, plan = _planned(factory)
    calls: Counter = Counter()
    with stand_ins(calls, policy) if policy else contextlib.nullcontext():
        peak, block, plain = _off_path_step(model, batch, plan, profile)
    budget = plan.budget_bytes
    assert peak <= 1.01 * budget + SCALARS, (peak, budget, plain)
    assert peak < plain  # (each model's off-path step is over the budget as plain PyTorch)
    stats = block.stats
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    assert block.values.copies.held_bytes == 0  # every host buffer given back
    if policy:
        assert calls["copy"] > 0 and stats.offload_waits > 0


def test_an_in_place_change_after_a_save_off_the_path_raises_as_plain_pytorch() -> None:
    """Autograd's check that a saved tensor is unchanged at backward, which saved-tensor
    hooks switch off, holds in a step run again off the profiled path: a forward hook
    that scales the input of OPT's ``fc2`` in place after ``fc2`` (and the ReLU before
    it) saved it makes backward raise, as in plain PyTorch; the graph dropped then gives
    every host buffer back."""
    model, batch, profile, plan = _planned(_opt)

    def scaled(module, args, output) -> None:
        args[0].mul_(1.0)  # the same values; a new version

    for seed in range(1, 8):
        changed = copy.deepcopy(model)
        for layer in changed.model.decoder.layers:
            layer.fc2.register_forward_hook(scaled)
        torch.manual_seed(seed)
        block = slackswap.apply(changed, plan, profile=profile)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PathNotice)
            with block:
                loss = changed(**batch).loss
        if block.stats.off_path:
            break
    assert block.stats.off_path, "no seed took another path"
    copies = block.values.copies
    assert copies.held_bytes > 0
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor of "
                                           r"shape \[24, 64\] changed after it was saved"
                       ) as raised:
        loss.backward()
    del raised, loss  # the graph, never through backward, gives its host buffers back
    gc.collect()
    assert copies.held_bytes == 0
    torch.manual_seed(seed)
    plain = changed(**batch).loss
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.backward()


@pytest.mark.parametrize("how", ["in_place", "out"])
def test_a_write_no_version_counter_sees_after_a_save_off_the_path_is_read_back(how) -> None:
    """NOTE [a step off the profiled path]: a forward hook that changes the input of
    OPT's ``fc2`` through ``.data`` after ``fc2`` saved it (an in-place op, or an op's
    ``out=``), which no version counter sees: plain PyTorch's backward reads the write,
    and so does a step run again off the profiled path (the written activation is held
    as it is, not read back from its copy taken before the write)."""
    model, batch, profile, plan = _planned(_opt)

    def written(module, args, output) -> None:
        x = args[0].data
        if how == "in_place":
            x.clamp_(max=0.05)
        else:
            torch.mul(x, 0.5, out=x)

    changed = copy.deepcopy(model)
    for layer in changed.model.decoder.layers:
        layer.fc2.register_forward_hook(written)
    _off_path_step(changed, batch, plan, profile)


class _Counting(torch.nn.Module):
    """Layers skipped at random, and a buffer the first call sizes in place (as a
    quantization observer's ``min_val`` is empty until its first step), then counts in."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(8))
        self.register_buffer("calls", torch.empty(0))

    def forward(self, x):
        if self.calls.numel() == 0:
            self.calls.resize_(64).zero_()
        self.calls.add_(1)
        x = x * self.calls
        for layer in self.layers:
            if torch.rand(()) > 0.5:
                x = torch.tanh(layer(x))
        return x.square().mean()


def test_a_buffer_the_first_try_resized_is_put_back_before_the_second() -> None:
    """NOTE [refusals leave no trace]: the step's first try sizes a buffer in place;
    leaving the profiled path, the runtime puts it back as the call found it (empty),
    shape first, so the second try sizes and counts it as plain PyTorch does."""
    torch.manual_seed(0)
    model, x = _Counting(), torch.randn(256, 64)
    torch.manual_seed(0)
    profile = slackswap.profile(copy.deepcopy(model), x, mode="traced")
    # offload-only: SlackSwap's plan here too (every activation offloaded), without the
    # search (1 s a test; the same in the test below)
    plan = slackswap.plan(profile, 0.7, "a100-80gb", strategy="offload-only")
    for seed in range(1, 10):
        planned, plain = copy.deepcopy(model), copy.deepcopy(model)
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PathNotice)
            with slackswap.apply(planned, plan, profile=profile) as block:
                loss = planned(x)
        loss.backward()
        if block.stats.off_path:
            break
    assert block.stats.off_path, "no seed took another path"
    torch.manual_seed(seed)
    want = plain(x)
    want.backward()
    assert torch.equal(loss, want)
    assert torch.equal(planned.calls, plain.calls)
    for (name, p), q in zip(planned.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name


class _PythonCounting(torch.nn.Module):
    """Layers skipped at random, and a Python attribute counting the calls that the
    forward reads (a schedule's step counter)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(8))
        self.kind, self.calls, self.seen, self.mem = kind, 0, [], torch.zeros(())

    def forward(self, x):
        if self.kind == "int":
            self.calls += 1
        elif self.kind == "list":  # a list the forward appends to
            self.seen.append(x.shape[0])
            self.calls = len(self.seen)
        elif self.kind == "tensor":  # a tensor held as a plain attribute (no buffer),
            with torch.no_grad():  # counted in place
                self.mem.add_(1)
            self.calls = int(self.mem)
        elif self.kind == "resized":  # a tensor attribute grown in place, and written
            # (NOTE [a tensor resized in place is put back whole])
            with torch.no_grad():
                self.mem.resize_(self.mem.numel() + 1)
                self.mem[-1] = self.mem.numel()
            self.calls = int(self.mem[-1])
        else:  # a tensor attribute replaced by a new one (the old one is freed)
            self.mem = self.mem + 1
            self.calls = int(self.mem)
        x = x / self.calls
        for layer in self.layers:
            if torch.rand(()) > 0.5:
                x = torch.tanh(layer(x))
        return x.square().mean()


def _steps_as_plain(planned, plain, block, x, seeds) -> int:
    """A step of each seed under ``block`` and plain: the same loss, buffers and
    gradients every step; how many steps left the profiled path."""
    off_path = 0
    for seed in seeds:
        torch.manual_seed(seed)
        with warnings.catch_warnings(), block:
            warnings.simplefilter("ignore", PathNotice)
            loss = planned(x)
        loss.backward()
        off_path += block.stats.off_path
        torch.manual_seed(seed)
        want = plain(x)
        want.backward()
        assert torch.equal(loss, want), seed
        for (name, b), c in zip(planned.named_buffers(), plain.buffers(), strict=True):
            assert torch.equal(b, c), (seed, name)
        for (name, p), q in zip(planned.named_parameters(), plain.parameters(), strict=True):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
            p.grad = q.grad = None
    return off_path


@pytest.mark.parametrize("kind", ["int", "list", "tensor", "replaced", "resized"])
def test_a_python_attribute_the_first_try_set_is_put_back_before_the_second(kind) -> None:
    """NOTE [a step off the profiled path]: the runtime put back the buffers and the RNG
    before running a step again, but not the modules' Python attributes, so a call
    counter the forward reads counted the step twice: that step and every later one
    differed from plain PyTorch, silently. The profile names the attributes its step set,
    refilled or wrote in place (``changed_attributes``) and the runtime puts those back
    too; a tensor the step replaced, by one with its values (the runtime holds no device
    tensor the step frees: ``HeldAttributes``); a tensor it resized in place, whole (NOTE [a
    tensor resized in place is put back whole])."""
    torch.manual_seed(0)
    model, x = _PythonCounting(kind), torch.randn(256, 64)
    torch.manual_seed(0)
    profile = slackswap.profile(copy.deepcopy(model), x, mode="traced")
    assert profile.changed_attributes == {"": {"int": ["calls"], "list": ["calls", "seen"],
                                               "tensor": ["calls", "mem"],
                                               "replaced": ["calls", "mem"],
                                               "resized": ["calls", "mem"]}[kind]}
    plan = slackswap.plan(profile, 0.7, "a100-80gb", strategy="offload-only")  # (above)
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    block = slackswap.apply(planned, plan, profile=profile)
    assert _steps_as_plain(planned, plain, block, x, range(1, 8)), "no seed took another path"
    assert planned.calls == plain.calls == (8 if kind == "resized" else 7)
    assert torch.equal(planned.mem, plain.mem)


@pytest.mark.parametrize("mode", ["traced", "analytic"])
def test_profiling_puts_back_a_tensor_the_step_resized_in_place(mode) -> None:
    """NOTE [a tensor resized in place is put back whole]: profiling a step that grows a
    tensor attribute in place raised a RuntimeError (the old bytes into the grown
    storage); now the tensor is the same object, with its shape, stride and values. (The
    analytic profile's fake tensors cannot resize a real one: refused in one line.)"""
    torch.manual_seed(0)
    model, x = _PythonCounting("resized"), torch.randn(256, 64)
    mem = model.mem
    with torch.no_grad():
        mem.fill_(3.0)
    if mode == "analytic":
        with pytest.raises(slackswap.errors.ProfileError, match="resize_"):
            slackswap.profile(model, x, "a100-80gb", mode=mode)
    else:
        slackswap.profile(model, x, "a100-80gb", mode=mode)
    assert model.mem is mem and mem.shape == () and mem.stride() == () and float(mem) == 3.0
    assert mem.untyped_storage().nbytes() == 4


class _Skipping(torch.nn.Module):
    """``layers`` layers, those in ``skip`` left out (a LayerDrop draw set by hand)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(layers))
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = torch.tanh(layer(x))
        return {"loss": x.square().mean()}


@pytest.mark.parametrize("skipped", [{1, 2}, {1}, {0, 1, 2}])
def test_a_longer_path_under_a_plan_that_keeps_everything_stays_within_its_peak(
        skipped) -> None:
    """NOTE [a longer path under a plan that keeps everything]: profiled on a step that
    skipped layers, a plan keeping every activation moved nothing and checked nothing,
    so a step running them held 2x to 5x the plan's simulated peak (TimeSeriesTransformer's
    LayerDrop, 4x); now it runs again off the path, within that peak, as plain PyTorch."""
    torch.manual_seed(0)
    model = _Skipping().train()
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    model.skip = skipped
    profile = slackswap.profile(copy.deepcopy(model), {"x": x}, mode="traced")
    model.skip = set()
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions=dict.fromkeys(names, "keep"))
    block = slackswap.apply(model, plan, profile=profile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PathNotice)
        with block:
            loss = model(x=x)["loss"]
    loss.backward()
    want = reference(x=x)["loss"]
    want.backward()
    assert torch.equal(loss, want)
    for (name, p), p0 in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, p0.grad), name
    assert block.stats.off_path
    peak = slackswap.simulate(profile, plan).peak_bytes
    assert block.stats.peak_resident_bytes <= peak, (block.stats.peak_resident_bytes, peak)


def test_a_shorter_path_under_a_plan_that_keeps_everything_runs_on() -> None:
    """The other way round: a step skipping layers the profiled step ran holds less than
    the plan measured, and runs under the plan (not again)."""
    torch.manual_seed(0)
    model = _Skipping().train()
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    profile = slackswap.profile(copy.deepcopy(model), {"x": x}, mode="traced")
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions=dict.fromkeys(names, "keep"))
    model.skip = {1, 2}
    with slackswap.apply(model, plan, profile=profile) as block:
        loss = model(x=x)["loss"]
    loss.backward()
    assert not block.stats.off_path and block.stats.peak_resident_bytes > 0


@pytest.mark.parametrize(("skipped", "budget"), [({0, 1, 2, 3}, 0.7), ({0, 2, 4, 6}, 0.7),
                                                 ({3, 4, 5, 6, 7}, 0.8)])
def test_a_longer_path_under_a_plan_that_moves_activations_stays_within_its_budget(
        skipped, budget) -> None:
    """NOTE [a longer path holds no more than the profiled step]: profiled on a step that
    skipped layers of one shape, a plan that moves activations named the extra layers'
    saves after the next layers' (the sizes agree) and kept those past the profile's
    unnamed and unchecked until the model returned, over its budget (by 7% to 25%); now
    the step runs again off the path as it saves one more tensor than the profiled step,
    within the plan's budget, as plain PyTorch."""
    torch.manual_seed(0)
    model = _Skipping(8).train()
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    model.skip = skipped
    profile = slackswap.profile(copy.deepcopy(model), {"x": x}, mode="traced")
    plan = slackswap.plan(profile, budget, hardware="a100-80gb")
    assert any(d != "keep" for d in plan.decisions.values())
    model.skip = set()
    peak, plain = _longer_path_run(model, reference, x, plan, profile)
    assert peak <= 1.01 * plan.budget_bytes + SCALARS, (peak, plan.budget_bytes, plain)


def _longer_path_run(model, reference, x, plan, profile) -> tuple[int, int]:
    """One step of ``model`` under ``plan`` on a longer path than ``profile``'s: checked
    to leave the path, within the plan's simulated peak, with plain PyTorch's loss and
    gradients (``reference``'s); its measured peak and plain PyTorch's."""
    peak, block, got = _measured(model, {"x": x}, 0, plan, profile)
    plain, _, want = _measured(reference, {"x": x}, 0)
    _assert_same([got], [want])
    assert block.stats.off_path
    simulated = slackswap.simulate(profile, plan).peak_bytes
    assert block.stats.peak_resident_bytes <= simulated, (
        block.stats.peak_resident_bytes, simulated)
    return peak, plain


class _Widening(torch.nn.Module):
    """Two wide layers, those in ``skip`` left out, then four narrow ones: a step running
    a wide layer the profiled step skipped saves larger tensors first, and more."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(2))
        self.down = torch.nn.Linear(256, 16)
        self.narrow = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for i, layer in enumerate(self.wide):
            if i not in self.skip:
                x = torch.tanh(layer(x))
        x = self.down(x)
        for layer in self.narrow:
            x = torch.tanh(layer(x))
        return {"loss": x.square().mean()}


def test_a_longer_path_with_larger_saves_first_stays_within_the_plans_peak() -> None:
    """NOTE [a longer path holds no more than the profiled step]: a step running wide
    layers the profiled step skipped saves their larger tensors where the profiled step
    saved narrow ones, so under a plan that keeps everything (no sizes checked) it held
    3.9x the plan's simulated peak before it saved more tensors than the profiled
    step (TimeSeriesTransformer's LayerDrop: 45,056 B held where 11,232 B were
    simulated); now it runs again off the path as its saved activations would go past
    that peak, with plain PyTorch's gradients."""
    torch.manual_seed(0)
    model = _Widening().train()
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    model.skip = {0, 1}
    profile = slackswap.profile(copy.deepcopy(model), {"x": x}, mode="traced")
    model.skip = set()
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions=dict.fromkeys(names, "keep"))
    peak, plain = _longer_path_run(model, reference, x, plan, profile)
    assert peak < plain, (peak, plain)


class _NewPath(torch.nn.Module):
    """A flag the plan cannot see turns on a branch the profiled step never ran: one that
    counts its calls in a Python attribute, or draws from Python's ``random`` or NumPy's
    global generator (Wav2Vec2's SpecAugment switched on after planning draws NumPy)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256)
        self.c = torch.nn.Linear(256, 64)
        self.kind, self.extra, self.calls = kind, False, 0

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.extra:
            if self.kind == "counter":
                self.calls += 1
                scale = float(self.calls)
            elif self.kind == "random":
                scale = random.uniform(0.5, 1.5)
            else:
                scale = float(numpy.random.uniform(0.5, 1.5))
            h = h * torch.sigmoid(h) * scale  # ops (and saves) the profiled step lacks
        return self.c(torch.tanh(self.b(h))).square().mean()


@pytest.mark.parametrize("kind", ["counter", "random", "numpy"])
def test_a_new_path_that_draws_or_counts_on_the_host_runs_again_from_where_it_began(
        kind) -> None:
    """NOTE [the state a second try starts from]: a step that leaves the profiled path
    runs forward again, and put back only what the profiled step changed: a new path's
    call counter counted twice, its draws from Python's or NumPy's generator were drawn
    twice, and the step's loss and gradients differed from plain PyTorch's, silently."""
    torch.manual_seed(0)
    model, x = _NewPath(kind), torch.randn(16, 64)
    plan = slackswap.plan(copy.deepcopy(model), x, budget=0.8, hardware="a100-80gb",
                          strategy="recompute-only")
    assert any(d != "keep" for d in plan.decisions.values())
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    block = slackswap.apply(planned, plan)
    for step in range(3):
        for m in (planned, plain):
            m.extra = step > 0  # the same change on both sides, after the plan was made
        random.seed(step)
        numpy.random.seed(step)
        with warnings.catch_warnings(), block:
            warnings.simplefilter("ignore", PathNotice)
            loss = planned(x)
        loss.backward()
        assert block.stats.off_path == (step > 0)
        after = random.random(), numpy.random.random()
        random.seed(step)
        numpy.random.seed(step)
        want = plain(x)
        want.backward()
        assert torch.equal(loss, want), step
        assert (random.random(), numpy.random.random()) == after, step  # drawn once
        for (name, p), q in zip(planned.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (step, name)
            p.grad = q.grad = None
    assert planned.calls == plain.calls


def test_attach_runs_a_step_again_after_the_users_forward_pre_hooks() -> None:
    """A user's forward pre-hook on the attached model that draws noise from torch's RNG
    (or counts calls) ran before the block took the RNG to put back (attach opens the
    block in a pre-hook of its own, ahead of the user's): a step off the profiled path
    then put the RNG back to before the hook's draw and ran forward alone, which drew the
    hook's numbers again, and its LayerDrop and dropout draws differed from plain
    PyTorch's. The state is now taken as the model's forward is called."""
    torch.manual_seed(0)
    model, batch = _whisper()
    model.train()

    def noise(module, args, kwargs):
        features = kwargs["input_features"]
        return args, {**kwargs, "input_features": features + torch.randn_like(features)}

    model.register_forward_pre_hook(noise, with_kwargs=True)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with slackswap.attach(model, budget=0.5, hardware="a100-80gb",
                              strategy="offload-only") as attached:
            got = _train(model, batch, 5)
            off = attached.stats.off_path
    _assert_same(got, _train(reference, batch, 5))
    assert attached.plans, off


class _RunningMean(torch.nn.Module):
    """LayerDrop, and a registered buffer the forward assigns anew each step (an EMA
    written ``self.ema = 0.9 * self.ema + ...``, which ``nn.Module`` keeps in
    ``_buffers``) rather than in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(8))
        self.register_buffer("ema", torch.zeros(64))

    def forward(self, h):
        for layer in self.layers:
            if self.training and torch.rand(()) < 0.5:
                continue
            h = torch.tanh(layer(h))
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return (h + self.ema).square().mean()


def test_a_buffer_the_first_try_assigned_anew_is_put_back_before_the_second() -> None:
    """NOTE [the state a second try starts from]: the buffers were put back by value into
    the tensors the model held as it was called, but a buffer the first try assigned anew
    was by then another tensor: the second try started from the first try's EMA, which
    it updated again, and the loss and gradients differed from plain PyTorch's."""
    torch.manual_seed(0)
    model, x = _RunningMean(), torch.randn(256, 64)
    plan = slackswap.plan(copy.deepcopy(model), x, budget=0.8, hardware="a100-80gb",
                          strategy="offload-only")
    plain, block = copy.deepcopy(model), slackswap.apply(model, plan)
    assert _steps_as_plain(model, plain, block, x, range(4)), "no seed took another path"
