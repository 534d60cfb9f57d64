"""Reference workloads (DESIGN.md) built from ``transformers`` configs with no download."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from slackswap.errors import InputError

__all__ = ["ModelPreset", "MODEL_PRESETS", "build_model", "load_factory", "load_loss",
           "load_workload", "DTYPES", "with_layers"]

# The most tokens a preset's batch holds: its ids and labels are real tensors (1 GiB at
# this size), and fit's search stops at batch 65536 of 1024.
MAX_TOKENS = 2**26
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TINY = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 1000}


@dataclass(frozen=True)
class ModelPreset:
    """A named workload: architecture, size and the reference batch shape."""

    name: str
    family: str  # "bert", "gpt2" or "llama"
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    batch: int
    seq: int
    extra: dict[str, Any] = field(default_factory=dict)
    # BERT only: positions per sequence the MLM head and loss run on (0: all of them, as
    # Hugging Face's BertForMaskedLM does); see NOTE [masked positions]
    predictions: int = 0

    def config(self, seq: int, attn: str) -> Any:
        import transformers

        if self.family == "bert":
            cfg = transformers.BertConfig(
                num_hidden_layers=self.layers, hidden_size=self.hidden,
                num_attention_heads=self.heads, intermediate_size=self.ffn,
                vocab_size=self.vocab, max_position_embeddings=max(512, seq), **self.extra,
            )
        elif self.family == "gpt2":
            cfg = transformers.GPT2Config(
                n_layer=self.layers, n_embd=self.hidden, n_head=self.heads, n_inner=self.ffn,
                vocab_size=self.vocab, n_positions=max(1024, seq), use_cache=False,
                activation_function="gelu_pytorch_tanh", **self.extra,
            )
        else:
            cfg = transformers.LlamaConfig(
                num_hidden_layers=self.layers, hidden_size=self.hidden,
                num_attention_heads=self.heads, num_key_value_heads=self.heads,
                intermediate_size=self.ffn, vocab_size=self.vocab,
                max_position_embeddings=max(4096, seq), use_cache=False, **self.extra,
            )
        cfg._attn_implementation = attn
        if self.predictions:
            cfg.max_predictions_per_seq = self.predictions
        return cfg

    def model_class(self) -> Any:
        import transformers

        if self.predictions:
            return _bert_for_masked_positions()
        return {
            "bert": transformers.BertForMaskedLM,
            "gpt2": transformers.GPT2LMHeadModel,
            "llama": transformers.LlamaForCausalLM,
        }[self.family]


# NOTE [masked positions]
#     BERT is pretrained with masked language modelling: 15% of the positions of a
#     sequence are masked and predicted (``masked_lm_prob`` 0.15 in the repository below,
#     data/bertPrep.py). Hugging Face's BertForMaskedLM (``bert-large``)
#     runs its prediction head (dense, GELU, LayerNorm, the vocabulary projection) and the
#     loss on every position, ignoring the unmasked ones' labels. NVIDIA's reference
#     pretraining gathers the masked positions first and runs the head on those only:
#     NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT (commit 729963dd, 2024),
#     modeling.py BertPreTrainingHeads.forward (``torch.index_select`` of the positions
#     whose label is not -1, on by default: run_pretraining.py's flag is
#     ``--no_dense_sequence_output``), with ``--max_seq_length=512
#     --max_predictions_per_seq=80`` in phase 2 (scripts/run_pretraining.sh); Google's
#     TensorFlow BERT, which the same repository keeps, gathers its
#     ``max_predictions_per_seq`` positions the same way (TensorFlow/LanguageModeling/BERT/
#     run_pretraining.py, ``gather_indexes``). ``bert-large-mlm`` is
#     that model: the head on 80 of the 512 positions (the cap: an upper estimate of
#     the head's cost), at fixed positions spread evenly over the sequence, so a profile
#     needs no data and is reproducible. Its tiny variant predicts 5 of 32 (the same
#     share). NVIDIA's BertForPreTraining also has a next-sentence head, left out here
#     as in ``bert-large``: a [batch, 2] output.
_BERT_PREDICTIONS = 80  # max_predictions_per_seq at seq 512, NOTE [masked positions]


def _presets() -> dict[str, ModelPreset]:
    full = [
        ModelPreset("bert-large", "bert", 24, 1024, 16, 4096, 30522, 32, 512),
        ModelPreset("gpt2-xl", "gpt2", 48, 1600, 25, 6400, 50257, 8, 1024),
        ModelPreset("llama-7b", "llama", 32, 4096, 32, 11008, 32000, 1, 4096),
        ModelPreset("bert-large-mlm", "bert", 24, 1024, 16, 4096, 30522, 32, 512,
                    predictions=_BERT_PREDICTIONS),
    ]
    tiny = [
        ModelPreset(f"{p.name}-tiny", p.family, **_TINY, batch=2, seq=32,
                    predictions=-(-p.predictions * 32 // p.seq))
        for p in full
    ]
    return {p.name: p for p in full + tiny}


MODEL_PRESETS: dict[str, ModelPreset] = _presets()


@functools.cache
def _bert_for_masked_positions() -> type:
    """BertForMaskedLM with its head and loss on ``config.max_predictions_per_seq``
    positions per sequence (NOTE [masked positions])."""
    import transformers
    from transformers.modeling_outputs import MaskedLMOutput

    class BertForMaskedPositions(transformers.BertForMaskedLM):
        """The masked positions are gathered before the prediction head, as NVIDIA's
        BERT pretraining does; they are fixed, evenly spaced positions of each sequence."""

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                    **kwargs: Any) -> Any:
            hidden = self.bert(input_ids, **kwargs)[0]
            b, s = input_ids.shape
            k = min(self.config.max_predictions_per_seq, s)
            picks = torch.arange(k, device=input_ids.device) * s // k
            rows = torch.arange(b, device=input_ids.device).unsqueeze(1) * s
            index = (rows + picks).reshape(-1)  # into the [b * s] flattened positions
            picked = torch.index_select(hidden.reshape(b * s, -1), 0, index)
            scores = self.cls(picked)
            loss = None
            if labels is not None:
                loss = torch.nn.functional.cross_entropy(
                    scores, torch.index_select(labels.reshape(-1), 0, index))
            return MaskedLMOutput(loss=loss, logits=scores)

    return BertForMaskedPositions


def with_layers(name: str, layers: int | None) -> str:
    """Register ``<name>@<layers>``, preset ``name`` with fewer (or more) layers, to fit a
    device; returns the name to build. ``None`` returns ``name`` unchanged."""
    if not layers:
        return name
    derived = f"{name}@{layers}"
    MODEL_PRESETS[derived] = dataclasses.replace(MODEL_PRESETS[name], name=derived,
                                                 layers=layers)
    return derived


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    name: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    attn: str = "sdpa",
    dtype: str = "bf16",
    fake: bool = True,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Build a preset in training mode and its example batch (``input_ids`` and ``labels``).

    ``fake=True`` builds the weights under ``FakeTensorMode``: no memory, for analytic
    profiling of full-size models. The batch is always real (it is small).
    """
    if name not in MODEL_PRESETS:
        raise InputError(
            f"unknown model '{name}'; presets: {', '.join(MODEL_PRESETS)} "
            "(or package.module:factory)"
        )
    if attn not in ("sdpa", "eager"):
        raise InputError(f"unknown attention '{attn}'; use sdpa or eager")
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    preset = MODEL_PRESETS[name]
    b = preset.batch if batch is None else batch
    s = preset.seq if seq is None else seq
    if b <= 0 or s <= 0:
        raise InputError("--batch and --seq must be positive")
    if b * s > MAX_TOKENS:
        raise InputError(f"batch {b} of sequence length {s} is {b * s:.3g} tokens, more than "
                         f"the {MAX_TOKENS:,} a profile takes; use a smaller --batch or --seq")
    import transformers

    transformers.logging.set_verbosity_error()
    config = preset.config(s, attn)
    torch.manual_seed(seed)
    # real weights are made where they will train (a GPU initialises billions in seconds)
    mode = FakeTensorMode() if fake else torch.device(device)
    try:
        with mode, _default_dtype(DTYPES[dtype]):
            model = preset.model_class()(config)
        model.train()
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, preset.vocab, (b, s), generator=generator)
    except (RuntimeError, MemoryError, OverflowError, TypeError) as e:
        what = "out of memory" if "alloc" in str(e) or isinstance(e, MemoryError) else (
            str(e).splitlines()[0][:120])
        raise InputError(f"cannot build {name} at batch {b}, sequence length {s}: {what}; "
                         "use a smaller --batch or --seq") from None
    if not fake:
        model, ids = model.to(device), ids.to(device)
    return model, {"input_ids": ids, "labels": ids.clone()}


