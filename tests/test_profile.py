"""The analytic and measured profilers against independent counts."""

from __future__ import annotations

import functools

import pytest
import torch
from factories import TinyMLP, WithMSE, frozen, no_loss, raises
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap
from slackswap.core.profile import StepProfile
from slackswap.errors import ProfileError
from slackswap.models import MODEL_PRESETS, build_model

TINY = ["bert-large-tiny", "gpt2-xl-tiny", "llama-7b-tiny"]


@functools.cache
def analytic(name: str, attn: str = "sdpa", batch: int | None = None,
             seq: int | None = None) -> StepProfile:
    model, example = build_model(name, attn=attn, batch=batch, seq=seq)
    return slackswap.profile(model, example, "a100-80gb", name=name)


# -- Korthikanti et al. (2022), activations per transformer layer ---------------------


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("batch", "seq"), [(32, 512), (8, 256)])
def test_bert_layer_bytes_match_korthikanti(attn: str, batch: int, seq: int) -> None:
    p = analytic("bert-large", attn, batch, seq)
    h, a, s, b = 1024, 16, seq, batch
    expected = s * b * h * (34 + (5 * a * s / h if attn == "eager" else 0))
    per_layer = p.summary()["saved_bytes_per_layer"]
    assert len(per_layer) == 24
    for got in per_layer:
        assert got == pytest.approx(expected, rel=0.01)


# -- forward FLOPs against a closed form --------------------------------------------


def closed_form_forward_flops(name: str) -> float:
    """Matmul and attention FLOPs of the forward pass, written from the architecture."""
    p = MODEL_PRESETS[name]
    b, s, h, f, v, n = p.batch, p.seq, p.hidden, p.ffn, p.vocab, p.layers
    projections = 4 * 2 * b * s * h * h  # q, k, v, output
    attention = 2 * 2 * b * s * s * h  # q k^T and p v
    if p.family == "bert":
        mlp = 2 * 2 * b * s * h * f
        head = 2 * b * s * h * h + 2 * b * s * h * v  # transform + decoder
        return n * (projections + attention + mlp) + head
    causal = attention / 2
    mlp = (3 if p.family == "llama" else 2) * 2 * b * s * h * f  # SwiGLU has three matmuls
    return n * (projections + causal + mlp) + 2 * b * s * h * v


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-large", "gpt2-xl", "llama-7b"])
def test_forward_flops_match_closed_form(name: str) -> None:
    got = analytic(name).summary()["forward_flops"]
    assert got == pytest.approx(closed_form_forward_flops(name), rel=0.03)


# -- what the target GPU saves --------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_cuda_kernels_saved_set(name: str) -> None:
    p = analytic(name)
    kinds = {p.ops[t.producer].kind for t in p.saved_activations if t.producer is not None}
    assert "fused_attention" in kinds
    for t in p.saved_activations:
        op = p.ops[t.producer] if t.producer is not None else None
        if op and op.kind == "native_dropout" and t.dtype == "bool":
            assert t.bytes == torch.Size(t.shape).numel()  # 1 byte per element
        # no seq x seq tensor survives to backward under fused attention
        assert t.shape[-2:] != [32, 32], t.name
    assert not any(t.is_parameter for t in p.saved_activations)
    assert len({t.name for t in p.saved_activations}) == len(p.saved_activations)


def test_bert_dropout_and_attention_under_cuda_kernels() -> None:
    p = analytic("bert-large-tiny")
    masks = [t for t in p.saved_activations if t.name.endswith("dropout:native_dropout:1")]
    assert all(t.dtype == "bool" for t in masks)
    assert masks and all(t.random for t in masks)
    attn = [op for op in p.ops if op.kind == "fused_attention"]
    assert len(attn) == 2 and all(op.random for op in attn)  # attention dropout is on
    # out, logsumexp and RNG state are the kernel's own saves; q, k, v come from the linears
    saved = [t for t in p.saved_activations if t.producer == attn[0].index]
    assert [t.dtype for t in saved] == ["bf16", "fp32", "int64"]


def test_causal_attention_counts_half() -> None:
    gpt = next(op for op in analytic("gpt2-xl-tiny").ops if op.kind == "fused_attention")
    bert = next(op for op in analytic("bert-large-tiny").ops if op.kind == "fused_attention")
    b, s, h = 2, 32, 64
    assert bert.flops == 4 * b * s * s * h
    assert gpt.flops == 2 * b * s * s * h


