"""Scout: training patterns around the eager ``slackswap.attach``, each compared bit for bit
(``torch.equal``: the loss, every gradient, then parameters, buffers and torch's RNG state
after each of three optimizer steps) with the same loop without SlackSwap, from the same
state and seeds:

- ``gradscaler``: ``torch.amp.GradScaler`` with fp16 autocast on the CPU;
- ``accumulate``: two micro-batches per optimizer step, each with its own backward;
- ``weight_norm`` / ``orthogonal``: ``torch.nn.utils.parametrize`` parametrizations;
- ``fwd_hook`` / ``fwd_pre_hook`` / ``root_hook`` / ``root_pre_hook``: forward hooks of the
  user's that change a submodule's output or input, or the model's own output or input;
- ``bwd_hook``: ``register_full_backward_hook`` scaling a block's input gradient;
- ``tied``: the head's weight is the embedding's;
- ``functional_call``: ``torch.func.functional_call`` with parameters held outside the model;
- ``dict`` / ``tuple``: a model returning several losses, added outside;
- ``retain_graph``: two backwards through one graph (``retain_graph=True``);
- ``grad_penalty``: a gradient penalty (``torch.autograd.grad(create_graph=True)``);
- ``lbfgs``: ``torch.optim.LBFGS``, its closure running forward and backward several
  times per optimizer step;
- ``ema``: a ``swa_utils.AveragedModel`` EMA (a deep copy of the attached model) updated
  after each step and run under ``no_grad`` and in ``eval()`` with grad enabled;
- ``val_no_grad`` / ``val_grad``: ``model.eval()`` validation between steps, under
  ``no_grad``, or with grad enabled and its graph dropped unused;
- ``varlen``: sequence lengths 16, 8, 16 (a plan per batch shape);
- ``sub_compile``: one block compiled (``aot_eager``) inside the model;
- ``user_checkpoint``: the model calls ``torch.utils.checkpoint`` itself;
- ``bf16`` / ``freeze`` / ``unfreeze``: the model changed between steps
  (``model.to(torch.bfloat16)``; the first block's ``requires_grad`` off, and on again);
- ``two_forwards``: two forwards, both graphs alive, before one backward;
- ``no_grad_first``: a ``no_grad`` forward (reference logits) before the training one;
- ``backward_inputs``: ``loss.backward(inputs=...)`` to the blocks only;
- ``func_grad``: ``torch.func.grad`` over ``functional_call``;
- ``accelerate_after`` / ``accelerate_before``: ``accelerate.Accelerator`` on the CPU
  (bf16, ``accumulate`` over two micro-batches, ``accelerator.backward``,
  ``clip_grad_norm_``), the model attached after ``prepare`` or before it;
- ``gpt2`` / ``gpt2_checkpointing``: a tiny transformers GPT-2 with its own loss, and
  with ``gradient_checkpointing_enable()``;
- ``trainer``: ``transformers.Trainer`` (``SlackSwapCallback``) on the CPU, bf16, two
  micro-batches a step, padded lengths, an evaluation after each step (``train_hf``);
- ``interleaved``: two forwards, then each loss's backward in turn (either order);
- ``skip_step``: a training forward whose graph is dropped unused between steps;
- ``optimize_input``: a frozen model in ``eval()``, its input embeddings optimized;
- ``adversarial``: FGSM on the embeddings (the gradient to them, a second forward);
- ``two_models``: two models attached (a language model and a critic, GAN-style);
- ``lora``: peft's LoRA on the tiny GPT-2;
- ``cnn`` / ``channels_last``: a BatchNorm CNN with in-place ReLUs, and the same with
  model and batch in ``torch.channels_last``;
- ``optimizer_in_backward``: SGD per parameter in ``register_post_accumulate_grad_hook``;
- ``grad_clamp_hook``: a ``Tensor.register_hook`` clamping every weight's gradient;
- ``anomaly``: ``torch.autograd.set_detect_anomaly(True)`` around forward and backward;
- ``float64``: the model in double precision;
- ``dropout``: a dropout schedule (``p`` 0.1, 0.3, then 0 from step to step);
- ``skip``: a flag on the model, set between steps, that skips a block in forward.

Eager (``attach``) and compiled (``attach(compile=True)`` against ``model.compile()`` with
the same backend).

    python benchmarks/scout_patterns.py                 # every case and setting (SETTINGS)
    python benchmarks/scout_patterns.py tied hook       # the cases whose name has a word

Each case prints ``identical``, ``refused(<the one-line error>)`` or ``MISMATCH(<what>)``
(a traceback's last line where a one-line error belongs).
"""

