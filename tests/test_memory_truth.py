"""Memory truth: the activation peak of a real step under an applied plan, measured with
``MemTracker``, stays within the plan's budget and within 5% of the simulated peak.

Weight gradients are model state, out of both figures (the profile marks them
``gradient``; :mod:`memory_tracking` leaves out what becomes a ``.grad``). On a CPU the
runtime's host copies are synchronous, so the step is simulated with a host link that
takes no time; the plans themselves are made for the profile's hardware (an A100).
"""

from __future__ import annotations

import functools
import json
import math
import warnings

import pytest
import torch
from cnn_models import resnet18, small_cnn
from factories import TinyMLP, WithMSE
from memory_tracking import ActivationMemory

import slackswap
from slackswap.core.hardware import Hardware, load_hardware
from slackswap.core.plan import Plan
from slackswap.errors import InputError
from slackswap.models import build_model
from slackswap.planners import smallest_feasible_budget
from slackswap.sim.schedule import build_schedule, min_working_set

# The loss and autograd's seed gradient: scalars the caller and ``backward()`` hold past
# their last use in the profile.
SCALARS = 64
STRATEGIES = ["recompute-only", "offload-only", "slackswap"]
BUDGETS = [0.7, 0.5]


def _mlp():
    torch.manual_seed(0)
    model, x = WithMSE(TinyMLP(256, 4)), torch.randn(8, 64, 256)
    return model, x, lambda: model(x)["loss"]


def _cnn():
    model, batch = small_cnn()
    return model, batch, lambda: model(*batch)["loss"]


def _resnet18():
    model, batch = resnet18(batch=2)
    return model, batch, lambda: model(*batch)["loss"]


def _gpt2():
    model, batch = build_model("gpt2-xl-tiny", fake=False, dtype="fp32")
    return model, batch, lambda: model(**batch).loss


BUILD = {"mlp": _mlp, "bn-cnn": _cnn, "gpt2-xl-tiny": _gpt2, "resnet18": _resnet18}
MODELS = ["mlp", "bn-cnn", "gpt2-xl-tiny",
          pytest.param("resnet18", marks=pytest.mark.slow)]


@functools.cache
def setup(name: str):
    model, batch, step = BUILD[name]()
    profile = slackswap.profile(model, batch, kernels="native", name=name)
    return model, batch, step, profile


def _this_machine(profile) -> Hardware:
    """The profile's hardware with the host link of a CPU run: copies take no time."""
    data = load_hardware(profile.hardware).model_dump()
    data["host_link"].update(d2h_bandwidth=math.inf, h2d_bandwidth=math.inf,
                             duplex_d2h_bandwidth=math.inf, duplex_h2d_bandwidth=math.inf,
                             latency_s=0.0)
    return Hardware.model_validate(data)