def _imported(spec: str, what: str) -> Any:
    """The object ``package.module:name`` names (``what`` says what it is, for errors);
    modules in the working directory import, as with ``python -m``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"'{spec}' is not package.module:{what}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise InputError(f"cannot import {what} '{spec}': {e}") from None


def load_factory(spec: str) -> tuple[torch.nn.Module, Any]:
    """Call a ``package.module:factory`` that returns ``(model, example_batch)``."""
    factory = _imported(spec, "factory")
    try:
        result = factory()
    except Exception as e:
        raise InputError(f"factory '{spec}' raised {type(e).__name__}: {e}") from None
    is_pair = isinstance(result, tuple) and len(result) == 2
    if not (is_pair and isinstance(result[0], torch.nn.Module)):
        raise InputError(f"factory '{spec}' must return (model, example_batch)")
    return result


def load_loss(spec: str) -> Callable[[Any], torch.Tensor]:
    """A ``package.module:function`` the command line's ``--loss`` names: the profiled
    step's ``loss_fn``, called with whatever the model's forward returns and returning
    the scalar loss (see :func:`slackswap.profile`)."""
    fn = _imported(spec, "function")
    if not callable(fn):
        raise InputError(f"--loss '{spec}' is a {type(fn).__name__}, not a function; name "
                         "a function loss(output) -> scalar tensor")
    return fn


def load_workload(
    spec: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    attn: str | None = None,
    dtype: str | None = None,
    fake: bool = True,
    device: str = "cpu",
) -> tuple[torch.nn.Module, Any]:
    """A preset name (with shape options) or a ``package.module:factory``.

    Presets are built fake (for analytic profiling) or real on ``device``; a factory
    returns its model as it builds it.
    """
    if ":" in spec:
        given = [o for o, v in (("--batch", batch), ("--seq", seq), ("--attn", attn),
                                ("--dtype", dtype)) if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} apply to presets only, not to factory '{spec}'")
        return load_factory(spec)
    return build_model(spec, batch=batch, seq=seq, attn=attn or "sdpa", dtype=dtype or "bf16",
                       fake=fake, device=device)
