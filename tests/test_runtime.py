"""The runtime: gradients bit-identical to training without it, under any plan."""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap
from slackswap.core.plan import MIN_PLANNED_BYTES, Plan
from slackswap.errors import InputError
from slackswap.models import build_model
from slackswap.runtime.stats import RuntimeStats

NOT_PRESETS = ["gpt-neox-tiny", "distilbert-mlm-tiny"]
MODELS = ["bert-large-tiny", "gpt2-xl-tiny", "llama-7b-tiny", *NOT_PRESETS]


def _hf(name: str, fake: bool):
    """Models that are not presets, with dropout on: a GPT-NeoX causal LM, and a DistilBERT
    masked LM with padding and a label on every third token."""
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    if name == "gpt-neox-tiny":
        config, cls = transformers.GPTNeoXConfig(
            vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, hidden_dropout=0.1, attention_dropout=0.1, use_cache=False,
        ), transformers.GPTNeoXForCausalLM
    else:
        config, cls = transformers.DistilBertConfig(
            vocab_size=500, dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.1,
            attention_dropout=0.1,
        ), transformers.DistilBertForMaskedLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = cls(config)
    model.train()
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    if name == "gpt-neox-tiny":
        return model, {"input_ids": ids, "labels": ids.clone()}
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _build(name: str, fake: bool):
    if name in NOT_PRESETS:
        return _hf(name, fake)
    return build_model(name, fake=fake, dtype="fp32")


@functools.cache
def setup(name: str):
    fake, batch = _build(name, fake=True)
    profile = slackswap.profile(fake, batch, kernels="native", name=name)
    model, batch = _build(name, fake=False)
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    return profile, model, batch, names, run(model, batch)


def run(model, batch, plan=None, seed=0):
    torch.manual_seed(seed)  # the same dropout masks with and without the runtime
    model.zero_grad(set_to_none=True)
    if plan is None:
        loss = model(**batch).loss
    else:
        with slackswap.apply(model, plan):
            loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def custom_step(model, x, plan=None, net=None):
    """Loss and gradients of one step of a model returning ``{"loss": ...}``; ``net`` is
    what is called (a wrapper of ``model``, say)."""
    net = model if net is None else net
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    with slackswap.apply(net, plan) if plan else contextlib.nullcontext():
        loss = net(x)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_identical(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("decision", ["keep", "offload", "recompute"])
@pytest.mark.parametrize("name", MODELS)
def test_uniform_plans_are_bit_identical(name: str, decision: str) -> None:
    profile, model, batch, names, reference = setup(name)
    plan = Plan(fingerprint=profile.fingerprint, strategy=decision,
                decisions={n: decision for n in names})
    assert_identical(run(model, batch, plan), reference)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(MODELS))
def test_random_plans_are_bit_identical(data, name: str) -> None:
    profile, model, batch, names, reference = setup(name)
    decisions = {n: data.draw(st.sampled_from(["keep", "offload", "recompute"]), label=n)
                 for n in names}
    # reloads that may start at the first backward op: the runtime issues them there
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")
    prefetch = {n: first_backward for n, d in decisions.items() if d == "offload"}
    plan = Plan(fingerprint=profile.fingerprint, strategy="random", decisions=decisions,
                prefetch=prefetch if data.draw(st.booleans(), label="prefetch") else {})
    assert_identical(run(model, batch, plan), reference)
    assert_runs_as_simulated(profile, plan, stats_of(model, batch, plan, profile))


def planned_step(model, batch, plan, profile=None):
    """One step under ``plan``: (loss, gradients) and the runtime that ran it."""
    runtime = slackswap.apply(model, plan, profile=profile)
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    with runtime:
        loss = model(**batch).loss
    loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}), runtime


def stats_of(model, batch, plan, profile=None):
    return planned_step(model, batch, plan, profile)[1].stats


def assert_runs_as_simulated(profile, plan, stats) -> None:
    """The runtime did the work the simulator scheduled: the same ops re-run, the same
    bytes copied each way, the same activations reloaded, in the same order when the
    plan says when to start each reload (without a prefetch point, the runtime reloads
    when autograd unpacks, in autograd's order)."""
    simulated = slackswap.simulate(profile, plan)
    schedule = simulated.run.schedule
    rebuilt = sum(item.recompute for item in schedule.items)
    assert stats.recomputed_ops == rebuilt
    assert stats.offloaded_bytes == simulated.d2h_bytes
    assert stats.reloaded_bytes == simulated.h2d_bytes
    reloads = [profile.tensors[c.tensor].name for c in schedule.h2d]
    if all(name in plan.prefetch for name in reloads):
        assert stats.reload_order == reloads
    else:
        assert sorted(stats.reload_order) == sorted(reloads)


@pytest.mark.parametrize("kind", ["recompute-all", "mixed", "slackswap", "checkpoint-blocks",
                                  "checkpoint-offload"])
