"""The runtime on Hugging Face architectures that are not presets, as they come: ids from
a fake-tensor profile (a traced one where the model reads a value in forward) find their
tensors in the real step, and gradients are bit-identical with every saved activation
offloaded, recomputed, or a mix, dropout on."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_runtime import assert_identical, run
from torch._subclasses.fake_tensor import FakeTensorMode

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import ProfileError

_SMALL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=128)
ARCHITECTURES = {
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(_SMALL, num_key_value_heads=2, attention_dropout=0.1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(_SMALL, num_key_value_heads=2, attention_dropout=0.1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(_SMALL, num_key_value_heads=2, head_dim=16, attention_dropout=0.1)),
    "phi": ("PhiConfig", "PhiForCausalLM",
            dict(_SMALL, resid_pdrop=0.1, attention_dropout=0.1, embd_pdrop=0.1)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=128, dropout=0.1, attention_dropout=0.1, word_embed_proj_dim=64)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    hidden_dropout=0.1, attention_dropout=0.1)),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(vocab_size=300, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.1,
                   attention_dropout=0.1)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM",
                dict(_SMALL, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
    "electra": ("ElectraConfig", "ElectraForMaskedLM",
                dict(_SMALL, embedding_size=64, hidden_dropout_prob=0.1)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM",
               dict(_SMALL, embedding_size=32, hidden_dropout_prob=0.1)),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_is_bit_identical_under_any_plan(name: str) -> None:
    config_class, model_class, kwargs = ARCHITECTURES[name]
    if not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_class)(**kwargs)
    cls = getattr(transformers, model_class)
    # SDPA where this transformers has it for the class (not Bloom; not GPT-J under 5.17)
    config._attn_implementation = "sdpa" if cls._supports_sdpa else "eager"
    config.use_cache = False
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with FakeTensorMode():
        fake = cls(config)
    torch.manual_seed(0)
    model = cls(config)
    fake.train()
    model.train()
    try:
        profile = slackswap.profile(fake, batch, kernels="native", name=name)
    except ProfileError as e:
        # NOTE [a model that reads a value]: OPT's LayerDrop under transformers 5.17 draws
        # and compares in forward, which fake tensors cannot answer: a traced profile can
        if "reads a tensor's value in forward" not in str(e):
            raise
        profile = slackswap.profile(model, batch, mode="traced", kernels="native", name=name)
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    reference = run(model, batch)
    mixes = [{n: d for n in names} for d in ("offload", "recompute")]
    mixes.append({n: ("keep", "offload", "recompute")[i % 3] for i, n in enumerate(names)})
    for decisions in mixes:
        plan = Plan(fingerprint=profile.fingerprint, strategy="x", decisions=decisions)
        assert_identical(run(model, batch, plan), reference)