def test_views_resolve_to_their_base() -> None:
    """GPT-2 splits one c_attn output into q, k, v views: one saved storage."""
    p = analytic("gpt2-xl-tiny")
    qkv = p.by_name["transformer.h.0.attn.c_attn:addmm:0"]
    assert qkv.bytes == 2 * 32 * 3 * 64 * 2
    attn = next(op for op in p.ops if op.kind == "fused_attention")
    assert attn.inputs[:3] == [qkv.id] * 3


def test_first_backward_use_and_consumers() -> None:
    p = analytic("llama-7b-tiny")
    first_bwd = next(op.index for op in p.ops if op.phase == "backward")
    for t in p.saved_activations:
        if t.producer is None:
            continue
        assert t.first_backward_use is not None and t.first_backward_use >= first_bwd
        assert t.producer < first_bwd
        assert p.ops[t.first_backward_use].phase == "backward"


# -- analytic (native kernels) against measured --------------------------------------


def _saved(p: StepProfile) -> dict[str, int]:
    return {t.name: t.bytes for t in p.saved_activations}


@pytest.mark.parametrize("name", TINY)
def test_measured_matches_analytic_native(name: str) -> None:
    real, example = build_model(name, fake=False)
    measured = slackswap.profile(real, example, mode="measured", name=name)
    fake, example = build_model(name)
    native = slackswap.profile(fake, example, kernels="native", name=name)
    assert _saved(measured) == _saved(native)
    assert measured.fingerprint == native.fingerprint
    assert measured.device == "cpu" and measured.kernels == "native"
    assert all(op.time_s >= 0 for op in measured.ops)
    assert sum(op.time_s for op in measured.ops) > 0


def test_real_model_traced_analytically_equals_fake_build() -> None:
    real, example = build_model("gpt2-xl-tiny", fake=False)
    p = slackswap.profile(real, example, name="gpt2-xl-tiny")
    assert _saved(p) == _saved(analytic("gpt2-xl-tiny"))
    assert p.summary()["forward_flops"] == analytic("gpt2-xl-tiny").summary()["forward_flops"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([4, 8, 12]), depth=st.integers(1, 3),
       act=st.sampled_from([torch.nn.GELU, torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh]),
       batch=st.integers(1, 3))
def test_custom_models_measured_equals_analytic(width, depth, act, batch) -> None:
    torch.manual_seed(0)
    inner = TinyMLP(width, depth)
    for block in inner.blocks:
        block.act = act()
    model = WithMSE(inner)
    x = torch.randn(batch, 5, width)
    native = slackswap.profile(model, x, kernels="native")
    measured = slackswap.profile(model, x, mode="measured")
    assert _saved(native) == _saved(measured)
    # every block saves its own activations, the same bytes for each
    per_layer = native.summary()["saved_bytes_per_layer"]
    assert len(per_layer) == depth and len(set(per_layer)) == 1 and per_layer[0] > 0


# -- errors --------------------------------------------------------------------------


def test_forward_error_names_the_model() -> None:
    model, x = raises()
    with pytest.raises(ProfileError, match="model 'mine' raised in forward: ValueError: shape"):
        slackswap.profile(model, x, name="mine")


class _LayerDrop(torch.nn.Module):
    """Skips each layer when a draw falls under ``rate``, as OPT's LayerDrop does under
    transformers 5.17 (which draws at any rate, 0 included)."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            if torch.rand([]) < self.rate:
                continue
            x = torch.tanh(layer(x))
        return {"loss": x.sum()}


class _PositivePart(torch.nn.Module):
    """A boolean mask index: an output whose shape depends on the values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        return {"loss": h[h > 0].sum()}


