"""The runtime on model families it was not built around (:mod:`zoo`) and on PyTorch's own
edge cases for saved-tensor hooks and checkpointing (:mod:`edge_cases`).

Every step under a plan either matches the same step without slackswap bit for bit (loss,
every gradient, parameters, buffers, the batch, the CPU RNG state after the step, and the
modules' train mode), or is refused with :class:`slackswap.InputError` before the model
runs, leaving model, batch and RNG as they were. Plans: every strategy at three budgets,
all-offload, all-recompute, and mixes drawn by hypothesis. The default run is a fast tier;
``pytest -m full`` runs the whole matrix.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import edge_cases
import pytest
import torch
import zoo
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import slackswap
from slackswap import InputError, Plan, StepProfile
from slackswap.core.hardware import load_hardware
from slackswap.errors import PathNotice
from slackswap.planners import smallest_feasible_budget
from slackswap.planners.context import PlanContext
from slackswap.runtime import recording

assert not zoo.MODELS.keys() & edge_cases.MODELS.keys()
MODELS: dict[str, Callable[[], Any]] = {**zoo.MODELS, **edge_cases.MODELS}
# refused when profiled, with the library's own error: nothing to plan or run
REFUSED = {"grad_in_forward": "backward inside its forward pass"}
NAMES = [name for name in MODELS if name not in REFUSED]
# models whose step draws random numbers (dropout, drop path, noise): a seed changes the loss
RANDOM = ["lstm", "gru", "cnn_bn_inplace", "vit", "unet", "t5", "bart", "mixtral", "deberta",
          "wav2vec2", "hubert", "wav2vec2_conformer", "perceiver", "funnel", "switch",
          "longformer", "bigbird_full",
          "bigbird_sparse", "gnn", "lora", "parametrizations", "diffusers_unet",
          "multihead_attention",
          "custom_function", "targets_loss_fn", "random_in_function", "segformer", "swin",
          "bloom", "efficientnet_channels_last"]
# steps PyTorch has no double backward for (a CTC loss; CPU flash attention, which
# diffusers' attention processor and SegFormer call through SDPA; hardsigmoid's backward,
# in squeeze and excite): their "double" steps are skipped
NO_DOUBLE = {"wav2vec2", "hubert", "wav2vec2_conformer", "diffusers_unet", "segformer",
             "efficientnet_channels_last"}
# models whose saved shapes follow their random draws (Switch routes tokens to experts after
# dropout and router jitter): profiled under the step's seed, so the plan's shapes are the
# step's; a step with other draws is test_a_plan_meets_other_routing's
SAME_DRAWS = {"switch"}
BUDGETS = [0.7, 0.5, 0.3]
SEED = 0
Kind = Literal["backward", "grad", "double"]


@dataclass
class Case:
    """One model: its pristine copy (never run), batch, loss_fn, profile and plan targets."""

    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[[Any], torch.Tensor] | None
    profile: StepProfile
    names: list[str]  # saved activations a plan may keep, offload or recompute
    checkpoints: list[str]  # unsaved activations a plan may only keep


@functools.cache
def built(name: str) -> tuple[torch.nn.Module, Any, Callable[[Any], torch.Tensor] | None]:
    """The model as its factory makes it: never run, copied for every step."""
    return MODELS[name]()


@functools.cache
def case(name: str) -> Case:
    model, batch, loss_fn = built(name)
    if name in SAME_DRAWS:
        torch.manual_seed(SEED)
    # traced: one real step, as ``slackswap.plan(model, batch)`` profiles on a CPU (a fake
    # trace cannot follow branches on tensor values, such as BART checking its mask)
    profile = slackswap.profile(copy.deepcopy(model), copy.deepcopy(batch), mode="traced",
                                loss_fn=loss_fn)
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    return Case(model, batch, loss_fn, profile, names, sorted(profile.checkpointable))


def _call(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss if loss is not None else loss_fn(output)


def _tensors(batch: Any) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return {"input": batch}
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch)
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor)}


def _state(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor | None]:
    """What a step may leave behind besides its outputs: gradients, parameters, buffers,
    the batch, the CPU RNG state."""
    values: dict[str, torch.Tensor | None] = {}
    for n, p in model.named_parameters():
        values[f"grad {n}"] = None if p.grad is None else p.grad.detach().clone()
        values[f"parameter {n}"] = p.detach().clone()
    for n, b in model.named_buffers():
        values[f"buffer {n}"] = b.detach().clone()
    for n, t in _tensors(batch).items():
        values[f"batch {n}"] = t.detach().clone()
    values["rng"] = torch.get_rng_state()
    return values


def _modes(model: torch.nn.Module) -> dict[str, bool]:
    return {n: m.training for n, m in model.named_modules()}


def _finish(model: torch.nn.Module, loss: torch.Tensor, kind: Kind) -> dict[str, Any]:
    """The backward half of a step: ``loss.backward()``, ``torch.autograd.grad``, or a
    gradient penalty's backward through ``create_graph=True`` gradients."""
    out: dict[str, Any] = {"loss": loss.detach().clone()}
    if kind == "backward":
        loss.backward()
        return out
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=kind == "double", allow_unused=True)
    out.update({f"autograd.grad {n}": None if g is None else g.detach().clone()
                for n, g in zip(names, grads, strict=True)})
    if kind == "double":
        penalty = sum(g.square().sum() for g in grads if g is not None)
        out["penalty"] = penalty.detach().clone()
        penalty.backward()
    return out