from __future__ import annotations

import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from scout_vision import after_step, compare, count_stats

import slackswap
from slackswap.errors import SlackSwapError

STEPS = 3
VOCAB, WIDTH = 64, 32


class Net(torch.nn.Module):
    """A tiny language model: embedding, residual MLP blocks with dropout, a head."""

    def __init__(self, layers: int = 3, tie: bool = False, returns: str = "logits",
                 ckpt: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(4 * WIDTH, WIDTH)) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.returns, self.ckpt = returns, ckpt
        self.skip: int | None = None  # a block the forward passes over

    def forward(self, ids: torch.Tensor, labels: torch.Tensor,
                embeds: torch.Tensor | None = None) -> Any:
        h = self.emb(ids) if embeds is None else embeds
        for i, block in enumerate(self.blocks):
            if i == self.skip:
                continue
            h = h + (torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
                     if self.ckpt else block(h))
        logits = self.head(self.norm(h))
        if self.returns == "logits":
            return logits
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        aux = logits.float().pow(2).mean()
        if self.returns == "dict":
            return {"ce": ce, "aux": aux, "logits": logits}
        return ce, aux, logits


def _batch(i: int, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, VOCAB, (4, length), generator=g)
    return {"ids": ids, "labels": torch.roll(ids, -1, 1)}


def _ce(out: Any, batch: dict) -> torch.Tensor:
    if isinstance(out, dict):
        return out["ce"] + 0.1 * out["aux"]
    if isinstance(out, tuple):
        return out[0] + 0.1 * out[1]
    return F.cross_entropy(out.flatten(0, 1).float(), batch["labels"].flatten())


@dataclass
class Loop:
    """How one pattern trains: the model, and what one optimizer step does."""

    model: torch.nn.Module
    params: list[torch.Tensor] = field(default_factory=list)  # optimized (default: model's)
    fp16: bool = False
    scaler: Any = None

    def forward(self, batch: dict) -> Any:
        with torch.autocast("cpu", torch.float16, enabled=self.fp16):
            return self.model(**batch)

    def backward(self, step: int) -> torch.Tensor:
        """Forward and backward for ``step``; returns the loss recorded."""
        batch = _batch(step)
        loss = _ce(self.forward(batch), batch)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss

    def optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    def attached(self) -> list[torch.nn.Module]:
        """The models attached (or compiled, without SlackSwap)."""
        return [self.model]

    def before(self, step: int) -> None:
        """What the loop does to the model before ``step``'s forward (nothing)."""

    def step(self, opt: torch.optim.Optimizer, rec: dict) -> None:
        """The optimizer step (after ``backward``); may add to the step's record."""
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
            rec["scale"] = self.scaler.get_scale() * torch.ones(())
        else:
            opt.step()


class Accumulate(Loop):
    def backward(self, step: int) -> torch.Tensor:
        total = 0
        for micro in range(2):
            batch = _batch(10 * step + micro)
            loss = _ce(self.forward(batch), batch) / 2
            loss.backward()
            total = total + loss.detach()
        return total


class RetainGraph(Loop):
    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        loss = _ce(self.forward(batch), batch)
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
        return loss


