"""Models whose forward changes in place a tensor autograd does not save (a block input the
checkpoint-offload baseline would copy to the host): every strategy's plan is one the
runtime takes, and ``slackswap.plan(model, batch)`` plans them, bit-identical."""

from __future__ import annotations

import pytest
import torch
import transformers

import slackswap
from slackswap.core.hardware import load_hardware
from slackswap.core.plan import Decision
from slackswap.planners import STRATEGIES
from slackswap.planners.api import plan_with_result
from slackswap.planners.context import PlanContext


def _transformer() -> tuple[torch.nn.Module, dict, object]:
    """``nn.Transformer``, encoder and decoder, with padding masks (its encoder fills
    the padded positions of a fresh tensor in place)."""
    model = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2,
                                 num_decoder_layers=2, dim_feedforward=64, dropout=0.0,
                                 batch_first=True)
    src, tgt = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[1, 5:] = True
    tgt_pad = torch.zeros(2, 5, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    batch = dict(src=src, tgt=tgt, src_key_padding_mask=src_pad,
                 tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    return model, batch, lambda out: out.pow(2).mean()


def _masked_lm(config_class: str, model_class: str, **kwargs) -> tuple:
    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_class)(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **kwargs)
    model = getattr(transformers, model_class)(config)
    ids = torch.randint(2, 100, (2, 48))
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 40:] = 0
    return model, dict(input_ids=ids, attention_mask=mask, labels=ids), lambda out: out.loss


MODELS = {
    "nn-transformer": _transformer,
    "longformer": lambda: _masked_lm("LongformerConfig", "LongformerForMaskedLM",
                                     attention_window=4, max_position_embeddings=64,
                                     pad_token_id=1),
    "bigbird": lambda: _masked_lm("BigBirdConfig", "BigBirdForMaskedLM",
                                  max_position_embeddings=128, attention_type="block_sparse",
                                  block_size=4, num_random_blocks=2),
}


def _model(name: str) -> tuple[torch.nn.Module, dict, object]:
    torch.manual_seed(0)
    model, batch, loss_fn = MODELS[name]()
    return model.train(), batch, loss_fn


def _step(model, batch, loss_fn, plan=None, profile=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    if plan is None:
        loss = loss_fn(model(**batch))
        loss.backward()
    else:
        with slackswap.apply(model, plan, profile=profile, verify=True) as runtime:
            loss = loss_fn(model(**batch))
        loss.backward()
        moved = any(d != Decision.KEEP for d in plan.decisions.values())
        assert runtime.stats.verified > 0 or not moved
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n == "bigbird"
                                  else n for n in sorted(MODELS)])  # (bigbird: 14 s)
def test_one_call_plans_are_exact_on_checkpoints_changed_in_place(name: str) -> None:
    """The checkpoint-offload baseline (a start of SlackSwap's search) asked to offload a
    block input forward fills in place: ``slackswap.plan`` failed at 0.5 and 0.3 with the
    runtime's refusal of that plan. Each plan now runs, bit-identical."""
    model, batch, loss_fn = _model(name)
    reference = _step(model, batch, loss_fn)
    for budget in (0.5, 0.3):
        try:
            plan = slackswap.plan(model, batch, budget, loss_fn=loss_fn)
        except slackswap.InputError as e:  # below what any plan reaches: said so
            assert "fits no plan" in str(e)
            continue
        _assert_same(_step(model, batch, loss_fn, plan), reference)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_strategy_plans_what_the_runtime_takes(name: str) -> None:
    """Each baseline's plan, fitting or not, passes the runtime's checks and runs
    bit-identical: a checkpoint forward changes in place is kept, never offloaded."""
    model, batch, loss_fn = _model(name)
    profile = slackswap.profile(model, batch, "a100-80gb", mode="traced", loss_fn=loss_fn)
    changed = [n for n in profile.checkpointable if n not in profile.offloadable_checkpoints]
    assert changed, "the model no longer changes a checkpoint in place: pick another"
    reference = _step(model, batch, loss_fn)
    for strategy in STRATEGIES:
        if strategy == "slackswap":  # planned above, and slow
            continue
        attempt = plan_with_result(profile, 0.5, strategy=strategy)
        if attempt is None:
            continue
        plan = attempt[0]
        plan.check(profile)
        assert not [n for n in changed if plan.decisions.get(n) == Decision.OFFLOAD]
        _assert_same(_step(model, batch, loss_fn, plan, profile), reference)


def test_plans_are_held_to_what_the_runtime_takes() -> None:
    """``PlanContext.plan``, through which every strategy makes its plans: an offloaded
    checkpoint that forward changes in place is kept, a recomputed checkpoint kept, and
    a prefetch of what is not offloaded dropped."""
    from test_runtime import _ChangedInPlace

    torch.manual_seed(0)
    profile = slackswap.profile(_ChangedInPlace(), torch.randn(8, 64))
    assert "a:addmm:0" in profile.checkpointable
    assert "a:addmm:0" not in profile.offloadable_checkpoints
    ctx = PlanContext(profile, load_hardware(profile.hardware), profile.keep_all_peak // 2)
    for decision in (Decision.OFFLOAD, Decision.RECOMPUTE):
        plan = ctx.plan("x", {"a:addmm:0": decision}, {"a:addmm:0": 0})
        assert plan.decisions == {"a:addmm:0": Decision.KEEP} and plan.prefetch == {}
        plan.check(profile)