@pytest.mark.parametrize(("factory", "line"), [
    (functools.partial(_LayerDrop, 0.0), "if torch.rand([]) < self.rate:"),
    (_PositivePart, 'return {"loss": h[h > 0].sum()}'),
])
def test_a_value_read_in_forward_is_refused_analytic_and_traced(factory, line: str) -> None:
    """NOTE [a model that reads a value]: analytic names the line and the mode that can
    profile it, in one line; traced runs the step and records the ops it took."""
    torch.manual_seed(0)
    model, x = factory(), torch.randn(3, 4)
    with pytest.raises(ProfileError) as e:
        slackswap.profile(model, x, "a100-80gb", name="mine")
    message = str(e.value)
    assert message.startswith("model 'mine' reads a tensor's value in forward (test_profile.py:")
    assert line in message and "mode='traced'" in message and "\n" not in message
    traced = slackswap.profile(model, x, "a100-80gb", mode="traced", kernels="native")
    forward = [op.name for op in traced.ops if op.phase == "forward"]
    assert forward.count("aten.addmm.default") == len([m for m in model.modules()
                                          if isinstance(m, torch.nn.Linear)])


@pytest.mark.parametrize("factory", [no_loss, frozen])
def test_no_differentiable_loss(factory) -> None:
    model, x = factory()
    with pytest.raises(ProfileError, match="loss"):
        slackswap.profile(model, x)


def test_loss_fn_for_models_without_loss() -> None:
    model, x = no_loss()
    p = slackswap.profile(model, x, loss_fn=lambda out: out["logits"].sum())
    assert p.summary()["backward_flops"] > 0


