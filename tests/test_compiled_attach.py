"""``slackswap.attach(model, compile=True)``: the model compiled in place by
``slackswap.compile``'s planned partition (NOTE [compiled in place]); a loop, a Hugging
Face ``Trainer`` and Lightning train with it bit-identically to ``torch.compile`` without a
plan under ``aot_eager``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from test_attach import assert_same, lit_lm, params, tiny_lm
from test_compiled import _MLP, _DropoutMLP

import slackswap
from slackswap.core.hardware import with_overrides
from slackswap.core.plan import Decision
from slackswap.device_budget import RESERVE, device_budget
from slackswap.errors import InputError


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _train(model: torch.nn.Module, batches: list[torch.Tensor]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """AdamW steps, then an evaluation forward: the losses, and every gradient of each step."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for x in batches:
        loss = model(x)
        loss.backward()
        losses.append(loss.detach())
        grads.extend(p.grad.clone() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        losses.append(model(batches[0]))
    model.train()
    return losses, grads


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.heavy  # a graph compiled and planned per shape (15 s on two loaded cores)
def test_a_loop_trains_as_torch_compile_with_a_plan_per_shape() -> None:
    """Three steps over two batch shapes, dropout on, and an evaluation forward: every
    loss and every gradient equal to ``torch.compile(model)``'s (``torch.equal``), one
    plan per shape, each applied as planned (dropout rebuilt with its RNG state) and named
    by the model's modules; detached, the model's own call is back."""
    torch.manual_seed(0)
    model = _DropoutMLP().train()
    batches = [torch.randn(64, 64), torch.randn(64, 64), torch.randn(32, 64)]
    reference = copy.deepcopy(model)
    # (its own tensors: torch.compile marks those whose size it saw change dynamic)
    expected = _train(torch.compile(reference, backend="aot_eager"),
                      [x.clone() for x in batches])
    with slackswap.attach(model, budget=0.6, compile=True, backend="aot_eager") as attached:
        got = _train(model, batches)
    assert model._compiled_call_impl is None
    _assert_equal(got[0], expected[0])
    _assert_equal(got[1], expected[1])
    assert_same(params(model), params(reference))
    assert len(attached.plans) == 2  # the evaluation forward has no backward: no plan
    for graph in attached.graphs:
        planned = {n for n, d in graph.plan.decisions.items() if d == Decision.RECOMPUTE}
        assert set(graph.applied.recomputed) == planned and planned
        assert graph.applied.rng_states > 0
        assert {n.split(":")[0] for n in graph.profile.by_name} >= {"blocks.0.0", "blocks.2.3"}


def test_budget_fit_plans_what_the_device_leaves() -> None:
    """``budget="fit"``, the one-line path: a device whose memory leaves 60% of the joint
    graph's keep-all peak once the model states and the reserve are out."""
    torch.manual_seed(0)
    model, x = _MLP(depth=2), torch.randn(64, 64)
    probe = slackswap.compile(copy.deepcopy(model), x, budget=1.0, backend="aot_eager")
    joint = probe.slackswap.profile
    a100 = slackswap.load_hardware("a100-80gb")
    states = device_budget(joint, a100).model_states + sum(n for n, _, _ in RESERVE.values())
    hw = with_overrides(a100, {"memory.capacity_bytes": states + 0.6 * joint.keep_all_peak})
    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    torch.compile(reference, backend="aot_eager")(x).backward()
    with slackswap.attach(model, budget="fit", hardware=hw, compile=True,
                          backend="aot_eager") as attached:
        model(x).backward()
    _assert_equal(_grads(model), _grads(reference))
    (plan,) = attached.plans
    assert plan.budget_bytes == int(0.6 * joint.keep_all_peak)
    assert attached.graphs[0].applied.recomputed


def test_refusals_are_one_line_and_leave_the_model_as_it_was() -> None:
    model, data = tiny_lm()
    with pytest.raises(InputError, match="loss_fn is for the eager"):
        slackswap.attach(model, compile=True, loss_fn=lambda out: out.loss)
    with pytest.raises(InputError, match="group= is for the eager runtime"):
        slackswap.attach(model, compile=True, group=object())
    with pytest.raises(InputError, match="compile=True"):
        slackswap.attach(model, backend="aot_eager")
    with pytest.raises(InputError, match="unknown backend"):
        slackswap.attach(model, compile=True, backend="eager")
    with pytest.raises(InputError, match="compiled already"):
        slackswap.attach(torch.compile(model), compile=True)
    # eager, then compiled, and the other way: one attachment at a time
    with slackswap.attach(model), pytest.raises(InputError, match="attached already"):
        slackswap.attach(model, compile=True)
    with slackswap.attach(model, compile=True, backend="aot_eager"), \
            pytest.raises(InputError, match="attached already"):
        slackswap.attach(model)
    assert model._compiled_call_impl is None and not model._forward_pre_hooks
    # a budget out of reach is the planner's one-line error at the first training call
    with slackswap.attach(model, budget="1KiB", compile=True, backend="aot_eager"), \
            pytest.raises(InputError, match="fits no plan"):
        model(**{k: torch.stack([d[k] for d in data[:2]]) for k in data[0]})


def test_hf_trainer_with_compile_trains_as_torch_compile(tmp_path: Path) -> None:
    """Three AdamW steps under ``transformers.Trainer``: the callback's compiled
    attachment against the same Trainer over ``model.compile()`` without a plan."""
    from slackswap.integrations.hf import SlackSwapCallback

    def train(model: torch.nn.Module, data: list, callbacks: list) -> None:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
        transformers.Trainer(model=model, args=args, train_dataset=data,
                             callbacks=callbacks).train()

    class CompileInPlace(transformers.TrainerCallback):
        """Plain ``model.compile()`` where the callback attaches: after the Trainer read
        the model's ``loss_type`` (unset: it counts the tokens of the loss itself)."""

        def on_train_begin(self, args: object, state: object, control: object,
                           model: torch.nn.Module, **kwargs: object) -> None:
            model.loss_type = "ForCausalLM"  # the loss it falls back to, without warning
            model.compile(backend="aot_eager", fullgraph=True, dynamic=False)

    model, data = tiny_lm()
    reference = copy.deepcopy(model)
    train(reference, data, [CompileInPlace()])
    callback = SlackSwapCallback(budget=0.8, compile=True, backend="aot_eager",
                                 strategy="recompute-only")
    train(model, data, [callback])
    assert_same(params(model), params(reference))
    assert callback.attached.graphs[0].applied.recomputed  # the plan ran
    assert model._compiled_call_impl is None  # detached at the end


def test_lightning_with_compile_trains_as_torch_compile() -> None:
    import pytorch_lightning as pl

    from slackswap.integrations.lightning import SlackSwapCallback

    def train(model: torch.nn.Module, data: list, callbacks: list) -> None:
        torch.manual_seed(0)
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, callbacks=callbacks,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(lit_lm(model), torch.utils.data.DataLoader(data, batch_size=2))

    model, data = tiny_lm()
    reference = copy.deepcopy(model)
    reference.loss_type = "ForCausalLM"  # the loss it falls back to, without the warning
    reference.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    train(reference, data, [])
    callback = SlackSwapCallback(budget=0.8, module="model", compile=True, backend="aot_eager",
                                 strategy="recompute-only")
    train(model, data, [callback])
    assert_same(params(model), params(reference))
    assert callback.attached.graphs[0].applied.recomputed
    assert model._compiled_call_impl is None


def test_a_batch_shape_past_dynamos_recompile_limit_is_one_line() -> None:
    """Each batch shape (and each evaluation call) compiles a graph; past dynamo's
    ``recompile_limit`` a full-graph compile fails hard, and that failure
    (``FailOnRecompileLimitHit``) came out whole, traceback and all."""
    model = _MLP(depth=1)
    with torch._dynamo.config.patch(recompile_limit=1), \
            slackswap.attach(model, budget=1.0, compile=True, backend="aot_eager"):
        model(torch.randn(8, 64)).backward()
        with pytest.raises(InputError, match="compiled for 1 graphs already.*pad batches"
                           ) as err:
            model(torch.randn(16, 64))
    assert "\n" not in str(err.value)