@pytest.mark.parametrize("name", MODELS)
def test_the_runtime_does_what_the_simulator_schedules(name: str, kind: str) -> None:
    """checkpoint-blocks keeps tensors autograd does not save (distilbert's block inputs)
    as checkpoints for rebuilds; the runtime holds them until the simulator frees them.
    checkpoint-offload copies them to the host and reloads them for the rebuilds."""
    profile, model, batch, names, _ = setup(name)
    if kind in ("slackswap", "checkpoint-blocks", "checkpoint-offload"):
        plan = slackswap.plan(profile, 0.75, strategy=kind)
    else:
        pick = ("recompute",) if kind == "recompute-all" else ("keep", "offload", "recompute")
        plan = Plan(fingerprint=profile.fingerprint, strategy=kind,
                    decisions={n: pick[i % len(pick)] for i, n in enumerate(names)})
    assert_runs_as_simulated(profile, plan, stats_of(model, batch, plan, profile))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(MODELS))
def test_offloaded_checkpoints_are_bit_identical(data, name: str) -> None:
    """Every block recomputed, the tensors autograd does not save each kept, offloaded
    (with or without a prefetch point) or left to be rebuilt: the same loss and
    gradients, and the work the simulator schedules."""
    profile, model, batch, names, reference = setup(name)
    decisions = {n: "recompute" for n in names}
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")
    prefetch = {}
    for n, t in sorted(profile.checkpointable.items()):
        choice = data.draw(st.sampled_from(["keep", "offload", "rebuild"]), label=n)
        if choice == "offload" and t.id in profile.changed_in_place:
            choice = "keep"
        if choice != "rebuild":
            decisions[n] = choice
        if choice == "offload" and data.draw(st.booleans(), label=f"prefetch {n}"):
            prefetch[n] = first_backward
    plan = Plan(fingerprint=profile.fingerprint, strategy="random", decisions=decisions,
                prefetch=prefetch)
    result, runtime = planned_step(model, batch, plan, profile)
    assert_identical(result, reference)
    assert_runs_as_simulated(profile, plan, runtime.stats)
    assert runtime.values.host == {} and runtime.values.back == {}
    assert runtime.values.held == {}


