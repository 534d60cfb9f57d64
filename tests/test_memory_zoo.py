"""Memory truth on the model zoo: every family of :mod:`zoo` profiled as
``slackswap.plan(model, batch)`` profiles it (one traced step), planned, and run under
the plan with the activation memory measured apart from the runtime's own accounting
(``MemTracker``, :mod:`memory_tracking`). The measured peak stays within the budget
(+1%) and within 5% of the simulated one (on this machine's link: a CPU's copies are
synchronous).

The default run checks keep-all and SlackSwap at 50% on every family; ``pytest -m full``
every strategy at 70%, 50% and the smallest budget SlackSwap plans (``SMALLEST``).
Families that do not hold yet are marked with what was measured (strict: they fail the
run once they hold, so the mark comes off).

Plans come from the plan cache of the test run (``cached=True``, NOTE [plan cache]):
``test_runtime_zoo`` plans the same traced profiles at the same budgets, on the other
worker as often as not; a plan is a few seconds of search and the same plan either way.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import zoo
from memory_tracking import ActivationMemory
from test_memory_truth import SCALARS, _this_machine
from test_runtime_zoo import HALF_HEAVY

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import InputError
from slackswap.sim.schedule import min_working_set

STRATEGIES = ["slackswap", "offload-only", "recompute-only", "checkpoint-blocks"]
SMALLEST = "smallest"
# measured on this suite's CPU (2026-12-04): (model, strategy or "keep-all", budget) -> why
KNOWN: dict[tuple[str, str, object], str] = {
    ("switch", "slackswap", 0.5): "tokens reach experts in other numbers on another step "
                                  "(dropout, router jitter): the step leaves the profiled "
                                  "path and runs again as plain PyTorch, its activations "
                                  "saved to host memory, as test_runtime_zoo's routing "
                                  "case: within the budget (26.8% of it at 50%), not at "
                                  "the simulated peak",
}
_ROUTING = KNOWN["switch", "slackswap", 0.5]
# -m full (2026-12-04): measured share of the budget where it is over
KNOWN.update({
    # off the profiled path since its saves are checked against the profile's bytes (NOTE
    # [saves named by their order]); before, named by others' names: reloads early,
    # 107.6% of budget
    ("switch", "slackswap", 0.7): _ROUTING,
    ("switch", "offload-only", 0.7): _ROUTING,
    **{("switch", strategy, budget): _ROUTING for strategy, budget in (
        ("slackswap", SMALLEST), ("offload-only", 0.5), ("offload-only", SMALLEST),
        ("recompute-only", 0.5), ("recompute-only", 0.7), ("checkpoint-blocks", 0.7))},
})


def _call(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss(out, loss_fn):
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and loss_fn is not None:
        loss = loss_fn(out)
    return out if loss is None else loss


@functools.cache
def _setup(name: str):
    model, batch, loss_fn = zoo.MODELS[name]()
    profile = slackswap.profile(model, batch, mode="traced", loss_fn=loss_fn)
    return model, batch, loss_fn, profile


def _measured(name: str, plan: Plan) -> int:
    model, batch, loss_fn, profile = _setup(name)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    memory = ActivationMemory(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker on a CPU-only build
        with memory:
            with slackswap.apply(model, plan, profile=profile):
                loss = _loss(_call(model, batch), loss_fn)
            loss.backward()
    model.zero_grad(set_to_none=True)
    return memory.peak


def _check(name: str, plan: Plan, budget: int) -> None:
    _, _, _, profile = _setup(name)
    measured = _measured(name, plan)
    simulated = slackswap.simulate(profile, plan, _this_machine(profile), budget).peak_bytes
    figures = (f"{name} {plan.strategy}: measured {measured}, simulated {simulated} "
               f"({(simulated - measured) / measured:+.2%}), budget {budget} (measured "
               f"{measured / budget:.1%} of it)")
    assert measured <= 1.01 * budget + SCALARS, figures
    assert abs(simulated - measured) <= 0.05 * measured, figures


def _known(name: str, what: str, budget: object = None):
    reason = KNOWN.get((name, what, budget))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _smallest(profile, strategy: str) -> Plan:
    """The plan at the smallest of a few budgets from the step's working set up."""
    floor = min_working_set(profile)[0] / profile.keep_all_peak
    for fraction in sorted({min(1.0, round(floor + step, 2)) for step in (0.02, 0.05, 0.1,
                                                                          0.2, 0.3)}):
        try:
            return slackswap.plan(profile, fraction, strategy=strategy, cached=True)
        except InputError:
            continue
    pytest.skip(f"{strategy} plans none of the budgets up to {floor + 0.3:.0%}")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_known(n, "keep-all"))
                                  for n in zoo.MODELS])
def test_keep_all(name: str) -> None:
    _, _, _, profile = _setup(name)
    _check(name, Plan.keep_all(profile), profile.keep_all_peak)


def _cases(full: bool) -> list:
    cases = []
    for name in zoo.MODELS:
        for strategy in STRATEGIES if full else ["slackswap"]:
            for budget in ([0.7, 0.5, SMALLEST] if full else [0.5]):
                marks = _known(name, strategy, budget) + ([pytest.mark.full] if full else [])
                # the plan is test_runtime_zoo's at half the peak, ``heavy`` for these models
                # there: planned here alone it takes as long (8 to 13 s on two loaded cores)
                marks += [pytest.mark.heavy] * (not full and name in HALF_HEAVY)
                cases.append(pytest.param(name, strategy, budget, marks=marks,
                                          id=f"{name}-{strategy}-{budget}"))
    return cases


def _planned(name: str, strategy: str, budget) -> None:
    _, _, _, profile = _setup(name)
    if budget == SMALLEST:
        plan = _smallest(profile, strategy)
    else:
        try:
            plan = slackswap.plan(profile, budget, strategy=strategy, cached=True)
        except InputError as e:
            pytest.skip(f"{strategy} has no plan for {name} at {budget}: {e}")
    _check(name, plan, plan.budget_bytes)


@pytest.mark.parametrize(("name", "strategy", "budget"), _cases(full=False))
def test_planned(name: str, strategy: str, budget) -> None:
    _planned(name, strategy, budget)


@pytest.mark.parametrize(("name", "strategy", "budget"), _cases(full=True))
def test_planned_full(name: str, strategy: str, budget) -> None:
    _planned(name, strategy, budget)


def test_a_tensor_the_model_caches_is_never_moved() -> None:
    """Wav2Vec2-Conformer caches its rotary embedding on the module: autograd saves it,
    and the program holds it past the step, so offloading it frees nothing (it measured
    4864 bytes over the simulated peak and 101.1% of the budget at 30% before). The
    profile says so (``held_past_step``), no strategy moves it (``PlanContext``), and
    the plan holds."""
    name = "wav2vec2_conformer"
    _, _, _, profile = _setup(name)
    cached = "wav2vec2_conformer.encoder.embed_positions:stack:0"
    assert profile.held_past_step & profile.by_name.keys() == {cached}  # saved ones
    plan = slackswap.plan(profile, 0.3)
    assert plan.decisions.get(cached, "keep") == "keep"
    measured = _measured(name, plan)
    simulated = slackswap.simulate(profile, plan, _this_machine(profile),
                                   plan.budget_bytes).peak_bytes
    assert measured <= plan.budget_bytes and measured <= simulated, (measured, simulated)