@functools.cache
def reference(name: str, kind: Kind = "backward", seed: int = SEED) -> dict[str, Any]:
    """The step without slackswap, run twice: the harness needs it deterministic."""
    runs = []
    for _ in range(2):
        model, batch, loss_fn = map(copy.deepcopy, built(name))
        torch.manual_seed(seed)
        out = _finish(model, _loss(_call(model, batch), loss_fn), kind)
        runs.append({**out, **_state(model, batch), "modes": _modes(model)})
    _assert_same(runs[1], runs[0], "the step without slackswap is not deterministic: ")
    return runs[0]


class Refused(UserWarning):
    """The runtime refused a plan before the model ran: allowed, and listed in the summary."""


class _Calls:
    """Counts calls of the model's submodules (its own forward may be refused first)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        for _, m in list(model.named_modules())[1:]:
            m.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1


def planned(name: str, plan: Plan, kind: Kind = "backward", seed: int = SEED
            ) -> tuple[dict[str, Any] | None, slackswap.apply | None]:
    """One step under ``plan`` and the runtime that ran it; (None, None) when the runtime
    refused it before the model ran."""
    c = case(name)
    model, batch = copy.deepcopy(c.model), copy.deepcopy(c.batch)
    calls = _Calls(model)
    torch.manual_seed(seed)
    before = _state(model, batch)
    try:
        runtime = slackswap.apply(model, plan, profile=c.profile, verify=True)
        with runtime:  # the loss too: a loss_fn's ops are part of the profiled step
            loss = _loss(_call(model, batch), c.loss_fn)
    except InputError as e:
        assert calls.count == 0, f"refused after {calls.count} module calls: {e}"
        _assert_same(_state(model, batch), before, f"refused ({e}) but changed ")
        warnings.warn(Refused(f"{name}: {e}"), stacklevel=2)
        return None, None
    # the profiled draws: a step that left the profiled path (and ran as plain PyTorch)
    # would compare equal without testing the plan
    assert seed != SEED or not runtime.stats.off_path, f"{name}: off the profiled path"
    out = _finish(model, loss, kind)
    return {**out, **_state(model, batch), "modes": _modes(model)}, runtime


def _differ(a: torch.Tensor | None, b: torch.Tensor | None) -> str | None:
    if a is None or b is None:
        return None if a is b else f"{'None' if a is None else 'a tensor'}, expected " + (
            "None" if b is None else "a tensor")
    if (a.dtype, a.shape, a.is_conj()) != (b.dtype, b.shape, b.is_conj()):
        return f"{a.dtype} {list(a.shape)} conj={a.is_conj()}, expected {b.dtype} " \
               f"{list(b.shape)} conj={b.is_conj()}"
    if torch.equal(a, b):
        return None
    if a.is_floating_point() or a.is_complex():
        diff = (a - b).abs()
        return f"max |diff| {diff.max().item():.3g} at {diff.argmax().item()} of {a.numel()}"
    return f"{int((a != b).sum())} of {a.numel()} elements differ"


def _assert_same(got: dict[str, Any], want: dict[str, Any], what: str = "") -> None:
    assert got.keys() == want.keys(), f"{what}keys {sorted(got.keys() ^ want.keys())}"
    bad = {k: d for k in want if k != "modes" and (d := _differ(got[k], want[k]))}
    assert not bad, f"{what}{len(bad)} differ: " + "; ".join(f"{k}: {d}" for k, d in bad.items())
    if "modes" in want:
        flipped = [m for m, on in want["modes"].items() if got["modes"].get(m) != on]
        assert not flipped, f"{what}train/eval mode changed for {flipped}"


def check(name: str, plan: Plan, kind: Kind = "backward", seed: int = SEED
          ) -> slackswap.apply | None:
    """The step under ``plan`` is the step without slackswap, or refused before it ran."""
    got, runtime = planned(name, plan, kind, seed)
    if got is not None:
        _assert_same(got, reference(name, kind, seed))
    return runtime


def uniform(name: str, decision: str) -> Plan:
    """The same decision for every saved activation."""
    c = case(name)
    return Plan(fingerprint=c.profile.fingerprint, strategy="x",
                decisions={n: decision for n in c.names})


def mixed(name: str) -> Plan:
    """Keep, offload, recompute, keep, ... in profile order."""
    c = case(name)
    return Plan(fingerprint=c.profile.fingerprint, strategy="x",
                decisions={n: ("keep", "offload", "recompute")[i % 3]
                           for i, n in enumerate(c.names)})


def strategy_plan(name: str, strategy: str, budget: float | int) -> Plan:
    """The strategy's plan; where the budget is out of reach of small models, at the
    smallest budget a plan is known to reach, or else at the peak of moving every
    activation one way with no limit (which a baseline that cannot wait for its
    offloads still reaches); skipped where the strategy has none even there. From the
    test run's plan cache (NOTE [plan cache]): ``test_memory_zoo`` plans the same traced
    profiles at the same budgets, and either file's workers plan each other's again."""
    profile = case(name).profile
    try:
        return slackswap.plan(profile, budget, strategy=strategy, cached=True)
    except InputError:
        pass
    ctx = PlanContext(profile, load_hardware(profile.hardware), profile.keep_all_peak)
    names = [c.name for c in ctx.candidates]
    budgets = {smallest_feasible_budget(profile)} | {
        slackswap.simulate(profile, ctx.plan("all", {n: d for n in names})).peak_bytes
        for d in ("recompute", "offload")}
    for least in sorted(budgets):
        try:
            return slackswap.plan(profile, least, strategy=strategy, cached=True)
        except InputError as e:
            error = e
    pytest.skip(f"{strategy} has no plan at {budget} nor at {sorted(budgets)} B: {error}")


def drawn(data: st.DataObject, name: str) -> Plan:
    """A decision drawn for every saved activation; some unsaved ones kept as checkpoints."""
    c = case(name)
    decisions = {n: data.draw(st.sampled_from(["keep", "offload", "recompute"]), label=n)
                 for n in c.names}
    decisions.update({n: "keep" for n in c.checkpoints if data.draw(st.booleans(), label=n)})
    return Plan(fingerprint=c.profile.fingerprint, strategy="random", decisions=decisions)


_HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                         HealthCheck.data_too_large])
# The fast tier reports the first failing plan as drawn: shrinking a plan of a hundred
# decisions re-runs the step hundreds of times. The full tier shrinks.
_NO_SHRINK = dict(_HYPOTHESIS, phases=[Phase.explicit, Phase.reuse, Phase.generate])
full = pytest.mark.full

# -- fast tier ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RANDOM)
def test_the_reference_step_draws_random_numbers(name: str) -> None:
    """Dropout is on in these models: another seed gives another loss, so bit-identity
    under a plan covers the RNG replay."""
    assert all(_modes(built(name)[0]).values())
    assert not torch.equal(reference(name, seed=1)["loss"], reference(name)["loss"])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_models_the_library_refuses_are_refused_when_profiled(name: str) -> None:
    model, batch, loss_fn = built(name)
    with pytest.raises(InputError, match=REFUSED[name]):
        slackswap.profile(copy.deepcopy(model), copy.deepcopy(batch), mode="traced",
                          loss_fn=loss_fn)
    with pytest.raises(InputError, match=REFUSED[name]):
        slackswap.profile(copy.deepcopy(model), copy.deepcopy(batch), kernels="native",
                          loss_fn=loss_fn)


@pytest.mark.parametrize("decision", ["offload", "recompute"])
@pytest.mark.parametrize("name", NAMES)
def test_uniform_plans(name: str, decision: str) -> None:
    runtime = check(name, uniform(name, decision))
    if runtime is not None:  # it did move something (tensors under 1 KiB never move)
        stats = runtime.stats
        assert (stats.offloaded_bytes if decision == "offload" else stats.recomputed_ops) > 0


# the asynchronous (CUDA) branch, its device calls stood in for (NOTE [stand-ins for the
# device calls]): host buffers laid out as the tensors they copy (NOTE [host copies laid
# out as their tensors]) over every dtype, layout and view the zoo saves; a few in the
# fast tier, every model under -m full
ASYNC_FAST = ["complex_tensors", "integer_tensors", "efficientnet_channels_last",
              "storage_saved_twice", "inplace_on_view", "mark_dirty", "sparse", "lstm"]


@pytest.mark.parametrize("name", [n if n in ASYNC_FAST else pytest.param(n, marks=full)
                                  for n in NAMES])
def test_offload_plans_on_the_asynchronous_branch(name: str) -> None:
    from collections import Counter

    from slackswap.runtime.streams import stand_ins

    calls: Counter = Counter()
    with stand_ins(calls, "behind"):
        runtime = check(name, uniform(name, "offload"))
    if runtime is not None and runtime.stats.offloaded_bytes:
        assert calls["copy"] > 0  # it took the asynchronous branch


def test_a_rebuild_makes_again_an_input_backward_is_done_with() -> None:
    """Mamba: each input projection's copy recomputed, the SiLU output it copies offloaded.
    Backward has read that output for the last time before the copy is rebuilt, so the
    rebuild makes it again (as the simulator schedules it), exactly, where it used to
    stop half way through backward."""
    c = case("mamba")
    decisions = {n: "offload" for n in c.names if n.endswith("mixer:silu:0")}
    decisions |= {n: "recompute" for n in c.names if n.endswith("x_proj:clone:0")}
    assert len(decisions) == 4
    for n in decisions:
        assert n in c.profile.recomputable or decisions[n] == "offload"
    runtime = check("mamba", Plan(fingerprint=c.profile.fingerprint, strategy="x",
                                  decisions=decisions))
    assert runtime is not None and runtime.stats.recomputed_ops > 2


def test_a_plan_meets_other_routing() -> None:
    """Switch under another seed: other tokens reach each expert, so the saves a plan
    offloads have other shapes than in its profile. The step leaves the profiled path
    part way through forward and runs again as plain PyTorch from the RNG and state the
    model was called with (NOTE [a step off the profiled path]), said in one line."""
    with pytest.warns(PathNotice, match="different code path than in the profiled step"):
        runtime = check("switch", uniform("switch", "offload"), seed=SEED + 1)
    assert runtime is not None and runtime.stats.off_path


@pytest.mark.parametrize("name", ["longformer", pytest.param("bigbird_sparse",
                                                          marks=pytest.mark.heavy)])
def test_the_planner_refuses_no_plan_of_its_own(name: str) -> None:
    """A budget the model can reach is planned; one it cannot is refused as out of reach,
    never with the runtime's refusal of a plan the pipeline made."""
    for budget in (0.7, 0.5):
        try:
            slackswap.plan(case(name).profile, budget)
        except InputError as e:
            assert "fits no plan" in str(e), e