class _ChangedInPlace(torch.nn.Module):
    """A block input autograd does not save, changed in place after it is made."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        h.add_(1.0)
        return {"loss": self.b(torch.tanh(h)).pow(2).mean()}


def test_checkpoints_are_kept_or_offloaded_never_recomputed() -> None:
    """A plan keeps or offloads a tensor autograd does not save (and may prefetch it when
    offloaded), never recomputes it, and never offloads one forward changes in place
    later (its copy would not be the value a rebuild reads): one-line refusals."""
    profile = setup("llama-7b-tiny")[0]
    name = sorted(profile.checkpointable)[0]
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")

    def plan(decision: str, prefetch: dict[str, int] | None = None) -> Plan:
        return Plan(fingerprint=profile.fingerprint, strategy="x", decisions={name: decision},
                    prefetch=prefetch or {})

    plan("offload", {name: first_backward}).check(profile)
    plan("keep").check(profile)
    with pytest.raises(InputError, match=f"plan recomputes '{re.escape(name)}', which autograd"):
        plan("recompute").check(profile)
    with pytest.raises(InputError, match="a checkpoint it does not offload"):
        plan("keep", {name: first_backward}).check(profile)
    torch.manual_seed(0)
    changed = slackswap.profile(_ChangedInPlace(), torch.randn(8, 64))
    with pytest.raises(InputError, match="'a:addmm:0', a checkpoint forward changes in place"):
        Plan(fingerprint=changed.fingerprint, strategy="x",
             decisions={"a:addmm:0": "offload"}).check(changed)


def test_a_planned_step_moves_and_rebuilds() -> None:
    profile, model, batch, names, _ = setup("gpt2-xl-tiny")
    half = {n: ("offload" if i % 2 else "recompute") for i, n in enumerate(names)}
    _, runtime = planned_step(model, batch, Plan(fingerprint=profile.fingerprint,
                                                 strategy="x", decisions=half))
    assert runtime.stats.offloaded_bytes > 0
    assert runtime.stats.reloaded_bytes == runtime.stats.offloaded_bytes
    assert runtime.stats.recomputed_ops > 0


def test_repeated_steps_hold_nothing_and_repeat_exactly() -> None:
    """Every step under one runtime holds nothing after it and repeats the first exactly;
    live tensors do not grow past the warm-up's 10 steps. A step that leaves one tensor
    behind shows as growth over the 20 steps after it as over 90 (a step is about 0.35 s
    of CPU: 100 steps took 60 s of the test's 62 on two loaded cores, 30 take 22)."""
    profile, model, batch, names, reference = setup("bert-large-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})
    import gc

    def live_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance touches deprecated torch objects
            warnings.simplefilter("ignore")
            kinds = (torch.Tensor, torch.UntypedStorage)
            return sum(isinstance(o, kinds) for o in gc.get_objects())

    runtime = slackswap.apply(model, plan)
    for step in range(30):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with runtime:
            loss = model(**batch).loss
        loss.backward()
        assert runtime.values.host == {} and runtime.values.back == {} and runtime.values.held == {}
        assert runtime.values.pending == {} and runtime.values.handles == {}
        assert runtime.stats.resident_bytes == 0
        assert torch.equal(loss.detach(), reference[0])
        del loss
        # every storage the step made is gone, as the allocator sees it
        assert [n.name for n in runtime.state.nodes.values() if not n.storage.expired()] == []
        if step == 10:
            before = live_tensors()
    assert live_tensors() <= before  # no growth


def test_a_retained_graph_runs_backward_twice() -> None:
    """Host copies live as long as autograd's handles: a second backward through a
    retained graph reloads and rebuilds again, with the same gradients."""
    profile, model, batch, names, _ = setup("llama-7b-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})

    def twice(plan=None):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with slackswap.apply(model, plan) if plan else contextlib.nullcontext() as runtime:
            loss = model(**batch).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}), runtime

    planned, runtime = twice(plan)
    assert_identical(planned, twice()[0])
    once = slackswap.apply(model, plan)
    with once:
        loss = model(**batch).loss
    loss.backward()
    # the second pass reloads everything again (the plan's schedule covers the first)
    assert runtime.stats.reloaded_bytes >= 2 * once.stats.reloaded_bytes > 0
    del planned
    assert runtime.values.host == {} and runtime.values.back == {} and runtime.values.held == {}


class _ReadsTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors  # a second unpack of the same handle
        return grad * (x + again)


class _Square(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": _ReadsTwice.apply(torch.tanh(self.lin(x))).mean()}


def test_saved_tensors_read_twice_in_one_backward() -> None:
    torch.manual_seed(0)
    model, x = _Square(), torch.randn(32, 64)
    profile = slackswap.profile(model, x, kernels="native")
    names = [t.name for t in profile.saved_activations if t.producer is not None]

    for decision in ("offload", "recompute"):
        plan = Plan(fingerprint=profile.fingerprint, strategy=decision,
                    decisions={n: decision for n in names})
        assert_identical(custom_step(model, x, plan), custom_step(model, x))


def test_a_graph_dropped_without_backward_leaves_nothing_held() -> None:
    """What the runtime holds for a step lives as long as autograd's handles: a forward
    whose graph is dropped (evaluation with grad on, an exception) frees it all."""
    profile, model, batch, names, _ = setup("gpt2-xl-tiny")
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("keep", "offload", "recompute")[i % 3] for i, n in enumerate(names)},
                prefetch={n: first_backward for n in names[1::3]})
    runtime = slackswap.apply(model, plan, profile=profile)
    with runtime:
        loss = model(**batch).loss
    assert runtime.values.host and runtime.values.handles
    del loss
    assert runtime.values.host == {} and runtime.values.held == {} and runtime.values.pending == {}
    assert runtime.values.handles == {} and runtime.stats.resident_bytes == 0


def test_the_garbage_collector_is_restored() -> None:
    """It is paused in the forward block (NOTE [no cyclic GC in forward]) and until the
    step's backward has run, or its graph is dropped, or the next block opens (NOTE [no
    cyclic GC until backward]); at once on a refusal; never if the caller had paused it."""
    import gc

    profile, model, batch, names, _ = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={})
    with slackswap.apply(model, plan):
        assert not gc.isenabled()
        loss = model(**batch).loss
    assert not gc.isenabled()  # forward's records die in backward, uncollected
    loss.backward()
    assert gc.isenabled()
    with slackswap.apply(model, plan):
        loss = model(**batch).loss
    assert not gc.isenabled()
    del loss  # a graph dropped without backward
    assert gc.isenabled()
    with slackswap.apply(model, plan):
        first = model(**batch).loss
    with slackswap.apply(model, plan):  # (micro-batches: forwards, then backwards)
        assert not gc.isenabled()
        second = model(**batch).loss
    first.backward()
    assert gc.isenabled()
    second.backward()
    assert gc.isenabled()
    with torch.no_grad(), slackswap.apply(model, plan):  # nothing saved
        model(**batch)
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"), slackswap.apply(model, plan):
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with slackswap.apply(model, plan):
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


@pytest.mark.parametrize("decision", ["recompute", "offload"])
def test_gradient_accumulation(decision: str) -> None:
    """Two forwards, then two backwards: the second block neither rebuilds from nor
    offloads into what the first still holds (its host buffers are not the pool's)."""
    profile, model, batch, names, _ = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: decision for n in names})

    allocated = []  # host buffers allocated per accumulated step

    def two_micro_batches(with_plan: bool):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        losses, runtimes = [], []
        for _ in range(2):
            if with_plan:
                runtimes.append(slackswap.apply(model, plan, profile=profile))
                with runtimes[-1]:
                    losses.append(model(**batch).loss)
            else:
                losses.append(model(**batch).loss)
        for loss in losses:  # both forwards first, then both backwards
            loss.backward()
        allocated.append(sum(r.stats.host_buffers_allocated for r in runtimes))
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = two_micro_batches(False)
    for _ in range(2):
        planned = two_micro_batches(True)
        assert all(torch.equal(plain[n], planned[n]) for n in plain)
    # the pool keeps what both micro-batches held at once: the next step allocates none
    assert allocated[1:] == ([2 * sum(profile.by_name[n].bytes >= MIN_PLANNED_BYTES
                                      for n in names), 0] if decision == "offload" else [0, 0])