def measured_peak(name: str, plan: Plan) -> int:
    model, batch, step, profile = setup(name)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    memory = ActivationMemory(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        with memory, slackswap.apply(model, plan, profile=profile):
            loss = step()
            loss.backward()
    model.zero_grad(set_to_none=True)
    return memory.peak


def check(name: str, plan: Plan, budget: int) -> None:
    _, _, _, profile = setup(name)
    measured = measured_peak(name, plan)
    simulated = slackswap.simulate(profile, plan, _this_machine(profile), budget).peak_bytes
    planned = slackswap.simulate(profile, plan, memory_limit=budget).peak_bytes
    figures = (f"{name} {plan.strategy}: measured {measured}, simulated {simulated} "
               f"({(simulated - measured) / measured:+.2%} of measured; on "
               f"{profile.hardware} {planned}, {(planned - measured) / measured:+.2%}), "
               f"budget {budget} (measured {measured / budget:.1%} of it)")
    assert measured <= budget + SCALARS, figures
    assert abs(simulated - measured) <= 0.05 * measured, figures


@pytest.mark.parametrize("name", MODELS)
def test_keep_all(name: str) -> None:
    _, _, _, profile = setup(name)
    check(name, Plan.keep_all(profile), profile.keep_all_peak)


def _planned_cases() -> list:
    """Every model, strategy and budget; the default run takes every strategy at 0.5 and
    SlackSwap at 0.7 on every model (the baselines at 0.7, the same plans with less moved,
    under -m full: 8 plans and measured steps of 8-35 s on two cores)."""
    cases = []
    for name in MODELS:
        marks = list(getattr(name, "marks", ()))
        name = getattr(name, "values", (name,))[0]
        for strategy in STRATEGIES:
            for budget in BUDGETS:
                full = budget == 0.7 and strategy != "slackswap"
                # resnet18's measured steps (5 to 6 s each on two loaded cores): SlackSwap
                # at 0.5 in the default run, its others ``heavy``
                heavy = (name == "resnet18" and not full
                         and (strategy, budget) != ("slackswap", 0.5))
                cases.append(pytest.param(name, strategy, budget,
                                          marks=marks + [pytest.mark.full] * full
                                          + [pytest.mark.heavy] * heavy,
                                          id=f"{name}-{strategy}-{budget}"))
    return cases


@pytest.mark.parametrize(("name", "strategy", "budget"), _planned_cases())
def test_planned(name: str, strategy: str, budget: float) -> None:
    _, _, _, profile = setup(name)
    try:
        plan = slackswap.plan(profile, budget, strategy=strategy)
    except InputError as e:  # the planner found none: nothing to measure
        # below every plan's reach, or (a baseline, not SlackSwap, which falls back on
        # all-offload) out of this strategy's reach: recompute-only's knapsack leaves out
        # the memory its rebuilds hold for a while, so near the floor it may find none
        assert "fits no plan" in str(e) or (
            strategy != "slackswap" and f"out of reach of '{strategy}'" in str(e))
        pytest.skip(f"{strategy} has no plan for {name} at {budget}: {e}")
    assert plan.budget_bytes == int(budget * profile.keep_all_peak)
    check(name, plan, plan.budget_bytes)


# -- weight gradients are model state ----------------------------------------------------


def test_weight_gradients_are_model_state_not_activations() -> None:
    """The CNN's last convolution has a 2.25 MiB weight gradient, more than half the
    activation peak: counted as activation memory it made every budget below ~100%
    unreachable. Now it is reported apart and the peak is activations only."""
    model, _, _, profile = setup("bn-cnn")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    gradients = [t for t in profile.tensors if t.kind == "gradient"]
    assert profile.gradient_bytes == params  # one .grad per parameter, none tied
    assert all(profile.ops[t.producer].phase == "backward" for t in gradients)
    wide = model.features[-3].weight
    assert any(t.shape == list(wide.shape) for t in gradients)
    assert min_working_set(profile)[0] < 0.5 * profile.keep_all_peak
    schedule = build_schedule(profile, Plan.keep_all(profile))
    assert not {r.tensor for r in schedule.residencies} & {t.id for t in gradients}
    plan = slackswap.plan(profile, 0.5)
    result = slackswap.simulate(profile, plan, memory_limit=0.5)
    assert result.feasible and result.gradient_bytes == params
    assert profile.summary()["gradient_bytes"] == params


def test_tied_weights_count_both_gradients() -> None:
    """GPT-2 ties its embedding to its output layer: two gradients, one ``.grad``."""
    model, _, _, profile = setup("gpt2-xl-tiny")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.gradient_bytes >= params
    assert not any(t.kind == "gradient" and profile.ops[t.producer].phase == "forward"
                   for t in profile.tensors)


_CACHED = torch.rand(16384)  # made once, before every step: a module-level cache's


class _ReadsACachedTensor(torch.nn.Module):
    """Reads a view of a tensor made before the step, as BEiT reads its relative
    position index from an ``lru_cache`` (``index.view(-1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64), torch.nn.Tanh())
            for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.body(x) * _CACHED.view(-1)[:64]).square().mean()


def _measured_and_simulated(model: torch.nn.Module, x: torch.Tensor, profile,
                            plan: Plan) -> tuple[int, int]:
    """The activation peak of ``model(x).backward()`` under ``plan``, measured and
    simulated on this machine's link."""
    memory = ActivationMemory(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        with memory, slackswap.apply(model, plan, profile=profile):
            model(x).backward()
    model.zero_grad(set_to_none=True)
    return memory.peak, slackswap.simulate(profile, plan, _this_machine(profile)).peak_bytes


def test_a_view_of_a_tensor_made_before_the_step_is_not_activation_memory() -> None:
    """The tally counted the view's storage (64 KiB, allocated before the step) as
    activation memory: BEiT measured 1.3% over a keep-all peak it holds exactly."""
    torch.manual_seed(0)
    model, x = _ReadsACachedTensor(), torch.randn(128, 64)
    profile = slackswap.profile(model, x, mode="traced")
    for plan in (Plan.keep_all(profile), slackswap.plan(profile, 0.7)):
        measured, simulated = _measured_and_simulated(model, x, profile, plan)
        assert abs(measured - simulated) <= SCALARS, (plan.strategy, measured, simulated)


def test_profiles_of_schema_1_still_load(tmp_path) -> None:
    _, _, _, profile = setup("mlp")
    data = json.loads(profile.model_dump_json())
    data["schema_version"] = 1
    for t in data["tensors"]:
        t["kind"] = "activation" if t["kind"] == "gradient" else t["kind"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    old = slackswap.StepProfile.load(path)
    assert old.gradient_bytes == 0  # counted as activations, as version 1 did
    assert old.keep_all_peak >= profile.keep_all_peak


class _HoldsATable(torch.nn.Module):
    """Makes a position table in forward and holds it past the step (a cache on the
    module, as Mask2Former's sine position embedding is held by an ``lru_cache``): no
    backward op reads it, yet it is resident through backward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
            for _ in range(4))
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
        self.table = torch.sin(positions * torch.linspace(0.1, 1.0, 4 * x.shape[1]))
        for i, block in enumerate(self.body):
            x = torch.tanh(block(x) + self.table[:, i * 64:(i + 1) * 64])
        return x.square().mean()


def test_a_tensor_held_past_the_step_is_resident_through_backward() -> None:
    """The schedule let go of an activation no backward op reads at the end of forward,
    though the step held it into backward (``released_after``): the keep-all peak counted
    it, the simulator did not; and a plan offloaded it, as a checkpoint, freeing nothing:
    Mask2Former's plans measured 0.7-1.3% over budget."""
    torch.manual_seed(0)
    model, x = _HoldsATable(), torch.randn(128, 64)
    profile = slackswap.profile(model, x, mode="traced")
    table = next(t.name for t in profile.tensors if t.shape == [128, 256] and t.name
                 and t.name.endswith(":sin:0"))
    assert table in profile.held_past_step  # moving it would free nothing
    for plan in (Plan.keep_all(profile), slackswap.plan(profile, 0.7)):
        measured, simulated = _measured_and_simulated(model, x, profile, plan)
        assert abs(measured - simulated) <= SCALARS, (plan.strategy, measured, simulated)
        if plan.budget_bytes is not None:
            assert measured <= plan.budget_bytes + SCALARS, (measured, plan.budget_bytes)


def test_small_tensors_a_recipe_holds_are_resident_to_the_end_of_the_step() -> None:
    """Llama in bf16 casts its attention's inputs to fp32 and saves those: the bf16 key
    and value projections (768 bytes each) are saved by no one, and a recompute plan's
    recipes hold them from forward to the step's end (NOTE [small unseen tensors held by
    recipes] in ``sim/schedule.py``). The simulator let them go where forward did: the
    recompute-only plans measured 2% over budget."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train().to(torch.bfloat16)

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    # profiled on a model of its own: the step measured makes what the profiled one did
    profile = slackswap.profile(llama(), {"input_ids": ids, "labels": ids}, mode="traced")
    model = llama()
    plan = slackswap.plan(profile, 0.7, strategy="recompute-only")
    assert any(d == "recompute" for d in plan.decisions.values())
    torch.manual_seed(0)
    memory = ActivationMemory(model, (ids,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        with memory:
            with slackswap.apply(model, plan, profile=profile):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    simulated = slackswap.simulate(profile, plan, _this_machine(profile)).peak_bytes
    assert memory.peak <= plan.budget_bytes + SCALARS, (memory.peak, plan.budget_bytes)
    assert abs(memory.peak - simulated) <= SCALARS, (memory.peak, simulated)


class _FunctionalCall(torch.nn.Module):
    """Runs a sub-network through ``torch.func.functional_call`` with parameters made in
    forward (its own, scaled): tensors no leaf stand in for the sub-network's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {k: v * 1.0 for k, v in self.net.named_parameters()}
        h = torch.func.functional_call(self.net, params, (x,))
        return self.head(torch.tanh(h)).square().mean()


def test_a_step_through_functional_call_is_measured_and_holds_its_plan() -> None:
    """The tally hooked every parameter a module held as its forward began, and under
    ``functional_call`` those are tensors made in forward, which take no
    post-accumulate-grad hook: the measurement raised before the step ran."""
    torch.manual_seed(0)
    model, x = _FunctionalCall(), torch.randn(8, 16, 32)
    profile = slackswap.profile(model, x, mode="traced")
    plan = slackswap.plan(profile, smallest_feasible_budget(profile))
    measured, simulated = _measured_and_simulated(model, x, profile, plan)
    assert measured <= plan.budget_bytes + SCALARS, (measured, plan.budget_bytes)
    assert abs(measured - simulated) <= SCALARS, (measured, simulated)