# ``heavy``: the models whose planned step takes 6 to 12 s on two loaded cores (each still
# runs random and uniform plans in the default run)
HALF_HEAVY = {"bigbird_sparse", "hubert", "funnel", "vit", "multihead_attention", "bart",
              "wav2vec2", "wav2vec2_conformer", "bigbird_full", "unet"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy)
                                  if n in HALF_HEAVY else n for n in NAMES])
def test_slackswap_at_half_the_peak_or_the_least_it_reaches(name: str) -> None:
    """Small models often cannot reach half their peak: then the smallest feasible budget,
    so every model runs one planned step in the fast tier."""
    profile = case(name).profile
    budget = max(0.5 * profile.keep_all_peak, smallest_feasible_budget(profile))
    check(name, strategy_plan(name, "slackswap", int(budget)))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=3, **_NO_SHRINK)
@given(data=st.data())
def test_random_plans(name: str, data: st.DataObject) -> None:
    check(name, drawn(data, name))


FAST_DOUBLE = ["vit", "custom_function", "storage_saved_twice", "complex_tensors"]


@pytest.mark.parametrize("kind", ["grad", "double"])
@pytest.mark.parametrize("name", FAST_DOUBLE)
def test_autograd_grad_and_double_backward(name: str, kind: Kind) -> None:
    """``torch.autograd.grad`` instead of ``loss.backward()``, and a gradient penalty's
    backward through ``create_graph=True`` gradients."""
    for plan in (uniform(name, "offload"), uniform(name, "recompute")):
        check(name, plan, kind)