def test_host_buffers_are_reused_from_step_to_step() -> None:
    """NOTE [buffers held by events]: a training loop opening a block per step with one
    plan allocates host buffers in its first step only; the pool keeps no more than the
    plan offloads."""
    profile, model, batch, names, reference = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "offload" for n in names})
    allocated = []
    for _ in range(3):
        result, runtime = planned_step(model, batch, plan, profile)
        assert_identical(result, reference)
        allocated.append(runtime.stats.host_buffers_allocated)
    moved = [n for n in names if profile.by_name[n].bytes >= MIN_PLANNED_BYTES]
    planned_bytes = sum(profile.by_name[n].bytes for n in moved)
    assert runtime.stats.offloaded_bytes == planned_bytes
    assert allocated == [len(moved), 0, 0]
    assert runtime.values.copies.capacity == planned_bytes


def test_two_forwards_in_one_block_are_refused() -> None:
    profile, model, batch, names, _ = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "offload" for n in names})
    with pytest.raises(InputError, match="ran twice in one"), slackswap.apply(model, plan):
        model(**batch)
        model(**batch)


def test_a_model_that_checkpoints_itself_is_refused() -> None:
    model, batch = _build("gpt2-xl-tiny", fake=False)
    profile = slackswap.profile(model, batch, kernels="native")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={})
    enable = (getattr(model, "activation_checkpointing_enable", None)  # transformers 5
              or model.gradient_checkpointing_enable)
    enable()
    for attempt in (lambda: slackswap.profile(model, batch, kernels="native"),
                    lambda: slackswap.apply(model, plan).__enter__()):
        with pytest.raises(InputError, match="gradient checkpointing on"):
            attempt()


# the block's global module hooks are in place as the wrapper is called, and torch says they
# fire for the wrapper too: the runtime counts no wrapper's call (``apply``'s ``_wrappers``)
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_model_runs_eagerly_under_the_plan() -> None:
    """``torch.compile``'s wrapper names the same model; in the block compiled code runs
    eagerly (NOTE [compiled code runs eagerly in a block]), so gradients equal eager
    training's."""
    from factories import TinyMLP, WithMSE

    torch.manual_seed(0)
    model, x = WithMSE(TinyMLP(64, 2)), torch.randn(4, 8, 64)
    compiled = torch.compile(model)
    profile = slackswap.profile(compiled, x, kernels="native", hardware="a100-80gb")
    assert profile.fingerprint == slackswap.profile(model, x, kernels="native").fingerprint
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})

    assert_identical(custom_step(model, x, plan, net=compiled), custom_step(model, x))