class GradPenalty(Loop):
    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        loss = _ce(self.forward(batch), batch)
        weights = [b[3].weight for b in self.model.blocks]
        grads = torch.autograd.grad(loss, weights, create_graph=True)
        (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
        return loss


class Functional(Loop):
    """``torch.func.functional_call`` with parameters the loop holds, not the model."""

    def forward(self, batch: dict) -> Any:
        names = [n for n, _ in self.model.named_parameters()]
        return torch.func.functional_call(self.model, dict(zip(names, self.params,
                                                               strict=True)), (), batch)


class Lbfgs(Loop):
    """``torch.optim.LBFGS``: its closure runs forward and backward up to four times per
    optimizer step."""

    def optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        self.opt = torch.optim.LBFGS(params, lr=0.1, max_iter=3, history_size=4)
        return self.opt

    def closure(self) -> torch.Tensor:
        self.opt.zero_grad()
        loss = _ce(self.forward(self.batch), self.batch)
        loss.backward()
        return loss

    def backward(self, step: int) -> torch.Tensor:
        self.batch = _batch(step)
        return self.closure()

    def step(self, opt: torch.optim.Optimizer, rec: dict) -> None:
        rec["lbfgs loss"] = opt.step(self.closure).detach().clone()


class Ema(Loop):
    """An EMA (``swa_utils.AveragedModel``) of the attached model, made after the first
    step's forward (a deep copy of the attached model) and updated after each step; it
    validates under ``no_grad`` in train mode, and in eval mode with grad enabled."""

    ema: Any = None

    def step(self, opt: torch.optim.Optimizer, rec: dict) -> None:
        super().step(opt, rec)
        if self.ema is None:
            self.ema = torch.optim.swa_utils.AveragedModel(
                self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        self.ema.update_parameters(self.model)
        for n, p in self.ema.named_parameters():
            rec[f"ema {n}"] = p.detach().clone()
        batch = _batch(1000)
        with torch.no_grad():
            rec["ema train no_grad"] = _ce(self.ema(**batch), batch)
        self.ema.eval()
        rec["ema eval grad"] = _ce(self.ema(**batch), batch).detach()
        self.ema.train()


class Validate(Loop):
    """``model.eval()`` validation between steps: under ``no_grad``, or (``grad``) with
    grad enabled and the graph dropped without a backward."""

    def __init__(self, model: torch.nn.Module, grad: bool) -> None:
        super().__init__(model)
        self.grad = grad

    def step(self, opt: torch.optim.Optimizer, rec: dict) -> None:
        super().step(opt, rec)
        self.model.eval()
        batch = _batch(1000)
        with torch.set_grad_enabled(self.grad):
            rec["val"] = _ce(self.forward(batch), batch).detach()
        self.model.train()


class VarLen(Loop):
    """Sequence lengths 16, 8, 16 (two batch shapes, the first seen again)."""

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step, (16, 8, 16)[step % 3])
        loss = _ce(self.forward(batch), batch)
        loss.backward()
        return loss


class Change(Loop):
    """The model changed before the second step: ``bf16`` (``model.to(torch.bfloat16)``,
    SGD) or ``freeze`` (the first block's ``requires_grad`` off)."""

    def __init__(self, model: torch.nn.Module, change: str) -> None:
        super().__init__(model)
        self.change = change

    def optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self.change == "bf16":
            return torch.optim.SGD(params, lr=1e-1)
        return super().optimizer(params)

    def before(self, step: int) -> None:
        if self.change == "dropout":  # a dropout schedule: 0.1, 0.3, then off
            for m in self.model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = (0.1, 0.3, 0.0)[step]
        elif self.change == "skip":  # a flag the forward reads: the second block skipped
            self.model.skip = 1 if step >= 1 else None
        elif step == 1 and self.change == "bf16":
            self.model.to(torch.bfloat16)
        elif step == 1:
            self.model.blocks[0].requires_grad_(False)
        elif step == 2 and self.change == "unfreeze":
            self.model.blocks[0].requires_grad_(True)


class TwoForwards(Loop):
    """Two forwards before one backward (a contrastive or preference loss): both
    graphs alive at once."""

    def backward(self, step: int) -> torch.Tensor:
        a, b = _batch(step), _batch(50 + step)
        loss = _ce(self.forward(a), a) + 0.5 * _ce(self.forward(b), b)
        loss.backward()
        return loss


class NoGradFirst(Loop):
    """A ``no_grad`` forward on the batch (reference logits) before the training forward,
    with a KL term to them."""

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        with torch.no_grad():
            ref = self.forward(batch).float().log_softmax(-1)
        logits = self.forward(batch)
        kl = F.kl_div(logits.float().log_softmax(-1), ref, log_target=True,
                      reduction="batchmean")
        loss = _ce(logits, batch) + kl
        loss.backward()
        return loss


class BackwardInputs(Loop):
    """``loss.backward(inputs=...)``: gradients for the blocks only."""

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        loss = _ce(self.forward(batch), batch)
        loss.backward(inputs=list(self.model.blocks.parameters()))
        return loss


class FuncGrad(Loop):
    """``torch.func.grad`` over ``functional_call`` (gradients set by hand)."""

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        named = dict(self.model.named_parameters())

        def loss_of(params: dict) -> tuple[torch.Tensor, torch.Tensor]:
            out = torch.func.functional_call(self.model, params, (), batch)
            loss = _ce(out, batch)
            return loss, loss.detach()

        grads, loss = torch.func.grad(loss_of, has_aux=True)(named)
        for n, p in named.items():
            p.grad = grads[n]
        return loss


class Accelerate(Loop):
    """``accelerate.Accelerator`` on the CPU (``mixed_precision="bf16"``, two micro-batches
    per optimizer step under ``accumulate``, ``accelerator.backward``, ``clip_grad_norm_``),
    the model prepared before it is attached (``when="after"``) or after (``"before"``)."""

    def __init__(self, model: torch.nn.Module, when: str) -> None:
        super().__init__(model)
        self.when = when

    def optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        self.acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
        self.opt = super().optimizer(params)
        if self.when == "after":
            self.model, self.opt = self.acc.prepare(self.model, self.opt)
        return self.opt

    def before(self, step: int) -> None:
        if step == 0 and self.when == "before":
            self.model, self.opt = self.acc.prepare(self.model, self.opt)

    def backward(self, step: int) -> torch.Tensor:
        total = 0
        for micro in range(2):
            batch = _batch(10 * step + micro)
            with self.acc.accumulate(self.model):
                loss = _ce(self.model(**batch), batch)
                self.acc.backward(loss)
            total = total + loss.detach()
        return total

    def step(self, opt: torch.optim.Optimizer, rec: dict) -> None:
        assert self.acc.sync_gradients
        rec["norm"] = self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad()


class Gpt2(Loop):
    """A tiny transformers GPT-2 from its config, its own loss (``labels``), with
    ``gradient_checkpointing_enable()`` turned on by the user (``checkpointing``)."""

    def __init__(self, checkpointing: bool) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=WIDTH, n_layer=2,
                            n_head=2)
        model = GPT2LMHeadModel(config).train()
        # its loss named: without, transformers logs a warning on each call, which breaks
        # the graph plain torch.compile traces (attach(compile=True) resolves it itself)
        model.loss_type = "ForCausalLM"
        if checkpointing:
            model.gradient_checkpointing_enable()
        super().__init__(model)

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        loss = self.model(input_ids=batch["ids"], labels=batch["ids"]).loss
        loss.backward()
        return loss