# -- full matrix ------------------------------------------------------------------------------


@full
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("strategy", sorted(slackswap.STRATEGIES))
@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_and_budget(name: str, strategy: str, budget: float) -> None:
    check(name, strategy_plan(name, strategy, budget))


@full
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, **_HYPOTHESIS)
@given(data=st.data())
def test_many_random_plans(name: str, data: st.DataObject) -> None:
    check(name, drawn(data, name))


@full
@pytest.mark.parametrize("plan", ["offload", "recompute", "mixed"])
@pytest.mark.parametrize("kind", ["grad", "double"])
@pytest.mark.parametrize("name", NAMES)
def test_autograd_grad_and_double_backward_everywhere(name: str, kind: Kind, plan: str) -> None:
    if kind == "double" and name in NO_DOUBLE:
        pytest.skip("no double backward for its loss in PyTorch")
    check(name, mixed(name) if plan == "mixed" else uniform(name, plan), kind)


@full
@pytest.mark.parametrize("kind", ["grad", "double"])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8, **_HYPOTHESIS)
@given(data=st.data())
def test_random_plans_with_autograd_grad_and_double_backward(
    name: str, kind: Kind, data: st.DataObject
) -> None:
    if kind == "double" and name in NO_DOUBLE:
        pytest.skip("no double backward for its loss in PyTorch")
    check(name, drawn(data, name), kind)