def test_a_block_compiled_inside_the_model_runs_eagerly_under_the_plan() -> None:
    """A submodule whose forward is compiled runs eagerly in the block: Dynamo looks at no
    frame there (NOTE [compiled code runs eagerly in a block]; it would trace the runtime's
    hooks), so gradients equal eager training's; and the block leaves Dynamo nothing,
    so outside it the submodule compiles as it would without SlackSwap."""
    from factories import TinyMLP, WithMSE
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model, x = WithMSE(TinyMLP(64, 3)), torch.randn(4, 8, 64)
    profile = slackswap.profile(model, x, kernels="native", hardware="a100-80gb")
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})
    reference = custom_step(model, x)
    torch._dynamo.reset()
    counters.clear()
    model.model.blocks[1].compile(backend="eager")
    assert_identical(custom_step(model, x, plan), reference)
    assert not counters["frames"] and not counters["graph_break"]
    assert_identical(custom_step(model, x), reference)  # (Dynamo's eager backend)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_a_block_opened_in_compiled_code_is_refused_in_one_line() -> None:
    """Opened in a function torch.compile compiles, a block could not make that code eager
    (NOTE [compiled code runs eagerly in a block]): refused, leaving no block open."""
    from factories import TinyMLP, WithMSE

    from slackswap.runtime import block

    model, x = WithMSE(TinyMLP(16, 1)), torch.randn(2, 4, 16)
    profile = slackswap.profile(model, x, kernels="native", hardware="a100-80gb")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={})

    @torch.compile(backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        with slackswap.apply(model, plan):
            return model(x)["loss"]

    torch._dynamo.reset()
    with pytest.raises(InputError, match="the block is opened in code torch.compile runs"):
        step(x)
    assert not block._ACTIVE and gc.isenabled()
    with slackswap.apply(model, plan):  # and outside compiled code it opens
        model(x)["loss"].backward()


def test_a_distributed_data_parallel_model(tmp_path) -> None:
    """DDP's wrapper names the model inside; its gradient hooks run as without the plan."""
    import torch.distributed as dist
    from factories import TinyMLP, WithMSE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model, x = WithMSE(TinyMLP(64, 2)), torch.randn(4, 8, 64)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        profile = slackswap.profile(ddp, x, kernels="native")
        assert profile.fingerprint == slackswap.profile(model, x, kernels="native").fingerprint
        names = [t.name for t in profile.saved_activations if t.producer is not None]
        plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                    decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})
        assert_identical(custom_step(model, x, plan, net=ddp), custom_step(model, x, net=ddp))
        # the reducer goes before its process group: gloo's destructor can hang otherwise
        del ddp
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_no_grad_is_a_no_op() -> None:
    profile, model, batch, names, _ = setup("llama-7b-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "offload" for n in names})
    with torch.no_grad(), slackswap.apply(model, plan) as runtime:
        model(**batch)
    assert runtime.stats.offloaded_bytes == 0


def test_a_batch_of_another_shape_is_refused_before_anything_runs() -> None:
    profile, model, batch, names, _ = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "offload" for n in names})
    slackswap.apply(model, plan, profile=profile, batch=batch)  # the same shapes pass
    longer = {k: torch.cat([v, v], dim=1) for k, v in batch.items()}
    with pytest.raises(InputError, match=r"batch 'input_ids' of shape \[2, 32\], not \[2, 64\];"
                       r" re-plan for this batch, or let slackswap.auto"):
        slackswap.apply(model, plan, profile=profile, batch=longer)
    with pytest.raises(InputError, match=r"batch of other shapes or dtypes than "
                                         r"\[\[2, 64\], \[2, 64\]\] .*slackswap.auto"):
        slackswap.apply(model, plan, batch=longer)
    # by position, with the profile at hand: the shapes planned for and those given
    with pytest.raises(InputError, match=r"made for a batch of shapes \[\[2, 32\], \[2, 32\]\], "
                                         r"not \[\[2, 64\], \[2, 64\]\]; re-plan"):
        slackswap.apply(model, plan, profile=profile, batch=tuple(longer.values()))
    # at the model call, before its first op: nothing recorded, nothing offloaded
    for runtime in (slackswap.apply(model, plan, profile=profile), slackswap.apply(model, plan)):
        with pytest.raises(InputError, match="re-plan"), runtime:
            model(**longer)
        assert runtime.state.nodes == {} and runtime.stats.offloaded_bytes == 0
    with slackswap.apply(model, plan):  # the batch passed by position matches too
        model(batch["input_ids"], labels=batch["labels"]).loss.backward()


def test_a_plan_for_another_model_is_refused_before_anything_runs() -> None:
    other, _, _, other_names, _ = setup("bert-large-tiny")
    profile, model, batch, _, _ = setup("llama-7b-tiny")
    plan = Plan(fingerprint=other.fingerprint, strategy="x",
                decisions={n: "offload" for n in other_names})
    with pytest.raises(InputError, match="different model or batch shape"):
        slackswap.apply(model, plan, profile=profile)
    runtime = slackswap.apply(model, plan)
    with pytest.raises(InputError, match="different model"), runtime:
        model(**batch)
    assert runtime.stats.offloaded_bytes == 0
    model.eval()  # train/eval mode is part of what a plan is for
    same = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={})
    try:
        with pytest.raises(InputError, match="train/eval mode"), slackswap.apply(model, same):
            pass
    finally:
        model.train()


def test_a_plan_naming_what_the_step_does_not_make_is_refused() -> None:
    """The backstop for ids that differ though model and batch match (other kernels):
    refused as the block closes, before backward, or in backward when it runs inside."""
    profile, model, batch, _, _ = setup("llama-7b-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={"model.layers.0.mlp:nope:0": "offload"})
    for inside in (False, True):
        with pytest.raises(InputError, match="'model.layers.0.mlp:nope:0' .* did not produce"), \
                slackswap.apply(model, plan):
            loss = model(**batch).loss
            if inside:
                loss.backward()


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


@pytest.mark.parametrize("name", ["bert-large-tiny", "gpt2-xl-tiny", "llama-7b-tiny"])
def test_a_plan_traced_for_the_gpu_finds_its_tensors_here(name: str) -> None:
    """Ids from the analytic CUDA trace (``fused_attention``) match the kernel SDPA picks
    on this machine. Dropout is off: CPU dropout is a different op than CUDA's."""
    fake, batch = build_model(name, fake=True, dtype="fp32")
    profile = slackswap.profile(_without_dropout(fake), batch, kernels="cuda", name=name)
    assert any(op.kind == "fused_attention" for op in profile.ops)
    model, batch = build_model(name, fake=False, dtype="fp32")
    model = _without_dropout(model)
    names = [t.name for t in profile.saved_activations  # what a planner may plan
             if t.producer is not None and t.bytes >= MIN_PLANNED_BYTES]
    assert any(":attention:" in n for n in names)
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})
    reference = run(model, batch)
    assert_identical(run(model, batch, plan), reference)  # it raises on an id it misses


