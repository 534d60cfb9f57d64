"""The runtime watches only what a plan rebuilds (NOTE [watch only what the plan
rebuilds]): cost by construction, and a loud refusal when the step is not its profile's."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import slackswap
from slackswap.core.plan import MIN_PLANNED_BYTES, Plan
from slackswap.errors import InputError, PathNotice
from slackswap.models import build_model
from slackswap.runtime.watch import watch_for

recording = importlib.import_module("slackswap.runtime.recording")


@functools.cache
def traced(name: str = "gpt2-xl-tiny"):
    model, batch = build_model(name, dtype="fp32", fake=False)
    return model, batch, slackswap.profile(model, batch, mode="traced")


def uniform(profile, decision: str) -> Plan:
    names = profile.recomputable if decision == "recompute" else set(profile.by_name)
    return Plan(fingerprint=profile.fingerprint, strategy=decision, decisions={
        t.name: decision if t.name in names and t.bytes >= MIN_PLANNED_BYTES
        and t.producer is not None else "keep" for t in profile.saved_activations})


def dispatches(model, batch, plan, profile) -> tuple[int, dict]:
    """Ops the runtime's dispatch mode saw in one step, and the loss and gradients."""
    seen = [0]
    original = recording._Tracer.__torch_dispatch__

    def counting(self, *args, **kwargs):
        seen[0] += 1
        return original(self, *args, **kwargs)

    recording._Tracer.__torch_dispatch__ = counting
    try:
        torch.manual_seed(0)
        with slackswap.apply(model, plan, profile=profile, verify=True):
            loss = model(**batch).loss
        loss.backward()
    finally:
        recording._Tracer.__torch_dispatch__ = original
    out = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad(set_to_none=True)
    return seen[0], out


def reference(model, batch) -> dict:
    torch.manual_seed(0)
    loss = model(**batch).loss
    loss.backward()
    out = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("decision", ["keep", "offload"])
def test_keeping_and_offloading_watch_no_op(decision: str) -> None:
    model, batch, profile = traced()
    plan = Plan.keep_all(profile) if decision == "keep" else uniform(profile, decision)
    assert watch_for(profile, plan).watched_ops == 0
    seen, got = dispatches(model, batch, plan, profile)
    assert seen == 0
    want = reference(model, batch)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_recompute_watches_the_ops_its_rebuilds_replay_and_little_else() -> None:
    model, batch, profile = traced()
    name = "transformer.h.1.mlp.act:gelu:0"
    plan = Plan(fingerprint=profile.fingerprint, strategy="one", decisions={name: "recompute"})
    watch = watch_for(profile, plan)
    forward = sum(op.phase == "forward" for op in profile.ops)
    assert 0 < watch.watched_ops < forward / 4
    producer = profile.by_name[name].producer
    assert producer in watch.op_kinds
    seen, got = dispatches(model, batch, plan, profile)
    assert 0 < seen < forward / 2
    want = reference(model, batch)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _off_path(model, batch, plan, profile, said: str) -> None:
    """One step under a profile that is not of it: NOTE [a step off the profiled path],
    said in one line naming what differed, and run again as plain PyTorch, its
    activations saved to host memory and every host buffer given back after backward."""
    torch.manual_seed(0)
    with pytest.warns(PathNotice, match=said) as notices, \
            slackswap.apply(model, plan, profile=profile) as block:
        loss = model(**batch).loss
    loss.backward()
    assert len(notices) == 1 and "\n" not in str(notices[0].message)
    assert block.stats.off_path and block.stats.offloaded_bytes > 0
    assert block.values.copies.held_bytes == 0
    got = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad(set_to_none=True)
    want = reference(model, batch)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_step_that_saves_other_bytes_than_its_profile_runs_plain() -> None:
    model, batch, profile = traced()
    plan = uniform(profile, "offload")
    wrong = profile.model_copy(deep=True)
    moved = next(n for n, d in plan.decisions.items() if d == "offload")
    wrong.by_name[moved].bytes += 4  # as if another code path had made it
    _off_path(model, batch, plan, wrong, f"different code path .*profiled step saved '{moved}'")


def test_a_watched_op_that_is_not_the_profiles_runs_plain() -> None:
    model, batch, profile = traced()
    plan = uniform(profile, "recompute")
    wrong = profile.model_copy(deep=True)
    index = min(watch_for(profile, plan).op_kinds)
    wrong.ops[index].kind = "not_this_op"
    _off_path(model, batch, plan, wrong, "different code path .*where the profiled step's "
              "ran not_this_op")