def _autocast_step(name: str, plan: Plan | None = None,
                   profile: StepProfile | None = None) -> dict[str, Any]:
    """One step under CPU bf16 autocast (the plan's runtime inside it, as in a training
    loop): loss, gradients, parameters, RNG state."""
    model, batch, loss_fn = map(copy.deepcopy, built(name))
    torch.manual_seed(SEED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if plan is None:
            loss = _loss(_call(model, batch), loss_fn)
        else:
            with slackswap.apply(model, plan, profile=profile, verify=True):
                loss = _loss(_call(model, batch), loss_fn)
    return {**_finish(model, loss, "backward"), **_state(model, batch)}


@pytest.mark.parametrize("decision", ["offload", "recompute", "mixed"])
@pytest.mark.parametrize("name", ["t5", "deberta", "mamba"])
def test_plans_under_autocast(name: str, decision: str) -> None:
    """Under bf16 autocast, with the profile traced under it too: the step is the one
    without slackswap, bit for bit (recorded ops carry autocast's casts and are replayed
    as they ran)."""
    model, batch, loss_fn = map(copy.deepcopy, built(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        profile = slackswap.profile(model, batch, mode="traced", loss_fn=loss_fn)
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    decisions = {n: ("keep", "offload", "recompute")[i % 3] if decision == "mixed" else decision
                 for i, n in enumerate(names)}
    plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions=decisions)
    _assert_same(_autocast_step(name, plan, profile), _autocast_step(name))


@pytest.mark.parametrize("name", ["vit", "segformer"])
def test_a_step_under_another_autocast_than_its_plan_is_refused_saying_so(name: str) -> None:
    """A plan made outside autocast, its step run under bf16 autocast: every activation is
    saved in another dtype, so the step is refused in one line that names autocast (not
    a generic "another batch or code path"), leaving model, batch and RNG as they were."""
    c = case(name)
    model, batch = copy.deepcopy(c.model), copy.deepcopy(c.batch)
    torch.manual_seed(SEED)
    before = _state(model, batch)
    with pytest.raises(InputError, match="saved a bf16 tensor .* as fp32: .* another "
                       "torch.autocast"), torch.autocast("cpu", dtype=torch.bfloat16), \
            slackswap.apply(model, uniform(name, "offload"), profile=c.profile):
        _loss(_call(model, batch), c.loss_fn)
    _assert_same(_state(model, batch), before, "refused but changed ")


@pytest.mark.parametrize("name", ["t5", "deberta", "perceiver", "unet"])
def test_later_steps_of_one_model_are_exact_with_the_learned_module_events(name: str) -> None:
    """NOTE [hooks only where watching changes]: the other tests here copy the model for
    every step, so each step learns its module events anew; here one model takes three
    steps under one plan, the later ones with only the modules where watching changes
    hooked, each bit for bit the step without slackswap."""
    c = case(name)
    plan = mixed(name)
    model, batch = copy.deepcopy(c.model), copy.deepcopy(c.batch)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with slackswap.apply(model, plan, profile=c.profile):
            loss = _loss(_call(model, batch), c.loss_fn)
        got = {**_finish(model, loss, "backward"), **_state(model, batch),
               "modes": _modes(model)}
        _assert_same(got, reference(name, "backward", step), f"step {step}: ")
    assert any(e.model() is model for e in recording._EVENTS.values())