class Interleaved(Loop):
    """Two forwards, then each loss's backward on its own: the first graph's first on even
    steps, the second's first on odd ones."""

    def backward(self, step: int) -> torch.Tensor:
        a, b = _batch(step), _batch(50 + step)
        losses = [_ce(self.forward(a), a), 0.5 * _ce(self.forward(b), b)]
        for loss in (losses if step % 2 == 0 else losses[::-1]):
            loss.backward()
        return losses[0].detach() + losses[1].detach()


class SkipStep(Loop):
    """Before the second step, a training forward whose graph is dropped unused (a loss
    judged bad, the batch skipped)."""

    def backward(self, step: int) -> torch.Tensor:
        if step == 1:
            batch = _batch(99)
            _ce(self.forward(batch), batch)
        return super().backward(step)


class OptimizeInput(Loop):
    """The model frozen in ``eval()``, its input embeddings optimized (an adversarial
    example, deep dream): the graph is recorded only through the input."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        net = Net().eval().requires_grad_(False)
        embeds = torch.randn(4, 16, WIDTH, generator=torch.Generator().manual_seed(3))
        super().__init__(net, [embeds.requires_grad_()])

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(0)
        loss = _ce(self.model(**batch, embeds=self.params[0]), batch)
        loss.backward()
        return loss


class Adversarial(Loop):
    """Adversarial training (FGSM on the embeddings): the embedding taken outside the
    model's call, the loss's gradient to it, and a second forward on the perturbed
    embeddings before one backward."""

    def backward(self, step: int) -> torch.Tensor:
        batch = _batch(step)
        emb = self.model.emb(batch["ids"])
        loss = _ce(self.model(**batch, embeds=emb), batch)
        (g,) = torch.autograd.grad(loss, emb, retain_graph=True)
        adv = _ce(self.model(**batch, embeds=emb + 0.1 * g.sign()), batch)
        (loss + adv).backward()
        return loss


class Pair(torch.nn.Module):
    """A language model and a critic of its output distributions, trained together."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = Net()
        self.critic = Critic()