@pytest.mark.parametrize("name", NOT_PRESETS)
def test_one_call_plan_on_models_that_are_not_presets(name: str) -> None:
    """``slackswap.plan(model, batch)`` on a Hugging Face model as it comes: the plan
    carries its profile, so apply checks it and reloads at the prefetch points."""
    model, batch = _build(name, fake=False)
    reference = run(model, batch)
    plan = slackswap.plan(model, batch, budget=0.8, strategy="offload-only")
    assert "offload" in plan.decisions.values() and plan.prefetch
    result, runtime = planned_step(model, batch, plan)
    assert runtime.stats.prefetched > 0 and runtime.stats.late_reloads == 0
    # saved bytes it held never exceed the simulated peak (which adds temporaries)
    assert runtime.stats.peak_resident_bytes <= slackswap.simulate(plan._profile, plan).peak_bytes
    assert_identical(result, reference)
    assert_identical(run(model, batch, slackswap.plan(model, batch, budget=0.8)), reference)


def test_auto_plans_once_per_batch_shape() -> None:
    model, batch = _build("gpt-neox-tiny", fake=False)
    longer = {k: torch.cat([v, v[:, :8]], dim=1) for k, v in batch.items()}
    step = slackswap.auto(model, budget=0.8)
    for b in (batch, longer, batch):
        reference = run(model, b)
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with step(b):
            loss = model(**b).loss
        loss.backward()
        assert_identical((loss.detach(), {n: p.grad for n, p in model.named_parameters()}),
                         reference)
    assert len(step.plans) == 2


def test_plan_and_profile_files_reach_the_runtime(tmp_path) -> None:
    """What ``slackswap profile`` and ``slackswap plan`` write is what a training script
    loads: with the profile, reloads start at the plan's prefetch points."""
    profile, model, batch, _, reference = setup("gpt2-xl-tiny")
    plan = slackswap.plan(profile, 0.8, strategy="offload-only")
    plan.save(tmp_path / "plan.json")
    profile.save(tmp_path / "profile.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.prefetch
    result, runtime = planned_step(model, batch, loaded,
                                   slackswap.StepProfile.load(tmp_path / "profile.json"))
    assert runtime.stats.prefetched > 0 and runtime.stats.late_reloads == 0
    assert_identical(result, reference)


def test_autocast_bf16() -> None:
    fake, batch = _build("gpt2-xl-tiny", fake=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        profile = slackswap.profile(fake, batch, kernels="native")
    model, batch = _build("gpt2-xl-tiny", fake=False)
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    def step(plan=None):  # one autocast region a step: its weight-cast cache is per region
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run(model, batch, plan)

    reference = step()
    for decision in ("offload", "recompute"):
        plan = Plan(fingerprint=profile.fingerprint, strategy=decision,
                    decisions={n: decision for n in names})
        assert_identical(step(plan), reference)


class _Noisy(torch.nn.Module):
    """Random ops that are not dropout, known as random by their Generator argument, one
    of them drawing from a generator the model owns."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        self.generator = torch.Generator().manual_seed(7)  # the model's own generator

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        h = torch.tanh(h * torch.empty_like(h).log_normal_(0.0, 0.1))
        h = h + torch.poisson(torch.full_like(h, 0.5)) * 0.01
        keep = torch.bernoulli(torch.full_like(h, 0.9), generator=self.generator)
        return {"loss": torch.sigmoid(self.b(h * keep)).square().mean()}


def test_random_ops_other_than_dropout_replay_exactly() -> None:
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(16, 64)
    profile = slackswap.profile(model, x, kernels="native")
    names = [t.name for t in profile.saved_activations if t.producer is not None]

    plan = Plan(fingerprint=profile.fingerprint, strategy="recompute",
                decisions={n: "recompute" for n in names})
    model.generator.manual_seed(7)  # the model's own generator, the same for both steps
    planned = custom_step(model, x, plan)
    model.generator.manual_seed(7)
    assert_identical(planned, custom_step(model, x))


class _InPlaceOnViews(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        h[:, :8].mul_(2.0)  # in place on a slice
        h.view(4, 8, 32).transpose(0, 1)[0].add_(1.0)  # on a view of a view
        z = torch.nn.functional.dropout(h, 0.2) * h
        return {"loss": torch.tanh(self.b(z)).t().contiguous().square().mean()}


@pytest.mark.parametrize("decision", ["offload", "recompute"])
def test_in_place_ops_on_views_are_replayed(decision: str) -> None:
    torch.manual_seed(0)
    model, x = _InPlaceOnViews(), torch.randn(32, 32)
    profile = slackswap.profile(model, x, kernels="native")
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy=decision,
                decisions={n: decision for n in names})
    assert_identical(custom_step(model, x, plan), custom_step(model, x))


class _ConvBN(torch.nn.Module):
    """Batch norm updates its running statistics in forward, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.c2(torch.relu(self.bn(self.c1(x)))).square().mean()}


def test_rebuilding_leaves_buffers_as_training_without_it_does() -> None:
    """A rebuilt batch norm does not update the running statistics a second time."""
    torch.manual_seed(0)
    model, x = _ConvBN(), torch.randn(4, 3, 16, 16)
    profile = slackswap.profile(model, x, kernels="native")
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    reference = custom_step(model, x)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    for decision in ("recompute", "offload"):
        model.load_state_dict(start)
        plan = Plan(fingerprint=profile.fingerprint, strategy=decision,
                    decisions={n: decision for n in names})
        assert_identical(custom_step(model, x, plan), reference)
        assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items()), decision