def test_without_a_guiding_profile_every_op_is_watched_and_named_by_the_shared_rule() -> None:
    model, batch, profile = traced()
    plan = uniform(profile, "offload")  # read back from a file: no profile in memory
    forward = sum(op.phase == "forward" for op in profile.ops)
    seen, got = dispatches(model, batch, Plan.model_validate(plan.model_dump()), None)
    assert seen >= forward
    want = reference(model, batch)
    assert all(torch.equal(got[k], want[k]) for k in want)


def module_hooks_in_forward(model, batch, plan, profile) -> tuple[int, int, dict]:
    """One step: the global module hooks and the modules with hooks of their own while the
    model ran, and the loss and gradients."""
    from torch.nn.modules import module as nn_module

    seen: list[tuple[int, int]] = []
    called: list[bool] = []

    def look(module, args):
        # the first module the model calls: every hook of the block is in place, and the
        # block's own hook for a module run before the model's call is gone (NOTE [the
        # model is called first])
        if module is model:
            called.append(True)
        elif called and not seen:
            hooked = sum(bool(m._forward_pre_hooks or m._forward_hooks)
                         for m in model.modules() if m is not model)
            seen.append((len(nn_module._global_forward_pre_hooks), hooked))

    handle = nn_module.register_module_forward_pre_hook(look)
    try:
        torch.manual_seed(0)
        with slackswap.apply(model, plan, profile=profile):
            loss = model(**batch).loss
        loss.backward()
    finally:
        handle.remove()
    out = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad(set_to_none=True)
    (global_hooks, hooked), = seen
    return global_hooks - 1, hooked, out  # less the look's own


def test_later_steps_hook_only_the_modules_where_watching_changes() -> None:
    """NOTE [hooks only where watching changes]: the first step of a plan counts every
    module event with global hooks; the next ones hook a few modules, with gradients bit
    for bit those of plain PyTorch."""
    model, batch, profile = traced()
    plan = uniform(profile, "recompute")
    plan = Plan.model_validate(plan.model_dump())  # a plan of its own: nothing learned yet
    want = reference(model, batch)
    first = module_hooks_in_forward(model, batch, plan, profile)
    assert first[:2] == (1, 0)  # a global pre-hook (and a post-hook), no module's own
    modules = sum(1 for _ in model.modules())
    for _ in range(2):
        global_hooks, hooked, got = module_hooks_in_forward(model, batch, plan, profile)
        assert global_hooks == 0 and 0 < hooked < modules / 2
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(first[2][k], want[k]) for k in want)


def test_a_hooked_module_called_more_often_than_learned_is_refused() -> None:
    model, batch, profile = traced()
    plan = Plan.model_validate(uniform(profile, "recompute").model_dump())
    module_hooks_in_forward(model, batch, plan, profile)  # learns the events
    events = next(e for e in recording._EVENTS.values() if e.model() is model)
    hooked = events.modules[0]()
    original = hooked.forward

    def twice(*args, **kwargs):
        original(*args, **kwargs)
        return original(*args, **kwargs)

    hooked.forward = twice
    try:
        _off_path(model, batch, plan, profile, "more often than the profiled step|"
                  "where the profiled step")
    finally:
        del hooked.forward


def test_what_the_first_try_saved_is_let_go_of_before_the_second() -> None:
    """The runtime lets go of what a step's first try saved before the step runs again
    (NOTE [a step off the profiled path]): backward from a tensor a hook kept from the
    first try says so in one line (it was refused as a plan made for another step); the
    step's own backward is plain PyTorch's."""
    model, batch, profile = traced()
    plan = uniform(profile, "offload")
    wrong = profile.model_copy(deep=True)
    moved = [n for n, d in plan.decisions.items() if d == "offload" and ".h.1." in n][0]
    wrong.by_name[moved].bytes += 4  # the first try runs through block 0
    outputs: list[torch.Tensor] = []
    hook = model.transformer.h[0].mlp.register_forward_hook(
        lambda module, args, out: outputs.append(out))
    try:
        torch.manual_seed(0)
        with pytest.warns(PathNotice, match="different code path"), \
                slackswap.apply(model, plan, profile=wrong) as block:
            loss = model(**batch).loss
        loss.backward()
        assert block.stats.off_path and block.stats.offloaded_bytes > 0
        got = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
        model.zero_grad(set_to_none=True)
        first, second = outputs  # the hook ran in both tries
        with pytest.raises(InputError, match="left the profiled path and ran again"):
            first.sum().backward()
        assert second.grad_fn is not None and first.grad_fn is not second.grad_fn
        want = reference(model, batch)
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