class Critic(torch.nn.Module):
    """An MLP scoring token distributions (its own class: dynamo compiles no frame of a
    bare ``nn.Sequential`` compiled in place)."""

    def __init__(self) -> None:
        super().__init__()
        wide = 4 * WIDTH
        self.body = torch.nn.Sequential(
            torch.nn.Linear(VOCAB, wide), torch.nn.GELU(), torch.nn.Linear(wide, wide),
            torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(wide, wide),
            torch.nn.Tanh(), torch.nn.Linear(wide, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class TwoModels(Loop):
    """Two attached models, GAN-style: the critic on real one-hot tokens, on the language
    model's distributions detached, and on them with grad (its input requires grad)."""

    def attached(self) -> list[torch.nn.Module]:
        return [self.model.lm, self.model.critic]

    def backward(self, step: int) -> torch.Tensor:
        batch, critic = _batch(step), self.model.critic
        logits = self.model.lm(**batch)
        probs = logits.float().softmax(-1)
        real = critic(F.one_hot(batch["labels"], VOCAB).float())
        d_loss = F.softplus(critic(probs.detach())).mean() + F.softplus(-real).mean()
        g_loss = _ce(logits, batch) + F.softplus(-critic(probs)).mean()
        (d_loss + g_loss).backward()
        return g_loss


class Lora(Gpt2):
    """peft's LoRA on the tiny GPT-2 (``c_attn`` and ``c_fc``), its base weights frozen."""

    def __init__(self) -> None:
        import peft

        super().__init__(checkpointing=False)
        torch.manual_seed(1)
        self.model = peft.get_peft_model(self.model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn", "c_fc"],
            init_lora_weights=False))


class Cnn(torch.nn.Module):
    """Convolutions, BatchNorm, in-place ReLUs, pooling and dropout: an image classifier."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for c_in, c_out in ((3, 16), (16, 32), (32, 32)):
            layers += [torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                       torch.nn.BatchNorm2d(c_out), torch.nn.ReLU(inplace=True),
                       torch.nn.MaxPool2d(2) if c_out == 16 else torch.nn.Identity()]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


class Images(Loop):
    """The CNN on images, in ``channels_last`` (model and batch) when ``channels_last``."""

    def __init__(self, channels_last: bool) -> None:
        torch.manual_seed(0)
        model = Cnn()
        self.fmt = torch.channels_last if channels_last else torch.contiguous_format
        super().__init__(model.to(memory_format=self.fmt))

    def backward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 3, 16, 16, generator=g).to(memory_format=self.fmt)
        y = torch.randint(0, 10, (8,), generator=g)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


class InBackward(Loop):
    """The optimizer step fused into backward (``register_post_accumulate_grad_hook``, one
    SGD per parameter as its gradient is ready; ``hook="clamp"``: a gradient hook of the
    user's on every weight instead, clamping it), anomaly detection on (``anomaly``)."""

    def __init__(self, model: torch.nn.Module, hook: str) -> None:
        super().__init__(model)
        self.hook, self.opts = hook, {}
        for n, p in model.named_parameters():
            if hook == "optimizer":
                self.opts[n] = torch.optim.SGD([p], lr=1e-1, momentum=0.9)
                p.register_post_accumulate_grad_hook(self._step_one)
            elif hook == "clamp" and p.dim() == 2:
                p.register_hook(lambda g: g.clamp(-1e-3, 1e-3))

    def _step_one(self, p: torch.Tensor) -> None:
        self.grads.append(p.grad.clone())
        opt = next(o for o in self.opts.values() if o.param_groups[0]["params"][0] is p)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def backward(self, step: int) -> torch.Tensor:
        self.grads: list[torch.Tensor] = []
        with torch.autograd.set_detect_anomaly(self.hook == "anomaly"):
            loss = super().backward(step)
        return loss

    def step(self, opt: torch.optim.Optimizer, rec: dict) -> None:
        for i, g in enumerate(self.grads):
            rec[f"fused grad {i}"] = g
        if self.hook != "optimizer":
            super().step(opt, rec)


def _parametrized(kind: str) -> Net:
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        if kind == "weight_norm":
            for i in (1, 3, 6):
                torch.nn.utils.parametrizations.weight_norm(block[i])
        else:
            torch.nn.utils.parametrizations.orthogonal(block[1])
    return net


def _hooked(kind: str) -> Net:
    torch.manual_seed(0)
    net = Net()
    if kind == "fwd_hook":
        net.blocks[1].register_forward_hook(lambda m, args, out: out * 0.5 + out.tanh())
    elif kind == "fwd_pre_hook":
        net.blocks[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    elif kind == "root_hook":
        net.register_forward_hook(lambda m, args, out: out.float().sigmoid() * 3)
    elif kind == "root_pre_hook":  # other token ids (run twice, others again)
        net.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs | {
            "ids": (kwargs["ids"] * 7 + 1) % VOCAB}), with_kwargs=True)
    elif kind == "bwd_hook":
        net.blocks[1].register_full_backward_hook(
            lambda m, gin, gout: tuple(None if g is None else g * 0.5 for g in gin))
    return net


def build(name: str) -> Loop:
    """The loop for pattern ``name`` on a fresh model (the same weights every call)."""
    torch.manual_seed(0)
    if name == "gradscaler":
        return Loop(Net(), fp16=True, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    if name == "accumulate":
        return Accumulate(Net())
    if name in ("weight_norm", "orthogonal"):
        return Loop(_parametrized(name))
    if name in ("fwd_hook", "fwd_pre_hook", "root_hook", "root_pre_hook", "bwd_hook"):
        return Loop(_hooked(name))
    if name == "tied":
        return Loop(Net(tie=True))
    if name == "functional_call":
        net = Net()
        return Functional(net, [p.detach().clone().requires_grad_() for p in net.parameters()])
    if name in ("dict", "tuple"):
        return Loop(Net(returns=name))
    if name == "retain_graph":
        return RetainGraph(Net())
    if name == "grad_penalty":
        return GradPenalty(Net())
    return build_more(name)


def build_more(name: str) -> Loop:  # noqa: PLR0911 (one case a line)
    """The loops of the training patterns below ``grad_penalty`` in ``PATTERNS``."""
    if name == "lbfgs":
        return Lbfgs(Net())
    if name == "ema":
        return Ema(Net())
    if name in ("val_no_grad", "val_grad"):
        return Validate(Net(), grad=name == "val_grad")
    if name == "varlen":
        return VarLen(Net())
    if name == "sub_compile":
        net = Net()
        net.blocks[1].compile(backend="aot_eager")
        return Loop(net)
    if name == "user_checkpoint":
        return Loop(Net(ckpt=True))
    if name in ("bf16", "freeze", "unfreeze", "dropout", "skip"):
        return Change(Net(), name)
    if name == "two_forwards":
        return TwoForwards(Net())
    if name == "no_grad_first":
        return NoGradFirst(Net())
    if name == "backward_inputs":
        return BackwardInputs(Net())
    if name == "func_grad":
        return FuncGrad(Net())
    if name in ("accelerate_before", "accelerate_after"):
        return Accelerate(Net(), name.split("_")[1])
    if name in ("gpt2", "gpt2_checkpointing"):
        return Gpt2(checkpointing=name == "gpt2_checkpointing")
    return build_beside(name)


def build_beside(name: str) -> Loop:  # noqa: PLR0911 (one case a line)
    """The loops of the patterns from ``interleaved`` on in ``PATTERNS``."""
    if name == "interleaved":
        return Interleaved(Net())
    if name == "skip_step":
        return SkipStep(Net())
    if name == "optimize_input":
        return OptimizeInput()
    if name == "adversarial":
        return Adversarial(Net())
    if name == "two_models":
        return TwoModels(Pair())
    if name == "lora":
        return Lora()
    if name in ("cnn", "channels_last"):
        return Images(channels_last=name == "channels_last")
    if name in ("optimizer_in_backward", "grad_clamp_hook", "anomaly"):
        return InBackward(Net(), name.split("_")[0].replace("grad", "clamp"))
    if name == "float64":
        return Loop(Net().double())
    raise KeyError(name)


PATTERNS = ["gradscaler", "accumulate", "weight_norm", "orthogonal", "fwd_hook",
            "fwd_pre_hook", "root_hook", "root_pre_hook", "bwd_hook", "tied",
            "functional_call", "dict", "tuple", "retain_graph", "grad_penalty",
            "lbfgs", "ema", "val_no_grad", "val_grad", "varlen", "sub_compile",
            "user_checkpoint", "bf16", "freeze", "unfreeze", "two_forwards", "no_grad_first",
            "backward_inputs", "func_grad", "accelerate_before", "accelerate_after", "gpt2",
            "gpt2_checkpointing", "trainer", "interleaved", "skip_step", "optimize_input",
            "adversarial", "two_models", "lora", "cnn", "channels_last",
            "optimizer_in_backward", "grad_clamp_hook", "anomaly", "float64", "dropout",
            "skip"]


def train(loop: Loop, attach: Callable[[torch.nn.Module], Any] | None,
          backend: str | None = None) -> tuple[list, dict]:
    """STEPS AdamW steps: per step the loss, every gradient, then the state after it.
    ``backend``: the run without SlackSwap compiles the model in place with it, as
    ``attach(compile=True)`` does."""
    torch._dynamo.reset()
    if backend is not None and attach is None:
        for model in loop.attached():
            model.compile(backend=backend, fullgraph=True, dynamic=False)
    params = loop.params or list(loop.model.parameters())
    opt = loop.optimizer(params)
    info: dict[str, Any] = {"verified": 0, "off_path": 0, "offloaded": 0, "recomputed": 0}
    attached = [attach(m) for m in loop.attached()] if attach is not None else []
    records = []
    try:
        for step in range(STEPS):
            torch.manual_seed(100 + step)
            loop.before(step)
            rec = {"loss": loop.backward(step).detach().clone()}
            named = ([(str(i), p) for i, p in enumerate(loop.params)] if loop.params
                     else list(loop.model.named_parameters()))
            for n, p in named:
                rec[f"grad {n}"] = None if p.grad is None else p.grad.clone()
            loop.step(opt, rec)
            opt.zero_grad(set_to_none=True)
            for i, p in enumerate(loop.params):
                rec[f"param {i}"] = p.detach().clone()
            records.append(after_step(loop.model, rec))
            for one in attached:
                count_stats(info, one)
    finally:
        for one in attached:
            one.detach()
    return records, info


def train_hf(callback: Any, backend: str | None, out: str, bf16: bool = True,
             accumulate: int = 2, evaluate: bool = True, pad: int = 8) -> tuple[list, dict]:
    """``transformers.Trainer`` on the CPU (bf16, two micro-batches a step, gradient
    clipping, dropout, lengths padded to 8 or 16: two batch shapes, an evaluation after
    each step) on a tiny GPT-2 from its config: per optimizer step, the parameters, the
    logged loss and gradient norm, the evaluation loss and torch's RNG state."""
    import transformers

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            records.append(after_step(model, {}))

    torch._dynamo.reset()
    model = Gpt2(checkpointing=False).model
    if backend is not None and callback is None:
        model.compile(backend=backend, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(0, VOCAB, (int(n),), generator=g)
             for n in torch.randint(3, 13, (16,), generator=g))]
    collator = transformers.DataCollatorForLanguageModeling(_Tokenizer(), mlm=False,
                                                            pad_to_multiple_of=pad)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate, use_cpu=True, bf16=bf16, report_to=[],
        learning_rate=1e-2, save_strategy="no", logging_steps=1,
        eval_strategy="steps" if evaluate else "no", eval_steps=1,
        per_device_eval_batch_size=4, disable_tqdm=True, seed=0)
    records: list[dict] = []
    callbacks = [Record()] if callback is None else [callback, Record()]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   eval_dataset=data[:4], data_collator=collator,
                                   callbacks=callbacks)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    for rec, i in zip(records, range(STEPS), strict=True):
        for h in logs:
            if h.get("step") == i + 1:
                rec.update({k: torch.tensor(float(v)) for k, v in h.items()
                            if k in ("loss", "grad_norm", "eval_loss")})
    info: dict[str, Any] = {"verified": 0, "off_path": 0, "offloaded": 0, "recomputed": 0}
    if callback is not None:
        count_stats(info, callback.attached)
    return records, info