def test_a_measured_profile_leaves_the_model_as_it_was() -> None:
    """Profiling runs a real step; gradients, batch-norm statistics and the RNG stream
    are as they were afterwards, so a plan can be made mid-training."""
    torch.manual_seed(0)
    model, x = _ConvBN(), torch.randn(4, 3, 16, 16)
    model(x)["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    slackswap.profile(torch.nn.Sequential(model, _Dropout()), x, mode="measured")
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


class _Dropout(torch.nn.Module):
    def forward(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.dropout(out["loss"], 0.5)}


class _MutatesAfterUse(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.lin(x))
        y = h * h  # saves h
        h.add_(1.0)  # changes h after it was read
        return {"loss": (y + h).sum()}


@pytest.mark.parametrize("decision", ["keep", "offload", "recompute"])
def test_a_saved_tensor_changed_in_place_fails_as_autograd_does(decision: str) -> None:
    """Saved-tensor hooks switch off autograd's version check; the runtime keeps it, so
    a step plain PyTorch refuses is refused under every decision, never silently run."""
    model, x = _MutatesAfterUse(), torch.randn(8, 64)
    profile = slackswap.profile(model, x, kernels="native")
    [name] = [t.name for t in profile.saved_activations if t.name.endswith(":relu:0")]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        custom_step(model, x)
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={name: decision})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        custom_step(model, x, plan)


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        small = self.second(torch.tanh(self.first(x)))  # 8 x 2: too small to plan
        return {"loss": (small * small).sum()}


@pytest.mark.parametrize("changed", ["parameter", "batch input", "small activation"])
@pytest.mark.parametrize("decision", ["keep", "offload", "recompute"])
def test_what_the_plan_leaves_alone_keeps_autograds_version_check(
        changed: str, decision: str) -> None:
    """Tensors the runtime leaves as autograd saved them (parameters, the batch, ones too
    small to plan) are still checked: changed in place between forward and backward,
    backward fails as it does without slackswap instead of using the new values (or a
    rebuild that would read the changed input stops first)."""
    model, x = _TwoLayers(), torch.randn(8, 64, requires_grad=True)
    profile = slackswap.profile(model, x, kernels="native")
    [name] = [t.name for t in profile.saved_activations if t.name.endswith(":tanh:0")]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions={name: decision})
    for runtime in (contextlib.nullcontext(), slackswap.apply(model, plan)):
        with runtime:
            out = model(x)
        with torch.no_grad():
            if changed == "parameter":
                model.second.weight.mul_(2)
            elif changed == "batch input":
                x.mul_(2)
            else:
                out["loss"].grad_fn.next_functions[0][0]._saved_self.mul_(2)
        with pytest.raises((RuntimeError, InputError),
                           match="modified by an inplace operation|changed in place"):
            out["loss"].backward()


def test_reloads_start_at_their_prefetch_points() -> None:
    profile, model, batch, names, reference = setup("gpt2-xl-tiny")
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "offload" for n in names},
                prefetch={n: first_backward for n in names})
    result, runtime = planned_step(model, batch, plan, profile)
    assert runtime.stats.prefetched > 0 and runtime.stats.late_reloads == 0
    assert runtime.stats.reloaded_bytes == runtime.stats.offloaded_bytes
    assert_identical(result, reference)


def test_stats_count_resident_bytes_stalls_and_recompute() -> None:
    profile, model, batch, names, _ = setup("llama-7b-tiny")
    saved = sum(t.bytes for t in profile.saved_activations
                if t.producer is not None and t.bytes >= MIN_PLANNED_BYTES)
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")

    def stats(decision: str, prefetch_at: int | None = None, every: int = 1):
        plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                    decisions={n: decision for n in names[::every]},
                    prefetch={} if prefetch_at is None else {n: prefetch_at for n in names})
        _, runtime = planned_step(model, batch, plan, profile)
        assert runtime.stats.resident_bytes == 0  # all released by the end of backward
        return runtime.stats

    keep = stats("keep")
    assert keep.peak_resident_bytes == saved  # everything saved, at the end of forward
    assert keep.stalls == keep.recomputed_ops == 0 and keep.recompute_s == 0.0

    all_at_once = stats("offload", prefetch_at=first_backward)
    assert all_at_once.peak_resident_bytes == saved  # everything back before backward's op 1
    assert all_at_once.stalls == 0 and all_at_once.stall_s == 0.0

    late = stats("offload")
    assert 0 < late.peak_resident_bytes < saved
    assert late.stalls == late.late_reloads > 0 and late.stall_s > 0.0

    # every other one: rebuilds start from kept tensors (rebuilding everything would
    # bring all of it back at backward's first op, as the simulator also says)
    rebuilt = stats("recompute", every=2)
    assert 0 < rebuilt.peak_resident_bytes < saved
    assert rebuilt.recomputed_ops > 0 and rebuilt.recompute_s > 0.0


