"""Scout: the compiled path (``slackswap.compile``, ``attach(compile=True)``), the eager
``attach`` under functional calls, EMAs and dtype changes, and the Trainer and Lightning
callbacks under resume, accumulation, mixed precision and evaluation, each compared bit for
bit (``torch.equal``: loss, every gradient, parameters and buffers after each optimizer step)
with the same run without SlackSwap from the same state and seeds. A compiled run's reference
is the same ``torch.compile`` without a plan, with the same backend and options.

    python benchmarks/scout_compiled.py                # every case
    python benchmarks/scout_compiled.py gpt2 attach    # the cases whose name has a word

The callbacks' cases whose name has ``lora`` or ``dora`` train a peft LoRA (DoRA) GPT-2
(peft is not a test dependency: a case skips without it); ``eager`` in a callback case's name
attaches without ``compile=True``, ``0.3`` plans at 0.3 (else 0.7). Compiled cases under
Inductor run with deterministic algorithms.

Each case prints ``identical``, ``refused(<the one-line error>)`` or ``MISMATCH(<what>)``
(or ``skipped(<why>)`` when an optional package is missing). Tiny models (hidden 32-64,
two layers), configs only: no weights are downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import slackswap
from slackswap.errors import SlackSwapError

STEPS = 3


class Mismatch(Exception):
    """What differed from the run without SlackSwap."""


# -- models ----------------------------------------------------------------------------------
def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(dropout: float = 0.1) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    return _causal("GPT2", vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                   resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


def llama(dropout: float = 0.1) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    return _causal("Llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   max_position_embeddings=64, attention_dropout=dropout)


def _causal(family: str, **config: Any) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    tf = _tf()
    head = "LMHeadModel" if family == "GPT2" else "ForCausalLM"
    torch.manual_seed(0)
    return getattr(tf, family + head)(getattr(tf, family + "Config")(**config)).train(), \
        _lm_batch


def bert(dropout: float = 0.1) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    tf = _tf()
    config = tf.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                           hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                           num_labels=3)
    torch.manual_seed(0)

    def batch(n: int) -> dict:
        g = torch.Generator().manual_seed(n)
        return {"input_ids": torch.randint(0, 128, (2, n), generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)}
    return tf.BertForSequenceClassification(config).train(), batch


def t5(dropout: float = 0.1) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    tf = _tf()
    config = tf.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                         num_heads=2, dropout_rate=dropout, decoder_start_token_id=0)
    torch.manual_seed(0)

    def batch(n: int) -> dict:
        g = torch.Generator().manual_seed(n)
        return {"input_ids": torch.randint(0, 128, (2, n), generator=g),
                "labels": torch.randint(0, 128, (2, n // 2), generator=g)}
    return tf.T5ForConditionalGeneration(config).train(), batch


def vit(dropout: float = 0.1) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    tf = _tf()
    config = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_labels=3,
                          hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)

    def batch(n: int) -> dict:
        g = torch.Generator().manual_seed(n)
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)}
    return tf.ViTForImageClassification(config).train(), batch


def _lm_batch(n: int) -> dict:
    ids = torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": ids.clone()}


def lora(dropout: float = 0.1, dora: bool = False) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    """A peft LoRA (or DoRA) GPT-2: its adapters trained, the base frozen."""
    import peft

    model, make = gpt2(dropout)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=dora,
                             target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    return peft.get_peft_model(model, config).train(), make


def dora(dropout: float = 0.1) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    return lora(dropout, dora=True)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "vit": vit}


def _resolve_loss(model: torch.nn.Module, batch: dict) -> None:
    """What the compiled call resolves for the call (NOTE [a loss resolved before the
    graph]), set on the reference once: the same loss, one graph."""
    from slackswap.compiled.api import _falling_back, resolve_problem_type

    for m in _falling_back(model):
        m.loss_type = "ForCausalLM"
    if type(model).__name__.endswith("ForSequenceClassification"):
        resolve_problem_type(model, batch)


# -- comparing -------------------------------------------------------------------------------
def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in
            [*model.named_parameters(), *model.named_buffers()]}


def compare(got: list, want: list) -> None:
    if len(got) != len(want):
        raise Mismatch(f"{len(got)} records against {len(want)}")
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for key in b:
            x, y = a.get(key), b[key]
            if x is None or y is None:
                if x is not y:
                    raise Mismatch(f"step {i}: {key} None on one side")
            elif x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else "shape"
                raise Mismatch(f"step {i}: {key} differs (max {diff})")


def train(model: torch.nn.Module, call: Callable[[dict], Any], batches: list[dict],
          bf16: bool = False, after_step: Callable[[], None] | None = None) -> list[dict]:
    """AdamW steps: per step the loss, every gradient, then parameters and buffers."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    records = []
    for batch in batches:
        torch.manual_seed(len(records) + 1)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = call(batch)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        rec = {"loss": loss.detach().clone()}
        rec |= {f"grad:{n}": None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        rec |= {f"after:{n}": t for n, t in state(model).items()}
        if after_step is not None:
            after_step()
        records.append(rec)
    return records


def compiled_case(name: str, budget: float, backend: str = "aot_eager", bf16: bool = False,
                  lengths: tuple[int, ...] = (16,), dropout: float = 0.1,
                  **compile_kwargs: Any) -> str:
    """``slackswap.compile`` against ``torch.compile`` with the same backend and options.
    Under Inductor, with deterministic algorithms: on a CPU its embedding backward adds
    with atomics across threads, and plain torch.compile did not match itself (BERT's
    token-type embedding's gradient, 2e-10 apart from one run to the next)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or backend == "inductor")
    try:
        return _compiled_case(name, budget, backend, bf16, lengths, dropout, compile_kwargs)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _compiled_case(name: str, budget: float, backend: str, bf16: bool,
                   lengths: tuple[int, ...], dropout: float, compile_kwargs: dict) -> str:
    model, make = MODELS[name](dropout)
    batches = [make(n) for n in lengths for _ in range(STEPS)]
    reference = copy.deepcopy(model)
    _resolve_loss(reference, batches[0])
    torch._dynamo.reset()
    plain = torch.compile(reference, backend=backend, fullgraph=True,
                          **({"dynamic": False} | compile_kwargs))
    want = train(reference, lambda b: plain(**b), batches, bf16)
    torch._dynamo.reset()
    with _autocast(bf16):
        compiled = slackswap.compile(model, batches[0], budget=budget, backend=backend,
                                     **compile_kwargs)
    got = train(model, lambda b: compiled(**b), batches, bf16)
    compare(got, want)
    applied = [g.applied.summary() for g in compiled.slackswap.graphs]
    return " ".join(f"[recomputed {a['recomputed']}, offloaded {a['offloaded']}, rng states "
                    f"{a['rng_states']}]" for a in applied)


@contextlib.contextmanager
def _autocast(bf16: bool) -> Iterator[None]:
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        yield


def copied_case(name: str) -> None:
    """A deep copy of a ``slackswap.compile`` module (an EMA's) trains as ``torch.compile``."""
    model, make = MODELS[name](0.1)
    batches = [make(16) for _ in range(STEPS)]
    compiled = slackswap.compile(model, batches[0], budget=0.7, backend="aot_eager")
    twin = copy.deepcopy(compiled)
    reference = copy.deepcopy(model)
    _resolve_loss(reference, batches[0])
    plain = torch.compile(reference, backend="aot_eager", fullgraph=True, dynamic=False)
    compare(train(twin._orig_mod, lambda b: twin(**b), batches),
            train(reference, lambda b: plain(**b), batches))


def attach_compiled_case(name: str, budget: float, what: str) -> None:
    """``attach(compile=True)`` (aot_eager) against ``model.compile()``, then ``what``."""
    model, make = MODELS[name](0.1)
    batches = [make(16) for _ in range(STEPS)]
    reference = copy.deepcopy(model)
    _resolve_loss(reference, batches[0])
    torch._dynamo.reset()
    reference.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    want = train(reference, lambda b: reference(**b), batches)
    torch._dynamo.reset()
    attached = slackswap.attach(model, budget=budget, compile=True, backend="aot_eager")
    got = train(model, lambda b: model(**b), batches)
    compare(got, want)
    if what == "deepcopy":  # the copy trains as plain PyTorch (eager), as the original would
        twin, mine = copy.deepcopy(model), copy.deepcopy(reference)
        mine._compiled_call_impl = None
        compare(train(twin, lambda b: twin(**b), batches),
                train(mine, lambda b: mine(**b), batches))
    elif what == "save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        mine = copy.deepcopy(reference)
        mine._compiled_call_impl = None
        compare(train(loaded, lambda b: loaded(**b), batches),
                train(mine, lambda b: mine(**b), batches))
    elif what == "detach":
        attached.detach()
        reference._compiled_call_impl = None
        compare(train(model, lambda b: model(**b), batches),
                train(reference, lambda b: reference(**b), batches))
    elif what == "to_bf16":  # compiled and planned again for the new dtype
        model.to(torch.bfloat16)
        reference.to(torch.bfloat16)
        compare(train(model, lambda b: model(**b), batches),
                train(reference, lambda b: reference(**b), batches))
        if len(attached.graphs) != 2:
            raise Mismatch(f"{len(attached.graphs)} graphs planned, not 2")
    elif what == "twice":
        try:
            slackswap.attach(model, budget=budget, compile=True, backend="aot_eager")
        except SlackSwapError:
            pass
        else:
            raise Mismatch("attached twice without a refusal")
    attached.detach()


# -- the eager attach --------------------------------------------------------------------------
def eager_case(what: str, budget: float = 0.7) -> None:
    model, make = gpt2(0.1)
    batches = [make(16) for _ in range(STEPS)]
    reference = copy.deepcopy(model)
    if what == "functional_call":
        def runner(m: torch.nn.Module) -> Callable[[dict], Any]:
            return lambda b: torch.func.functional_call(m, dict(m.named_parameters()), (), b)
    elif what == "stateless":
        def runner(m: torch.nn.Module) -> Callable[[dict], Any]:
            return lambda b: torch.nn.utils.stateless._functional_call(
                m, dict(m.named_parameters()), (), b)
    else:
        def runner(m: torch.nn.Module) -> Callable[[dict], Any]:
            return lambda b: m(**b)
    if what == "ema":
        emas = [torch.optim.swa_utils.AveragedModel(m) for m in (reference, model)]
        hooks = [lambda e=e, m=m: e.update_parameters(m) for e, m in
                 zip(emas, (reference, model), strict=True)]
    else:
        hooks = [None, None]
    want = train(reference, runner(reference), batches, after_step=hooks[0])
    with slackswap.attach(model, budget=budget):
        got = train(model, runner(model), batches, after_step=hooks[1])
        if what == "ema":
            compare([state(emas[1])], [state(emas[0])])
        if what == "to_bf16":
            model.to(torch.bfloat16)
            reference.to(torch.bfloat16)
            got += train(model, runner(model), batches)
            want += train(reference, runner(reference), batches)
    compare(got, want)


# -- graph breaks ------------------------------------------------------------------------------
class _Breaks(torch.nn.Module):
    """A GPT-2 whose forward breaks the graph: ``print`` or ``.item()``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.inner, self.how = gpt2(0.1)[0], how

    def forward(self, **batch: Any) -> Any:
        out = self.inner(**batch)
        if self.how == "print":
            print("loss", out.loss)
        elif self.how == "item" and out.loss.item() > 1e9:
            return out.logits.sum()
        return out


def break_case(how: str, attach: bool) -> None:
    model = _Breaks(how).train()
    batch = _lm_batch(16)
    torch._dynamo.reset()
    with contextlib.redirect_stdout(io.StringIO()):
        if attach:
            with slackswap.attach(model, budget=0.7, compile=True, backend="aot_eager"):
                model(**batch).loss.backward()
        else:
            slackswap.compile(model, batch, budget=0.7, backend="aot_eager")
    raise Mismatch("a graph break trained without a refusal")


# -- frameworks ------------------------------------------------------------------------------
def _lit(model: torch.nn.Module) -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def validation_step(self, batch: dict, batch_idx: int) -> None:
            self.model(**batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
    return pl, LitLM()


def _examples(lengths: tuple[int, ...] = (16,), n: int = 8) -> list[dict]:
    return [{k: v[i] for k, v in _lm_batch(length).items()} for length in lengths
            for i in range(2)][:n] * (n // (2 * len(lengths)))


def lightning_case(what: str) -> None:
    """Lightning, plain against SlackSwap's callback (compile=True: against
    ``model.compile()``), both the same way: ``resume`` fits 2 steps, then 2 more from the
    checkpoint (and is compared with an uninterrupted run too)."""
    from slackswap.integrations.lightning import SlackSwapCallback

    compiled = what != "resume eager" and "eager" not in what
    dropout = 0.0 if what.startswith("resume") else 0.1
    build = {"lora": lora, "dora": dora}.get(what.split()[0], gpt2)

    def fit(model: torch.nn.Module, slack: bool, root: str, steps: int = 4,
            ckpt: str | None = None, **trainer: Any) -> torch.nn.Module:
        pl, lit = _lit(model)
        callbacks = []
        if slack:
            callbacks.append(SlackSwapCallback(
                budget=0.3 if "0.3" in what else 0.7, module="model", compile=compiled, **(
                    {"backend": "aot_eager"} if compiled else {})))
        torch.manual_seed(0)
        t = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                       callbacks=callbacks, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=root,
                       enable_checkpointing=ckpt is not None or steps == 2, **trainer)
        data = torch.utils.data.DataLoader(_examples(n=16), batch_size=2)
        t.fit(lit, data, val_dataloaders=data if "val" in what else None, ckpt_path=ckpt)
        return model

    def run(slack: bool) -> dict[str, torch.Tensor]:
        model, _ = build(dropout)
        torch._dynamo.reset()
        if compiled and not slack:
            _resolve_loss(model, _lm_batch(16))
            model.compile(backend="aot_eager", fullgraph=True, dynamic=False)
        with tempfile.TemporaryDirectory() as root:
            if what.startswith("resume"):
                fit(model, slack, root, steps=2)
                import glob
                (ckpt,) = glob.glob(f"{root}/**/*.ckpt", recursive=True)
                model, _ = gpt2(dropout)  # a fresh process's model
                torch._dynamo.reset()
                if compiled and not slack:
                    _resolve_loss(model, _lm_batch(16))
                    model.compile(backend="aot_eager", fullgraph=True, dynamic=False)
                fit(model, slack, root, steps=4, ckpt=ckpt)
            elif what == "accumulate":
                fit(model, slack, root, accumulate_grad_batches=2)
            elif what == "bf16":
                fit(model, slack, root, precision="bf16-mixed")
            elif build is not gpt2:
                fit(model, slack, root)
            else:
                fit(model, slack, root, val_check_interval=1, check_val_every_n_epoch=None)
        model._compiled_call_impl = None
        return state(model)

    got, want = run(True), run(False)
    compare([got], [want])


def hf_case(what: str) -> None:
    """A transformers Trainer, plain (``model.compile()`` where compile=True) against
    SlackSwap's callback, the same arguments."""
    tf = _tf()
    from slackswap.integrations.hf import SlackSwapCallback

    compiled = what != "resume eager" and "eager" not in what
    build = {"lora": lora, "dora": dora}.get(what.split()[0], gpt2)

    class CompileInPlace(tf.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any,
                           model: torch.nn.Module, **kwargs: Any) -> None:
            if model._compiled_call_impl is None:
                _resolve_loss(model, _lm_batch(16))
                model.compile(backend="aot_eager", fullgraph=True, dynamic=False)

    def run(slack: bool) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as root:
            args = dict(output_dir=root, max_steps=4, per_device_train_batch_size=2,
                        use_cpu=True, report_to=[], save_strategy="no",
                        logging_strategy="no", disable_tqdm=True, seed=0)
            if what == "accumulate":
                args |= {"gradient_accumulation_steps": 2,
                         "average_tokens_across_devices": True}
            elif what == "eval":
                args |= {"eval_strategy": "steps", "eval_steps": 1}
            elif what == "backend":
                args |= {"torch_compile_backend": "aot_eager"}
            elif what.startswith("resume"):
                args |= {"save_strategy": "steps", "save_steps": 2}

            def trainer(model: torch.nn.Module, steps: int = 4) -> Any:
                cb = [SlackSwapCallback(budget=0.3 if "0.3" in what else 0.7, **({
                    "compile": True,
                    "backend": "aot_eager"} if compiled else {}))] if slack \
                    else [CompileInPlace()] if compiled else []
                data = _examples()
                if what == "accumulate":  # a different count of tokens in each batch
                    data = [{"input_ids": d["input_ids"], "labels": torch.where(
                        torch.arange(16) < 4 + 3 * i, d["labels"], -100)}
                        for i, d in enumerate(data)]
                return tf.Trainer(model=model, args=tf.TrainingArguments(
                    **(args | {"max_steps": steps})), train_dataset=data,
                    eval_dataset=data[:2], callbacks=cb)

            model, _ = build(0.1)
            if what.startswith("resume"):
                trainer(model, 2).train()
                model, _ = build(0.1)
                trainer(model).train(resume_from_checkpoint=f"{root}/checkpoint-2")
            else:
                trainer(model).train()
        model._compiled_call_impl = None
        return state(model)

    got, want = run(True), run(False)
    compare([got], [want])


# -- cases -----------------------------------------------------------------------------------
def cases() -> dict[str, Callable[[], str | None]]:
    out: dict[str, Callable[[], str | None]] = {}
    for name in MODELS:
        for budget in (0.7, 0.5, 0.3):
            out[f"compile aot_eager {name} {budget}"] = (
                lambda n=name, b=budget: compiled_case(n, b))
        for budget in (0.7, 0.3):
            out[f"compile inductor {name} {budget}"] = (
                lambda n=name, b=budget: compiled_case(n, b, "inductor"))
    out["compile inductor gpt2 0.7 bf16"] = lambda: compiled_case("gpt2", 0.7, "inductor",
                                                                  bf16=True)
    out["compile aot_eager llama 0.5 bf16"] = lambda: compiled_case("llama", 0.5, bf16=True)
    out["compile aot_eager gpt2 0.7 two lengths"] = lambda: compiled_case(
        "gpt2", 0.7, lengths=(16, 24))
    out["compile inductor gpt2 0.7 max-autotune-no-cudagraphs"] = lambda: compiled_case(
        "gpt2", 0.7, "inductor", mode="max-autotune-no-cudagraphs")
    out["compile inductor gpt2 0.7 reduce-overhead"] = lambda: compiled_case(
        "gpt2", 0.7, "inductor", mode="reduce-overhead")
    out["compile aot_eager gpt2 0.7 deepcopy"] = lambda: copied_case("gpt2")
    out["compile aot_eager gpt2 0.7 dynamic=True"] = lambda: compiled_case(
        "gpt2", 0.7, dynamic=True)
    for what in ("deepcopy", "save", "detach", "twice", "to_bf16"):
        out[f"attach compile gpt2 {what}"] = lambda w=what: attach_compiled_case("gpt2", 0.7, w)
    for what in ("plain", "functional_call", "stateless", "ema", "to_bf16"):
        out[f"attach eager gpt2 {what}"] = lambda w=what: eager_case(w)
    for how in ("print", "item"):
        out[f"compile graph break {how}"] = lambda h=how: break_case(h, False)
        out[f"attach compile graph break {how}"] = lambda h=how: break_case(h, True)
    for what in ("resume", "resume eager", "accumulate", "bf16", "val"):
        out[f"lightning {what}"] = lambda w=what: lightning_case(w)
    for what in ("resume", "resume eager", "accumulate", "eval", "backend"):
        out[f"hf trainer {what}"] = lambda w=what: hf_case(w)
    for what in ("lora eager", "lora", "dora eager", "dora", "lora 0.3", "lora eager 0.3",
                 "accumulate 0.3"):
        out[f"hf trainer {what}"] = lambda w=what: hf_case(w)
        out[f"lightning {what}"] = lambda w=what: lightning_case(w)
    return out


def run(name: str, case: Callable[[], str | None]) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            note = case()
    except ImportError as e:
        return f"skipped({e})"
    except Mismatch as e:
        return f"MISMATCH({e})"
    except SlackSwapError as e:
        return f"refused({str(e).splitlines()[0]})"
    except Exception as e:  # a traceback where a one-line refusal belongs
        last = traceback.format_exception_only(type(e), e)[-1].strip().splitlines()[0]
        return f"MISMATCH(raised {last[:300]})"
    return "identical" + (f" {note}" if note else "")


def main(words: list[str]) -> None:
    for name, case in cases().items():
        if words and not any(w in name for w in words):
            continue
        print(f"{name} -> {run(name, case)}", flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main(sys.argv[1:])