class _Tokenizer:
    """What ``DataCollatorForLanguageModeling`` asks of a tokenizer to pad token ids."""

    pad_token_id, padding_side = 0, "right"
    model_input_names = ["input_ids"]

    def pad(self, examples: list[dict], pad_to_multiple_of: int | None = None,
            return_tensors: str = "pt", **kwargs: Any) -> dict[str, torch.Tensor]:
        n = max(len(e["input_ids"]) for e in examples)
        n = -(-n // (pad_to_multiple_of or 1)) * (pad_to_multiple_of or 1)
        ids = torch.zeros(len(examples), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(examples):
            ids[i, :len(e["input_ids"])] = e["input_ids"]
            mask[i, :len(e["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}


def run(name: str, budget: float, strategy: str = "slackswap",
        backend: str | None = None) -> str:
    """``backend``: compiled (``attach(compile=True)`` against ``model.compile()``); under
    Inductor with deterministic algorithms (on a CPU its embedding backward is not
    deterministic otherwise)."""
    plain, mine = runs(name, budget, strategy, backend)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or backend == "inductor")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                want, _ = plain()
            except Exception as e:  # what plain PyTorch cannot run: SlackSwap's own word?
                return f"plain PyTorch raised {_last_line(e)}; with SlackSwap: {run_alone(mine)}"
            got, info = mine()
    except SlackSwapError as e:
        return f"refused({str(e).splitlines()[0]})"
    except Exception as e:  # a traceback where a one-line refusal belongs
        return f"MISMATCH(raised {_last_line(e)})"
    finally:
        torch.use_deterministic_algorithms(deterministic)
    diff = compare(got, want)
    if diff:
        return f"MISMATCH({diff})"
    return (f"identical [recomputed {info['recomputed']}, offloaded {info['offloaded']} B, "
            f"off path {info['off_path']}]")


def runs(name: str, budget: float, strategy: str, backend: str | None,
         ) -> tuple[Callable[[], tuple], Callable[[], tuple]]:
    """Pattern ``name`` trained without SlackSwap, and with it."""
    compiled = {} if backend is None else {"compile": True, "backend": backend}
    if name == "trainer":
        from slackswap.integrations.hf import SlackSwapCallback

        out = tempfile.mkdtemp()
        return (lambda: train_hf(None, backend, out),
                lambda: train_hf(SlackSwapCallback(budget=budget, strategy=strategy,
                                                   **compiled), None, out))
    return (lambda: train(build(name), None, backend),
            lambda: train(build(name), lambda m: slackswap.attach(
                m, budget=budget, strategy=strategy, **compiled)))


def _last_line(e: BaseException) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip().splitlines()[0][:300]


def run_alone(mine: Callable[[], tuple]) -> str:
    """The run with SlackSwap where the plain one raised: a one-line refusal, or what."""
    try:
        mine()
    except SlackSwapError as e:
        return f"refused({str(e).splitlines()[0]})"
    except Exception as e:  # noqa: BLE001
        return f"raised {_last_line(e)}"
    return "trained"


# the planner offloads everything on these tiny models at the default hardware:
# recompute-only makes the rebuilds run too
SETTINGS = [(0.7, "slackswap", None), (0.3, "slackswap", None),
            (0.5, "recompute-only", None), (0.7, "recompute-only", None),
            (0.7, "slackswap", "aot_eager"), (0.5, "slackswap", "aot_eager"),
            (0.7, "slackswap", "inductor")]


def main(words: list[str]) -> None:
    for name in PATTERNS:
        for budget, strategy, backend in SETTINGS:
            label = f"attach {backend or 'eager'} {name} {budget} {strategy}"
            if words and not any(w in label for w in words):
                continue
            print(f"{label} -> {run(name, budget, strategy, backend)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