def test_measured_peak_matches_the_simulated_peak() -> None:
    """MemTracker, not the runtime, measures activation memory (forward activations plus
    backward temporaries, weight gradients excluded as model state): within 1% + 4 KiB of
    the simulated peak, for keep-all, recompute and offload plans. On a CPU host copies
    share the device's memory, so the tracker skips the runtime's copies to the host; a
    reloaded buffer counts again from the moment backward reads it."""
    from factories import TinyMLP, WithMSE
    from memory_tracking import ActivationMemory

    torch.manual_seed(0)
    model, x = WithMSE(TinyMLP(256, 4)), torch.randn(16, 64, 256)
    profile = slackswap.profile(model, x, kernels="native")

    def measured_peak(plan: Plan) -> int:
        tracker = ActivationMemory(model, x)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker, slackswap.apply(model, plan, profile=profile):  # with prefetch
                loss = model(x)["loss"]
                loss.backward()
        return tracker.peak

    keep = measured_peak(Plan.keep_all(profile))
    assert keep <= profile.keep_all_peak * 1.01 + 4096
    for strategy in ("recompute-only", "offload-only", "slackswap"):
        plan = slackswap.plan(profile, 0.6, strategy=strategy)
        simulated = slackswap.simulate(profile, plan).peak_bytes
        assert simulated <= 0.6 * profile.keep_all_peak
        measured = measured_peak(plan)
        assert measured <= simulated * 1.01 + 4096, strategy
        assert measured < 0.7 * keep, strategy  # the memory really went


def test_the_runtime_package_names_the_block_whatever_was_imported_first() -> None:
    import importlib
    import pkgutil

    import slackswap.runtime as runtime

    for module in pkgutil.iter_modules(runtime.__path__):
        importlib.import_module(f"slackswap.runtime.{module.name}")
    from slackswap.runtime import RuntimeStats as Stats
    from slackswap.runtime import apply as block

    assert block is slackswap.apply and isinstance(block, type)
    assert Stats is RuntimeStats


def test_the_model_is_checked_every_step_after_the_walk_is_cached() -> None:
    """NOTE [the model checked in one walk]: what a block learned of a model in an earlier
    step is reused only while nothing the checks read has changed; each change between
    steps is still refused, and a parameter replaced by another of its shape is the one
    this step trains."""
    from slackswap.profiling.step import model_state
    from slackswap.runtime.block import _Walk

    model, batch = _build("gpt2-xl-tiny", fake=False)
    # the one walk gives what named_modules() and model_state give, in their order
    walk = _Walk(model)
    assert [m for _, m in model.named_modules()] == walk.modules
    state = model_state(model, list(model.named_modules()))
    assert [id(t) for t in state.values()] == [id(t) for t in walk.tensors]
    profile = slackswap.profile(model, batch, kernels="native")
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: "recompute" for n in names[:3]})
    run(model, batch, plan)  # the walk is cached now
    attention = model.transformer.h[0].attn

    def untied() -> None:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())

    changes = {
        "which parameters train": lambda: attention.c_attn.weight.requires_grad_(False),
        "parameter shapes": lambda: setattr(attention.c_attn, "bias", torch.nn.Parameter(
            torch.zeros(attention.c_attn.bias.numel() + 1))),
        "its modules": lambda: setattr(model.transformer.h[0], "mlp", torch.nn.Identity()),
        "tied weights": untied,
        "train/eval mode": lambda: model.eval(),
    }
    for change in changes.values():  # (the keys say what changed)
        model, batch = _build("gpt2-xl-tiny", fake=False)
        run(model, batch, plan)
        attention = model.transformer.h[0].attn
        change()
        with pytest.raises(InputError, match="different model"), slackswap.apply(model, plan):
            model(**batch)
    # the same shapes, another tensor: this step's parameter gets the gradient
    model, batch = _build("gpt2-xl-tiny", fake=False)
    run(model, batch, plan)
    weight = model.transformer.h[1].mlp.c_fc.weight
    model.transformer.h[1].mlp.c_fc.weight = torch.nn.Parameter(weight.detach() * 0.5)
    weight.grad = None
    expected_loss, expected = run(model, batch)
    loss, grads = run(model, batch, plan)
    assert weight.grad is None  # the old parameter is not this step's
    assert torch.equal(loss, expected_loss) and expected.keys() == grads.keys()
    assert all(torch.equal(expected[n], grads[n]) for n in expected)