@pytest.mark.parametrize("mode", ["traced", "measured"])
def test_a_batch_that_requires_grad_is_left_as_it_was(mode: str) -> None:
    """Profiling runs the step on new leaves over the batch's storage: the caller's
    tensor gets no gradient and no hook (a hook left on it broke a later
    ``torch.autograd.grad`` through it, as a gradient penalty takes)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    slackswap.profile(model, x, loss_fn=lambda out: out.sum(), mode=mode)
    assert x.grad is None
    (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    grad.square().sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("mode", ["traced", "measured", "plan", "raised"])
def test_a_model_dropped_after_profiling_is_freed(mode: str) -> None:
    """``ModTracker``'s gradient hooks close over the graph's nodes and live in them, a
    cycle no collector frees (NOTE [ModTracker's gradient hooks hold the graph]): the
    profiled step's graph, and through it every parameter before the last layer, outlived
    a model dropped after ``profile`` or ``slackswap.plan(model, batch)``. Also after a
    step whose loss raised once its forward had registered them."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(inplace=True), torch.nn.Conv2d(4, 4, 3),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 3))
    x = torch.randn(2, 3, 8, 8)
    params = {n: weakref.ref(p) for n, p in model.named_parameters()}

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        if mode == "raised":
            raise RuntimeError("the loss failed")
        return out.square().mean()

    if mode == "raised":
        with pytest.raises(RuntimeError, match="the loss failed"):
            slackswap.profile(model, x, loss_fn=loss_fn, mode="traced")
    elif mode == "plan":
        slackswap.plan(model, x, budget=0.9, loss_fn=loss_fn, hardware="a100-80gb")
    else:
        slackswap.profile(model, x, loss_fn=loss_fn, mode=mode)
    del model
    gc.collect()
    assert [n for n, ref in params.items() if ref() is not None] == []


# -- pricing: views, causal attention, the stack (NOTE [stacks]) ----------------------


def test_unsafe_view_is_a_view() -> None:
    """matmul's ``_unsafe_view`` shares its input's storage: it launches no kernel."""
    views = [op for op in analytic("llama-7b-tiny").ops if op.kind == "_unsafe_view"]
    assert views
    for op in views:
        assert op.category == "free" and op.time_s == 0 and set(op.outputs) <= set(op.inputs)


@functools.cache
def _one_block(name: str, stack: str) -> StepProfile:
    from slackswap.core.hardware import load_hardware
    from slackswap.models import with_layers

    preset = with_layers(name, 1)
    model, example = build_model(preset)
    return slackswap.profile(model, example, load_hardware("h100-sxm", {"stack": stack}),
                             name=preset)


@pytest.mark.parametrize(("name", "causal"), [("gpt2-xl", True), ("bert-large", False)])
def test_attention_is_priced_causal_or_not(name: str, causal: bool) -> None:
    """One full-width block: each attention kernel at its roofline with the preset's
    efficiency for its mask (these kernels are compute-bound)."""
    from slackswap.core.hardware import load_hardware

    c = load_hardware("h100-sxm").compute
    eff = {"attention_forward": (c.attention_causal_forward_efficiency if causal
                                 else c.attention_forward_efficiency),
           "attention_backward": (c.attention_causal_backward_efficiency if causal
                                  else c.attention_backward_efficiency)}
    kernels = [op for op in _one_block(name, "eager").ops if op.category in eff]
    assert len(kernels) == 2
    for op in kernels:
        assert op.time_s == pytest.approx(op.flops / (989e12 * eff[op.category]))


def test_the_fused_stack_changes_memory_bound_times_only() -> None:
    """The same trace, the same compute kernels; memory-bound runs cost less in all (no
    run moves more than its ops did one by one)."""
    eager, fused = _one_block("gpt2-xl", "eager"), _one_block("gpt2-xl", "fused")
    assert [o.model_dump(exclude={"time_s"}) for o in eager.ops] == [
        o.model_dump(exclude={"time_s"}) for o in fused.ops]
    assert eager.tensors == fused.tensors
    for e, f in zip(eager.ops, fused.ops, strict=True):
        if e.category != "memory":
            assert e.time_s == f.time_s
    memory = [sum(o.time_s for o in p.ops if o.category == "memory") for p in (eager, fused)]
    assert 0 < memory[1] < 0.8 * memory[0]


def test_the_innermost_module_does_not_turn_on_hash_order() -> None:
    """In backward, sibling modules of equal path length can be active at once (the
    tracker holds a set): the one named is the same whatever the set's order, so a
    profile is the same in every process (it was not: Q's or V's projection, by the
    string hash seed)."""
    from types import SimpleNamespace

    from slackswap.profiling.naming import module_path

    active = ["Global", "M", "M.attn", "M.attn.query", "M.attn.value", "M.attn.key"]
    for shift in range(len(active)):
        tracker = SimpleNamespace(parents=active[shift:] + active[:shift])
        assert module_path(tracker, "M")() == "attn.value"  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["analytic", "traced"])
def test_a_module_the_model_does_not_register_places_its_ops_in_its_caller(mode: str) -> None:
    """A function made a module and kept out of ``named_modules`` (transformers 5.25's
    ``kernels`` dependency does so to Llama's rotary embedding), nested in another of its
    class: its ops are named in the registered module that calls it, as the runtime names
    them, so a plan of an analytic profile runs exactly; ``ModTracker``'s warning about
    the two same-named modules is not shown, and the warnings format is left as it was
    (NOTE [modules the model does not register])."""
    import copy
    import warnings

    from edge_cases import _Unregistered, unregistered_modules
    from torch._subclasses.fake_tensor import FakeTensorMode

    from slackswap.core.plan import Plan

    model, x, loss_fn = unregistered_modules()
    if mode == "analytic":
        with FakeTensorMode():
            traced = _Unregistered()
    else:
        traced = copy.deepcopy(model)
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        profile = slackswap.profile(traced, x, "a100-80gb", mode=mode, loss_fn=loss_fn,
                                    kernels="native")
    assert warnings.formatwarning is formatwarning
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    assert [n.split(":")[0] for n in names] == ["block.proj", *["block"] * 8, "(top)", "head"]

    def step(plan: Plan | None) -> list[torch.Tensor]:
        net = copy.deepcopy(model)
        with slackswap.apply(net, plan) if plan else torch.enable_grad():
            loss = loss_fn(net(x))
        loss.backward()
        return [loss.detach(), *(p.grad for p in net.parameters())]

    reference = step(None)
    for decision in ("offload", "recompute"):
        plan = Plan(fingerprint=profile.fingerprint, strategy=decision,
                    decisions={n: decision for n in names})
        assert all(torch.equal(a, b) for a, b in zip(step(plan), reference, strict=True))


def test_a_model_mod_tracker_cannot_follow_is_refused_with_that_reason() -> None:
    """Hugging Face Reformer's reversible layers make ``ModTracker``'s forward hook fail:
    the error names ModTracker, not the model, as what failed."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.ReformerConfig(
        vocab_size=100, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "local"], feed_forward_size=64, axial_pos_embds=False,
        max_position_embeddings=32, local_attn_chunk_length=8, is_decoder=True,
        use_cache=False,
    )
    model = transformers.ReformerModelWithLMHead(config).train()
    ids = torch.randint(0, 100, (2, 32))
    with pytest.raises(ProfileError, match="cannot profile model 'ReformerModelWithLMHead': "
                                           "PyTorch's ModTracker"):
        slackswap.profile(model, {"input_ids": ids, "labels": ids}, mode="traced")
