"""Python's cyclic collector, paused by the runtime from a block's entry until the step's
backward has run (NOTE [no cyclic GC until backward]): resumed by every way a step ends,
not by another step's, and gradients stay plain PyTorch's. (The plain cases, a backward,
a dropped graph, the next block, a refusal: ``test_runtime.py``.)"""

from __future__ import annotations

import copy
import gc
import sys
from collections.abc import Iterator

import pytest
import torch
from test_attach import tiny_lm
from test_runtime import setup

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import InputError


@pytest.fixture(scope="module")
def step() -> tuple:
    """gpt2-xl-tiny, a plan that keeps, offloads and rebuilds, and plain PyTorch's
    gradients of the step (dropout seeded with 0)."""
    profile, model, batch, names, (_, grads) = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("keep", "offload", "recompute")[i % 3]
                           for i, n in enumerate(names)})
    return model, batch, plan, grads


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    assert gc.isenabled()
    yield
    gc.enable()  # a failure above leaves no paused collector to the next test


def forward(model: torch.nn.Module, batch: dict, plan: Plan) -> torch.Tensor:
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    with slackswap.apply(model, plan):
        return model(**batch).loss


def assert_grads(model: torch.nn.Module, grads: dict) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def nodes(loss: torch.Tensor) -> Iterator:
    """The step's autograd nodes, from the loss back."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            yield node
            todo.extend(f for f, _ in node.next_functions)


class _Stop(Exception):
    pass


def test_a_backward_that_raised_resumes_it(step) -> None:
    """A backward stopped midway (a hook raised) runs no callback of autograd's: the
    collector resumes as autograd lets go of it, though the loss and graph live on, and a
    second backward gives plain PyTorch's gradients."""
    model, batch, plan, grads = step
    loss = forward(model, batch, plan)
    armed = [True]

    def stop(_: tuple) -> None:
        if armed:
            raise _Stop

    # half way back, where the step's saved tensors are being unpacked (not a leaf's
    # node, which outlives the step)
    deep = [n for n in nodes(loss) if type(n).__name__ != "AccumulateGrad"]
    hook = deep[len(deep) // 2].register_prehook(stop)
    with pytest.raises(_Stop):
        loss.backward(retain_graph=True)
    hook.remove()
    assert gc.isenabled()
    armed.clear()
    model.zero_grad(set_to_none=True)
    gc.disable()  # the program's own pause: a backward resumes only the runtime's
    loss.backward()
    assert not gc.isenabled()
    gc.enable()
    assert_grads(model, grads)


def test_saved_tensors_read_before_backward(step) -> None:
    """Saved tensors read outside backward (``grad_fn._saved_self``) run in no backward
    to queue the resume on: the backward after them queues it, with the graph retained."""
    model, batch, plan, grads = step
    loss = forward(model, batch, plan)
    read = 0
    for node in nodes(loss):
        for attr in dir(node):
            if attr.startswith("_saved_") and isinstance(
                    value := getattr(node, attr), torch.Tensor) and value.numel() > 1000:
                read += 1
    assert read > 10 and not gc.isenabled()
    loss.backward(retain_graph=True)
    assert gc.isenabled()
    assert_grads(model, grads)


def test_another_steps_graph_dropped_resumes_nothing(step) -> None:
    """The pause waits on its own step: another step's graph dropped inside this step's
    forward, or after it, does not resume it in forward or before this backward."""
    model, batch, plan, grads = step
    earlier = [forward(model, batch, plan)]
    paused = []

    def drop_earlier(*_: object) -> None:
        earlier.clear()
        paused.append(not gc.isenabled())

    hook = model.transformer.h[0].register_forward_hook(drop_earlier)
    try:
        loss = forward(model, batch, plan)
    finally:
        hook.remove()
    assert paused == [True] and not gc.isenabled()
    first, second = loss, forward(model, batch, plan)
    del first, loss  # (micro-batches: the first dropped, unused)
    assert not gc.isenabled()
    second.backward()
    assert gc.isenabled()
    assert_grads(model, grads)


def test_a_forward_that_raised_under_attach_resumes_it() -> None:
    """Under ``attach`` the block closes in a forward hook told of no error (or, after a
    Ctrl-C, at the next call): the traceback an interactive session keeps holds the
    graph, and the collector resumes all the same; training goes on as plain PyTorch."""
    model, examples = tiny_lm()
    batch = {k: torch.stack([e[k] for e in examples[:2]]) for k in examples[0]}
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    reference(**batch).loss.backward()

    # offload-only: SlackSwap's plan of this step keeps and offloads, no rebuild, and its
    # search was most of the test (test_attach's tests plan this step so too)
    with slackswap.attach(model, budget=0.5, hardware="a100-80gb",
                          strategy="offload-only") as attached:
        model(**batch).loss.backward()  # (planned)
        assert attached.stats.offloaded_bytes > 0
        for stop in (ValueError, KeyboardInterrupt):
            def raise_it(*_: object, stop: type = stop) -> None:
                raise stop("stopped")

            hook = model.transformer.h[1].register_forward_hook(raise_it)
            try:
                model(**batch)
            except stop:
                kept = sys.exc_info()  # as ``sys.last_exc`` keeps it
            finally:
                hook.remove()
            assert gc.isenabled(), stop
            del kept
            if stop is KeyboardInterrupt:  # that forward's block is closed, the call refused
                with pytest.raises(InputError, match="Ctrl-C"):
                    model(**batch)
            torch.manual_seed(0)
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            assert not gc.isenabled()
            loss.backward()
            assert gc.isenabled()
            for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), n
