"""Scout: model families and training patterns nobody built SlackSwap against (the ``peft``
library, transformers models with shared or reversible layers, rotary caches, dropout in
attention, MoE jitter; diffusers' VAE and a cross-attention UNet in a diffusion step; hooks,
``autograd.grad``, ``backward(inputs=)``, gradient accumulation, ``eval()`` in the middle of
training, ``no_grad`` inside forward, bf16 autocast), trained three AdamW steps under
SlackSwap plans and compared bit for bit with plain PyTorch from the same state and seeds
(loss, every gradient, parameters and buffers after each optimizer step). A plan mode
also fails if a step held more saved bytes than the plan's simulated peak. The second
scout's families (ViTMAE to the EMA codebook, after ``counting_layerdrop`` in ``CASES``)
add random masking, logit softcaps and sliding windows, MoE with shared experts, alibi,
relative position bias, interpolated positions, state-space, recurrent and short-conv
layers, complex FFTs, ProbSparse sampling, padded batches, ``vmap`` and in-place dropout.
The third's (VideoMAE to the time series transformer, after ``llama_outputs``) add video
tubelets, shifted windows, unfolded patches, segmentation with an ignore index, GRN,
SpecAugment masks drawn from numpy (seeded per step, as torch), a conv + LSTM codec,
FFT autocorrelation, random patch masking and distribution heads over lagged inputs.
The fourth's (BigBird to XLM-RoBERTa-XL, after ``fnet_fourier``) add block-sparse attention
with NumPy's random blocks, Longformer's and LED's sliding chunks with global attention,
T5's relative bias, BART's layer drop, DeBERTa-v2's disentangled attention, Funnel's
pooling, ProphetNet's n-gram streams, Perceiver's latents and BLIP-2's Q-Former.

    python benchmarks/scout_families.py gpt2_dropout peft_lora --json out.json

A case whose optional package (``peft``, ``diffusers``) is missing is skipped. Each (case,
mode) prints PASS, REFUSED (the one-line error) or FAIL (what differed, or the
traceback's last line); the last lines are a table of case -> identical / refused / MISMATCH.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch
from scout_vision import PLAN_MODES, after_step, compare, count_stats, plans_for

import slackswap
from slackswap import InputError
from slackswap.core.jsonio import atomic_write_text
from slackswap.errors import SlackSwapError

STEPS = 3
Case = tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor] | None]


def _lm_batch(vocab: int = 96, batch: int = 2, length: int = 12, seed: int = 1,
              labels: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels:
        out["labels"] = ids.clone()
    return out


def _tf(config_name: str, model_name: str, batch: Callable[[], dict] | None = None,
        **kw: Any) -> Callable[[], Case]:
    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**kw)
        model = getattr(transformers, model_name)(config).train()
        return model, (batch or _lm_batch)(), None
    return build


_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, vocab_size=96, max_position_embeddings=64)
_LLAMA = dict(_SMALL, num_key_value_heads=2)


def _cls_batch() -> dict[str, torch.Tensor]:
    b = _lm_batch(labels=False)
    b["labels"] = torch.tensor([0, 1])
    return b


def _gpt2(**kw: Any) -> Callable[[], Case]:
    return _tf("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4,
               vocab_size=96, n_positions=64, **kw)


def _peft(adapter: str, base: Callable[[], Case], input_grads: bool = False,
          bf16_base: bool = False, **kw: Any) -> Callable[[], Case]:
    def build() -> Case:
        import peft

        model, batch, loss_fn = base()
        if bf16_base:  # frozen base weights in bf16, adapters upcast to fp32 by peft
            model = model.to(torch.bfloat16)
        torch.manual_seed(0)
        if adapter == "lora":
            config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, **kw)
        else:
            config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        model = peft.get_peft_model(model, config).train()
        if input_grads:  # as peft's prepare_model_for_kbit_training: a forward hook on
            model.enable_input_require_grads()  # the embeddings sets requires_grad_
        return model, batch, loss_fn
    build.needs = "peft"  # type: ignore[attr-defined]
    return build


def _clip() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, vocab_size=96, max_position_embeddings=16,
                         attention_dropout=0.1),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, image_size=32, patch_size=8,
                           attention_dropout=0.1),
        projection_dim=16)
    model = transformers.CLIPModel(config).train()
    g = torch.Generator().manual_seed(1)
    b = _lm_batch(labels=False, length=10)
    b["pixel_values"] = torch.randn(2, 3, 32, 32, generator=g)
    b["return_loss"] = True
    return model, b, None


def _whisper() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=96, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, d_model=32,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, dropout=0.1, attention_dropout=0.1,
        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        mask_time_prob=0.0)
    model = transformers.WhisperForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(1)
    return model, {"input_features": torch.randn(2, 16, 32, generator=g),
                   "labels": torch.randint(3, 96, (2, 8), generator=g)}, None


def _reformer() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        vocab_size=96, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        feed_forward_size=64, attn_layers=["local", "lsh"], axial_pos_embds=False,
        max_position_embeddings=64, local_attn_chunk_length=4, lsh_attn_chunk_length=4,
        num_buckets=4, chunk_size_feed_forward=4, is_decoder=True, hash_seed=0,
        # its layers draw seeds from torch.seed() (the OS) for dropout: not deterministic
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        pad_token_id=0)
    model = transformers.ReformerModelWithLMHead(config).train()
    model.scout_os_seeded = True  # its layers reseed torch from the OS (``torch.seed()``)
    return model, _lm_batch(length=16), None


def _xlnet() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4,
                                      d_inner=64, dropout=0.1)
    model = transformers.XLNetLMHeadModel(config).train()
    return model, _lm_batch(), None


def _bert_cross() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(**_SMALL, is_decoder=True, add_cross_attention=True,
                                     hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1)
    model = transformers.BertLMHeadModel(config).train()
    g = torch.Generator().manual_seed(2)
    b = _lm_batch()
    b["encoder_hidden_states"] = torch.randn(2, 7, 32, generator=g)
    return model, b, None


class _Diffusion(torch.nn.Module):
    """A diffusion training step: noise drawn inside the step, the model predicts it."""

    def __init__(self, net: torch.nn.Module, cond: bool) -> None:
        super().__init__()
        self.net, self.cond = net, cond

    def forward(self, latents: torch.Tensor, context: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (latents.shape[0],))
        alpha = (1 - t.float() / 1000).view(-1, 1, 1, 1)
        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
        kw = {"encoder_hidden_states": context} if self.cond else {}
        pred = self.net(noisy, t, **kw).sample
        return {"loss": torch.nn.functional.mse_loss(pred, noise)}


def _unet_cross() -> Case:
    import diffusers

    torch.manual_seed(0)
    net = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8)
    g = torch.Generator().manual_seed(1)
    return _Diffusion(net, True).train(), {
        "latents": torch.randn(2, 4, 8, 8, generator=g),
        "context": torch.randn(2, 5, 32, generator=g)}, None


def _dit() -> Case:
    import diffusers

    torch.manual_seed(0)
    net = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000, dropout=0.1)

    class _DiT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> Any:
            return self.net(x, timestep=t, class_labels=torch.zeros_like(t))
    g = torch.Generator().manual_seed(1)
    return _Diffusion(_DiT(), False).train(), {
        "latents": torch.randn(2, 4, 8, 8, generator=g)}, None


class _VAEStep(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        dist = self.vae.encode(x).latent_dist
        z = dist.sample()  # torch.randn inside
        rec = self.vae.decode(z).sample
        return {"loss": torch.nn.functional.mse_loss(rec, x) + 1e-3 * dist.kl().mean()}


def _vae() -> Case:
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
        latent_channels=4, norm_num_groups=8, sample_size=16)
    g = torch.Generator().manual_seed(1)
    return _VAEStep(vae).train(), {"x": torch.randn(2, 3, 16, 16, generator=g)}, None


# -- training patterns on a tiny GPT-2 with dropout ----------------------------------------
def _hooks() -> Case:
    model, batch, loss_fn = _gpt2(resid_pdrop=0.1)()
    grads = []
    model.transformer.h[0].mlp.register_full_backward_hook(
        lambda m, gi, go: grads.append(go[0].sum().item()) or None)
    model.transformer.h[1].attn.register_full_backward_hook(
        lambda m, gi, go: tuple(None if g is None else g * 0.5 for g in gi))
    model.transformer.h[0].register_forward_hook(
        lambda m, i, o: (o[0] * 1.25,) + tuple(o[1:]) if isinstance(o, tuple) else o * 1.25)
    return model, batch, loss_fn


class _NoGradInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.stat = torch.nn.Linear(32, 32)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            scale = self.stat(x).sigmoid()
            scale = self.drop(scale)
        y = self.b(self.drop(h)) * scale
        with torch.no_grad():
            y.mul_(1.0)  # in place on an activation under no_grad
        return {"loss": y.tanh().pow(2).mean()}


def _no_grad_inside() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _NoGradInside().train(), {"x": torch.randn(256, 32, generator=g)}, None


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        pz = torch.nn.utils.parametrizations
        self.a = pz.weight_norm(torch.nn.Linear(32, 64))
        self.b = pz.spectral_norm(torch.nn.Linear(64, 64), n_power_iterations=2)
        self.c = pz.spectral_norm(torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.nn.functional.gelu(self.a(x))
        h = torch.nn.functional.dropout(torch.tanh(self.b(h)), 0.1, self.training)
        return {"loss": self.c(h).logsumexp(-1).mean()}


def _norms() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Normed().train(), {"x": torch.randn(256, 32, generator=g)}, None


class _CountingLayerDrop(torch.nn.Module):
    """LayerDrop (a step may leave the profiled path and run again) with state the forward
    counts in: a Python int, a list and a tensor held outside the buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.calls, self.seen, self.mem = 0, [], torch.zeros(())

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        self.seen.append(self.calls)
        with torch.no_grad():
            self.mem.add_(0.5)
        x = x / (self.calls + len(self.seen) + self.mem)
        for layer in self.layers:
            if not self.training or torch.rand(()) > 0.5:
                x = torch.tanh(layer(x))
        return {"loss": x.square().mean()}


def _counting_layerdrop() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _CountingLayerDrop().train(), {"x": torch.randn(256, 32, generator=g)}, None


# -- families added by the second scout: masking, softcaps, MoE with shared experts, alibi,
# relative position bias, interpolated positions, state-space and recurrent layers ----------
def _pixels(size: int = 16, seed: int = 1, labels: bool = False) -> Callable[[], dict]:
    def make() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {"pixel_values": torch.randn(2, 3, size, size, generator=g)}
        if labels:
            out["labels"] = torch.tensor([0, 1])
        return out
    return make


_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            image_size=16, patch_size=4, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1)


def _beit_masked() -> dict[str, torch.Tensor]:
    b = _pixels()()
    g = torch.Generator().manual_seed(3)
    b["bool_masked_pos"] = torch.rand(2, 16, generator=g) > 0.5
    b["labels"] = torch.randint(0, 64, (int(b["bool_masked_pos"].sum()),), generator=g)
    return b


def _inplace_dropout(base: Callable[[], Case]) -> Callable[[], Case]:
    """Every ``nn.Dropout`` of the model switched to ``inplace=True`` (no checkpointing)."""
    def build() -> Case:
        model, batch, loss_fn = base()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.inplace = True
        return model, batch, loss_fn
    return build


def _mpt() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2,
                                    max_seq_len=64, vocab_size=96, resid_pdrop=0.1,
                                    emb_pdrop=0.1, attn_config={"alibi": True, "clip_qkv": 0.5})
    # the field is typed int (validated on assignment); the model takes it as a rate
    object.__setattr__(config.attn_config, "attn_pdrop", 0.1)
    return transformers.MptForCausalLM(config).train(), _lm_batch(), None


def _padded_batch(left: bool) -> Callable[[], dict]:
    """A batch whose second row is padded (left or right) by four tokens."""
    def make() -> dict[str, torch.Tensor]:
        b = _lm_batch()
        mask = b["attention_mask"]
        if left:
            mask[1, :4] = 0
        else:
            mask[1, -4:] = 0
        b["input_ids"] = b["input_ids"].masked_fill(mask == 0, 0)
        b["labels"] = b["input_ids"].masked_fill(mask == 0, -100)
        return b
    return make


def _wav2vec2_pretraining() -> Case:
    """Wav2Vec2's contrastive pre-training: a Gumbel-softmax quantizer (torch's RNG), masked
    time steps and sampled negatives (numpy's, drawn here once, as a data collator does)."""
    import numpy as np
    import transformers
    from transformers.models.wav2vec2.modeling_wav2vec2 import (
        _compute_mask_indices,
        _sample_negative_indices,
    )

    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.1,
        attention_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.0, num_negatives=4,
        codevector_dim=16, proj_codevector_dim=16, num_codevectors_per_group=8,
        num_codevector_groups=2, mask_time_prob=0.3, mask_time_length=2)
    model = transformers.Wav2Vec2ForPreTraining(config).train()
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 400, generator=g)
    frames = int(model._get_feat_extract_output_lengths(400))
    np.random.seed(0)
    mask = _compute_mask_indices((2, frames), mask_prob=0.3, mask_length=2, min_masks=2)
    negatives = _sample_negative_indices((2, frames), 4, mask_time_indices=mask)
    return model, {"input_values": values, "mask_time_indices": torch.tensor(mask),
                   "sampled_negative_indices": torch.tensor(negatives)}, None


class _VQStep(torch.nn.Module):
    def __init__(self, vq: torch.nn.Module) -> None:
        super().__init__()
        self.vq = vq

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.vq(x)  # argmin over the codebook, a straight-through estimator
        return {"loss": torch.nn.functional.mse_loss(out.sample, x) + out.commit_loss.mean()}


def _vq() -> Case:
    import diffusers

    torch.manual_seed(0)
    vq = diffusers.VQModel(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
        latent_channels=4, num_vq_embeddings=16, vq_embed_dim=4, norm_num_groups=8,
        sample_size=16)
    g = torch.Generator().manual_seed(1)
    return _VQStep(vq).train(), {"x": torch.randn(2, 3, 16, 16, generator=g)}, None


def _llava() -> Case:
    """A vision tower's patch features scattered into a language model's embeddings at the
    image tokens (``masked_scatter``), trained end to end."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            image_size=16, patch_size=4, attention_dropout=0.1),
        text_config=transformers.LlamaConfig(**_LLAMA, attention_dropout=0.1,
                                             pad_token_id=0),
        image_token_id=95, vision_feature_layer=-1, vision_feature_select_strategy="default",
        projector_hidden_act="gelu")
    model = transformers.LlavaForConditionalGeneration(config).train()
    b = _lm_batch(vocab=90, length=24)
    b["input_ids"][:, 2:18] = 95  # 16 patches (the CLS feature dropped: "default")
    b["labels"] = b["input_ids"].masked_fill(b["input_ids"] == 95, -100)
    g = torch.Generator().manual_seed(2)
    b["pixel_values"] = torch.randn(2, 3, 16, 16, generator=g)
    return model, b, None


def _informer() -> Case:
    """Informer: ProbSparse attention samples keys with ``torch.randint`` in forward,
    distilling convolutions, a mean scaler, LayerDrop, and a Student-t likelihood loss."""
    import transformers

    torch.manual_seed(0)
    config = transformers.InformerConfig(
        prediction_length=4, context_length=16, lags_sequence=[1, 2], num_time_features=1,
        d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=2,
        decoder_layers=1, sampling_factor=2, distil=True, dropout=0.1,
        encoder_layerdrop=0.2, decoder_layerdrop=0.0)
    model = transformers.InformerForPrediction(config).train()
    g = torch.Generator().manual_seed(1)
    past = 16 + 2  # the context and the largest lag

    def time(n: int) -> torch.Tensor:
        return torch.linspace(0, 1, n).view(1, n, 1).repeat(2, 1, 1)
    return model, {
        "past_values": torch.randn(2, past, generator=g).abs() + 1,
        "past_time_features": time(past), "past_observed_mask": torch.ones(2, past),
        "future_values": torch.randn(2, 4, generator=g).abs() + 1,
        "future_time_features": time(4)}, None


class _Ensemble(torch.nn.Module):
    """Four MLPs stacked with ``torch.func.stack_module_state`` and run under ``vmap``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        nets = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
                for _ in range(4)]
        params, _ = torch.func.stack_module_state(nets)
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(v) for k, v in params.items()})
        self.names = list(params)
        self.base = [copy.deepcopy(nets[0]).to("meta")]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        def one(p: dict, x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.base[0], p, (x,))
        stacked = {n: self.params[n.replace(".", "_")] for n in self.names}
        out = torch.vmap(one, randomness="different")(stacked, x.expand(4, *x.shape))
        return {"loss": torch.nn.functional.cross_entropy(out.mean(0), y)}


def _vmap_ensemble() -> Case:
    g = torch.Generator().manual_seed(1)
    return _Ensemble().train(), {"x": torch.randn(64, 16, generator=g),
                                 "y": torch.randint(0, 4, (64,), generator=g)}, None


class _EMAQuantizer(torch.nn.Module):
    """A VQ-VAE with an EMA codebook (as in SoundStream, Jukebox, vector-quantize-pytorch):
    the codebook, a buffer, quantizes the step's latents and is then updated in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                       torch.nn.Linear(32, 8))
        self.dec = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                       torch.nn.Linear(32, 16))
        self.register_buffer("embed", torch.randn(12, 8))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.enc(x)
        with torch.no_grad():
            ind = torch.cdist(z, self.embed).argmin(-1)
        q = torch.nn.functional.embedding(ind, self.embed)
        st = z + (q - z).detach()  # straight through
        out = self.dec(st * 2.0)
        if self.training:
            with torch.no_grad():  # the EMA update, after the codebook was read
                onehot = torch.nn.functional.one_hot(ind, 12).type_as(z)
                mean = (onehot.t() @ z) / onehot.sum(0).clamp(min=1).unsqueeze(1)
                self.embed.mul_(0.9).add_(mean, alpha=0.1)
        loss = torch.nn.functional.mse_loss(out, x) + 0.25 * (z - q).pow(2).mean()
        return {"loss": loss}


def _ema_vq() -> Case:
    g = torch.Generator().manual_seed(1)
    return _EMAQuantizer().train(), {"x": torch.randn(64, 16, generator=g)}, None


# -- families added by scout A: block-sparse and sliding-chunk attention, seq2seq with
# layer drop, disentangled and relative attention, pooling, n-gram streams, latents ------
class _NumpySeeded(torch.nn.Module):
    """Seeds NumPy's global generator from torch's at each call, as a training script that
    seeds both per step does: BigBird draws its random blocks from ``np.random``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: Any) -> Any:
        import numpy as np

        np.random.seed(int(torch.randint(0, 2**31 - 1, ())))
        return self.model(**batch)


def _bigbird_sparse() -> Case:
    model, batch, loss_fn = _tf(
        "BigBirdConfig", "BigBirdForMaskedLM", lambda: _lm_batch(length=48),
        attention_type="block_sparse", block_size=2, num_random_blocks=2,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **_SMALL)()
    return _NumpySeeded(model).train(), batch, loss_fn


def _global_batch(length: int = 32) -> Callable[[], dict]:
    """A batch with global attention on each row's first token (and the second row's
    tenth): Longformer's and LED's global path beside their sliding chunks."""
    def make() -> dict[str, torch.Tensor]:
        b = _lm_batch(length=length)
        glob = torch.zeros_like(b["input_ids"])
        glob[:, 0] = 1
        glob[1, 9] = 1
        b["global_attention_mask"] = glob
        return b
    return make


_SEQ2SEQ = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1,
                attention_dropout=0.1, activation_dropout=0.1, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _perceiver() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.PerceiverConfig(
        num_latents=8, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=4, num_cross_attention_heads=2, qk_channels=32,
        v_channels=32, vocab_size=96, max_position_embeddings=16, attention_probs_dropout_prob=0.1)
    model = transformers.PerceiverForMaskedLM(config).train()
    b = _lm_batch(length=16)
    return model, {"inputs": b["input_ids"], "attention_mask": b["attention_mask"],
                   "labels": b["labels"]}, None


def _blip2_qformer() -> Case:
    """BLIP-2's Q-Former: learned queries cross-attending (every other layer) to image
    features, with dropout."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Blip2QFormerConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=96, max_position_embeddings=64, encoder_hidden_size=24,
        cross_attention_frequency=1, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1)
    model = transformers.Blip2QFormerModel(config).train()
    g = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 32, generator=g)
    image = torch.randn(2, 10, 24, generator=g)
    return model, {"query_embeds": query, "encoder_hidden_states": image}, \
        lambda out: out.last_hidden_state.pow(2).mean()


def _llama_outputs() -> Case:
    """Hidden states and attention maps returned to the caller (saved tensors the user
    holds) and used in the loss, beside the model's own, with eager attention."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_LLAMA, attention_dropout=0.1,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).train()
    b = _lm_batch(labels=False)
    b.update(output_hidden_states=True, output_attentions=True)

    def loss_fn(out: Any) -> torch.Tensor:
        return (out.logits.logsumexp(-1).mean() + 0.1 * out.hidden_states[1].pow(2).mean()
                + out.attentions[0].amax(-1).mean())
    return model, b, loss_fn


# -- families added by the third scout: video tubelets and divided space-time attention,
# shifted windows, unfolded patches, segmentation with an ignore index, GRN, SpecAugment
# masks drawn with numpy, conv + LSTM codecs, FFT autocorrelation, random patch masking
# and distribution heads over lagged inputs ---------------------------------------------
def _video(frames: int = 4, size: int = 16, labels: bool = False) -> Callable[[], dict]:
    def make() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        out = {"pixel_values": torch.randn(2, frames, 3, size, size, generator=g)}
        if labels:
            out["labels"] = torch.tensor([0, 1])
        return out
    return make


def _videomae_masked() -> dict[str, torch.Tensor]:
    """Tubelets of 2 frames x 4x4 pixels: 32 per clip, half masked (the same count per
    clip, as VideoMAE's decoder needs), drawn here as its data collator does."""
    b = _video()()
    g = torch.Generator().manual_seed(3)
    b["bool_masked_pos"] = torch.stack([torch.randperm(32, generator=g) < 16 for _ in range(2)])
    return b


def _timesformer() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.TimesformerConfig(**_VIT, num_frames=4, num_labels=2,
                                            attention_type="divided_space_time")
    # the field is typed int (validated on assignment); the model takes it as a rate
    object.__setattr__(config, "drop_path_rate", 0.2)
    model = transformers.TimesformerForVideoClassification(config).train()
    return model, _video(labels=True)(), None


def _segmentation() -> dict[str, torch.Tensor]:
    b = _pixels(size=32)()
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 3, (2, 32, 32), generator=g)
    labels[:, :4] = 255  # the ignore index
    b["labels"] = labels
    return b


def _audio_ctc(config_name: str, model_name: str, **kw: Any) -> Callable[[], Case]:
    """A CTC head on a wav2vec2-like encoder with LayerDrop and SpecAugment time and
    feature masks, drawn from numpy's global RNG inside the training forward (``train``
    seeds it per step, as torch's)."""
    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_name)(
            vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.1,
            attention_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.3, mask_time_prob=0.3,
            mask_time_length=2, mask_time_min_masks=1, mask_feature_prob=0.3,
            mask_feature_length=4, ctc_loss_reduction="mean", pad_token_id=0, **kw)
        model = getattr(transformers, model_name)(config).train()
        g = torch.Generator().manual_seed(1)
        return model, {
            "input_values": torch.randn(2, 400, generator=g),
            "labels": torch.randint(1, 20, (2, 6), generator=g)}, None
    return build


class _CodecStep(torch.nn.Module):
    """A neural codec's reconstruction step: the full model (its quantizer's argmin codes,
    decoded) and the encoder's latents decoded straight through, against the input."""

    def __init__(self, codec: torch.nn.Module) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.codec(x).audio_values
        z = self.codec.encoder(x)
        rec = self.codec.decoder(z)
        mse = torch.nn.functional.mse_loss
        return {"loss": mse(out, x) + mse(rec, x) + (rec - x).abs().mean()}


def _encodec() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.EncodecConfig(
        target_bandwidths=[1.5], sampling_rate=800, audio_channels=1, hidden_size=16,
        num_filters=4, num_residual_layers=1, upsampling_ratios=[4, 2], codebook_size=16,
        codebook_dim=16, num_lstm_layers=2, kernel_size=5, last_kernel_size=5,
        residual_kernel_size=3, use_causal_conv=True, normalize=False)
    g = torch.Generator().manual_seed(1)
    return _CodecStep(transformers.EncodecModel(config)).train(), {
        "x": torch.randn(2, 1, 256, generator=g)}, None


def _speecht5_stt() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.SpeechT5Config(
        vocab_size=40, hidden_size=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
        max_speech_positions=128, max_text_positions=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1)
    model = transformers.SpeechT5ForSpeechToText(config).train()
    g = torch.Generator().manual_seed(1)
    return model, {"input_values": torch.randn(2, 400, generator=g),
                   "labels": torch.randint(3, 40, (2, 7), generator=g)}, None


def _series(past: int, future: int = 4) -> dict[str, torch.Tensor]:
    """A positive series with one time feature, as the GluonTS-style forecasters take."""
    g = torch.Generator().manual_seed(1)

    def time(n: int) -> torch.Tensor:
        return torch.linspace(0, 1, n).view(1, n, 1).repeat(2, 1, 1)
    return {"past_values": torch.randn(2, past, generator=g).abs() + 1,
            "past_time_features": time(past), "past_observed_mask": torch.ones(2, past),
            "future_values": torch.randn(2, future, generator=g).abs() + 1,
            "future_time_features": time(future)}


def _forecaster(config_name: str, model_name: str, counts: bool = False,
                **kw: Any) -> Callable[[], Case]:
    """A forecaster on lags 1..3 of a 16-step context (19 past values) predicting 4 (whole
    numbers with ``counts``, for a negative binomial head)."""
    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_name)(
            prediction_length=4, context_length=16, lags_sequence=[1, 2, 3],
            num_time_features=1, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32,
            encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, dropout=0.1, attention_dropout=0.1,
            activation_dropout=0.1, **kw)
        model = getattr(transformers, model_name)(config).train()
        batch = _series(16 + 3)
        if counts:
            batch = {k: v.mul(3).round() if k.endswith("values") else v
                     for k, v in batch.items()}
        return model, batch, None
    return build


def _patchtst() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.PatchTSTConfig(
        num_input_channels=2, context_length=32, patch_length=4, patch_stride=4,
        d_model=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
        mask_type="random", random_mask_ratio=0.4, do_mask_input=True, dropout=0.1,
        attention_dropout=0.1, ff_dropout=0.1, positional_dropout=0.1, path_dropout=0.1,
        head_dropout=0.1, channel_consistent_masking=False)
    model = transformers.PatchTSTForPretraining(config).train()
    g = torch.Generator().manual_seed(1)
    return model, {"past_values": torch.randn(2, 32, 2, generator=g)}, None


_ROPE_HALF = [1.0, 1.5, 2.0, 2.5]  # head_dim 8: 4 rotary frequency factors


CASES: dict[str, Callable[[], Case]] = {
    "peft_lora_llama": _peft("lora", _tf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
                             target_modules=["q_proj", "v_proj", "gate_proj"]),
    "peft_lora_gpt2": _peft("lora", _gpt2(), target_modules=["c_attn", "c_fc"],
                            fan_in_fan_out=True),
    "peft_dora_llama": _peft("lora", _tf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
                             target_modules=["q_proj", "v_proj"], use_dora=True),
    "peft_lora_save_cls": _peft(
        "lora", _tf("LlamaConfig", "LlamaForSequenceClassification", _cls_batch,
                    **_LLAMA, num_labels=2, pad_token_id=0),
        target_modules=["q_proj", "v_proj"], modules_to_save=["score"]),
    "peft_prompt_gpt2": _peft("prompt", _gpt2()),
    "peft_lora_bf16_base": _peft("lora", _tf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
                                 bf16_base=True, target_modules=["q_proj", "v_proj"]),
    "peft_lora_input_grads": _peft("lora", _tf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
                                   input_grads=True, target_modules=["q_proj", "v_proj"]),
    "albert": _tf("AlbertConfig", "AlbertForMaskedLM", embedding_size=16,
                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **_SMALL),
    "reformer": _reformer,
    "xlnet": _xlnet,
    "clip": _clip,
    "whisper": _whisper,
    "gpt_neox": _tf("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5,
                    attention_dropout=0.1, hidden_dropout=0.1, **_SMALL),
    "phi": _tf("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5,
               attention_dropout=0.1, resid_pdrop=0.1, **_SMALL),
    "gemma": _tf("GemmaConfig", "GemmaForCausalLM", head_dim=8, **_LLAMA),
    "qwen2": _tf("Qwen2Config", "Qwen2ForCausalLM", attention_dropout=0.1, **_LLAMA),
    "distilbert_dropout": _tf("DistilBertConfig", "DistilBertForMaskedLM", dim=32, n_layers=2,
                              n_heads=4, hidden_dim=64, vocab_size=96, dropout=0.2,
                              attention_dropout=0.2, max_position_embeddings=64),
    "gpt2_dropout": _gpt2(attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.1),
    "llama_dynamic_rope": _tf("LlamaConfig", "LlamaForCausalLM",
                              lambda: _lm_batch(length=40), attention_dropout=0.1,
                              rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                              **dict(_LLAMA, max_position_embeddings=32)),
    "llama_attn_dropout": _tf("LlamaConfig", "LlamaForCausalLM", attention_dropout=0.2,
                              **_LLAMA),
    "mixtral_jitter": _tf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                          num_experts_per_tok=2, router_jitter_noise=0.1,
                          output_router_logits=True, **_LLAMA),
    "esm": _tf("EsmConfig", "EsmForMaskedLM", hidden_dropout_prob=0.1,
               attention_probs_dropout_prob=0.1, pad_token_id=1, mask_token_id=2,
               token_dropout=True, position_embedding_type="rotary", **_SMALL),
    "electra": _tf("ElectraConfig", "ElectraForMaskedLM", embedding_size=16,
                   hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **_SMALL),
    "bert_cross_attention": _bert_cross,
    "diffusers_vae": _vae,
    "diffusers_unet_cross": _unet_cross,
    "diffusers_dit": _dit,
    "hooks": _hooks,
    "no_grad_inside": _no_grad_inside,
    "weight_spectral_norm": _norms,
    "counting_layerdrop": _counting_layerdrop,
    "vit_mae": _tf("ViTMAEConfig", "ViTMAEForPreTraining", _pixels(), **_VIT,
                   decoder_hidden_size=32, decoder_num_hidden_layers=1,
                   decoder_num_attention_heads=4, decoder_intermediate_size=64,
                   mask_ratio=0.75, norm_pix_loss=True),
    "gemma2_softcap": _tf("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=4,
                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                          attention_dropout=0.1, query_pre_attn_scalar=8, **_LLAMA),
    "gemma3_text": _tf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"],
                       query_pre_attn_scalar=8, attention_dropout=0.1, **_LLAMA),
    "qwen2_moe": _tf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, output_router_logits=True,
                     attention_dropout=0.1, **_LLAMA),
    "qwen3_moe": _tf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     output_router_logits=True, head_dim=8, **_LLAMA),
    "olmo_clip_qkv": _tf("OlmoConfig", "OlmoForCausalLM", clip_qkv=0.5,
                         attention_dropout=0.1, pad_token_id=0, **_LLAMA),
    "olmo2": _tf("Olmo2Config", "Olmo2ForCausalLM", attention_dropout=0.1, pad_token_id=0,
                 **_LLAMA),
    "falcon_alibi": _tf("FalconConfig", "FalconForCausalLM", hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
                        alibi=True, parallel_attn=True, multi_query=True, bias=True,
                        hidden_dropout=0.1, attention_dropout=0.1),
    "falcon_new_arch": _tf("FalconConfig", "FalconForCausalLM", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                           vocab_size=96, new_decoder_architecture=True,
                           hidden_dropout=0.1, attention_dropout=0.1),
    "mpt_alibi": _mpt,
    "beit_mim": _tf("BeitConfig", "BeitForMaskedImageModeling", _beit_masked, **_VIT,
                    vocab_size=64, use_mask_token=True, use_relative_position_bias=True,
                    layer_scale_init_value=0.1, drop_path_rate=0.2),
    "data2vec_vision": _tf("Data2VecVisionConfig", "Data2VecVisionForImageClassification",
                           _pixels(labels=True), **_VIT, num_labels=2,
                           use_shared_relative_position_bias=True,
                           layer_scale_init_value=0.1, drop_path_rate=0.2),
    "dinov2_interp": _tf("Dinov2Config", "Dinov2ForImageClassification",
                         _pixels(size=24, labels=True), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, mlp_ratio=2, image_size=16, patch_size=4,
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                         drop_path_rate=0.2, num_labels=2),
    "dinov2_swiglu": _tf("Dinov2Config", "Dinov2ForImageClassification",
                         _pixels(size=16, labels=True), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, mlp_ratio=2, image_size=16, patch_size=4,
                         use_swiglu_ffn=True, layerscale_value=0.5, num_labels=2),
    "mamba2_torch": _tf("Mamba2Config", "Mamba2ForCausalLM", hidden_size=32,
                        num_hidden_layers=2, vocab_size=96, state_size=8, expand=2,
                        num_heads=8, head_dim=8, n_groups=1, chunk_size=4,
                        time_step_rank=4, use_cache=False, pad_token_id=0),
    "rwkv": _tf("RwkvConfig", "RwkvForCausalLM", vocab_size=96, hidden_size=32,
                num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
                context_length=64, use_cache=False, rescale_every=0),
    "phi3_longrope": _tf("Phi3Config", "Phi3ForCausalLM", lambda: _lm_batch(length=40),
                         rope_scaling={"rope_type": "longrope", "short_factor": _ROPE_HALF,
                                       "long_factor": [f * 2 for f in _ROPE_HALF]},
                         original_max_position_embeddings=16, attention_dropout=0.1,
                         resid_pdrop=0.1, pad_token_id=0, **_LLAMA),
    "bert_inplace_dropout": _inplace_dropout(_tf(
        "BertConfig", "BertForMaskedLM", hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2, **_SMALL)),
    "jamba": _tf("JambaConfig", "JambaForCausalLM", num_experts=4, num_experts_per_tok=2,
                 attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                 expert_layer_offset=0, mamba_d_state=8, mamba_dt_rank=4,
                 use_mamba_kernels=False, output_router_logits=True, pad_token_id=0,
                 **_LLAMA),
    "zamba2_shared": _tf("Zamba2Config", "Zamba2ForCausalLM", hidden_size=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, vocab_size=96, max_position_embeddings=64,
                         layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                         mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, chunk_size=4,
                         use_mamba_kernels=False, use_shared_attention_adapter=True,
                         adapter_rank=4, use_mem_rope=True, pad_token_id=0),
    "recurrent_gemma": _tf("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
                           num_hidden_layers=3, vocab_size=96, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, lru_width=32, attention_window_size=4,
                           block_types=["recurrent", "attention", "recurrent"],
                           logits_soft_cap=3.0, pad_token_id=0),
    "gpt_oss": _tf("GptOssConfig", "GptOssForCausalLM", num_local_experts=4,
                   num_experts_per_tok=2, head_dim=8, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"],
                   output_router_logits=True, attention_dropout=0.1, **_LLAMA),
    "deepseek_v3": _tf("DeepseekV3Config", "DeepseekV3ForCausalLM", moe_intermediate_size=32,
                       n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
                       num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                       q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4,
                       attention_dropout=0.1, **_LLAMA),
    "qwen3_next": _tf("Qwen3NextConfig", "Qwen3NextForCausalLM", head_dim=8,
                      linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                      linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      layer_types=["linear_attention", "full_attention"],
                      output_router_logits=True, **_LLAMA),
    "cohere": _tf("CohereConfig", "CohereForCausalLM", logit_scale=0.5, use_qk_norm=True,
                  attention_dropout=0.1, pad_token_id=0, **_LLAMA),
    "modernbert_unpadded": _tf("ModernBertConfig", "ModernBertForMaskedLM",
                               _padded_batch(left=False), hidden_size=32,
                               num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=64, vocab_size=96,
                               max_position_embeddings=64, local_attention=4,
                               attention_dropout=0.1, mlp_dropout=0.1,
                               embedding_dropout=0.1, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, cls_token_id=1, sep_token_id=2),
    "llama_left_padded": _tf("LlamaConfig", "LlamaForCausalLM", _padded_batch(left=True),
                             attention_dropout=0.1, pad_token_id=0, **_LLAMA),
    "canine": _tf("CanineConfig", "CanineForSequenceClassification", _cls_batch,
                  hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_hash_functions=4, num_hash_buckets=64,
                  downsampling_rate=4, local_transformer_stride=4, num_labels=2,
                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                  max_position_embeddings=64),
    "convbert": _tf("ConvBertConfig", "ConvBertForMaskedLM", embedding_size=16,
                    conv_kernel_size=3, head_ratio=2, num_groups=2,
                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **_SMALL),
    "mobilebert": _tf("MobileBertConfig", "MobileBertForMaskedLM", embedding_size=16,
                      intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2,
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **_SMALL),
    "nemotron": _tf("NemotronConfig", "NemotronForCausalLM", head_dim=8,
                    partial_rotary_factor=0.5, attention_dropout=0.1, pad_token_id=0,
                    **_LLAMA),
    "granitemoe": _tf("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4,
                      num_experts_per_tok=2, embedding_multiplier=2.0, logits_scaling=4.0,
                      residual_multiplier=0.5, attention_multiplier=0.2,
                      output_router_logits=True, attention_dropout=0.1, **_LLAMA),
    "lfm2_shortconv": _tf("Lfm2Config", "Lfm2ForCausalLM", block_multiple_of=16,
                          layer_types=["conv", "full_attention"], pad_token_id=0, **_LLAMA),
    "falcon_h1": _tf("FalconH1Config", "FalconH1ForCausalLM", mamba_d_ssm=32, mamba_n_heads=4,
                     mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4,
                     embedding_multiplier=2.0, key_multiplier=0.5,
                     mlp_multipliers=[0.5, 2.0], ssm_multipliers=[1.0, 0.5, 2.0, 1.0, 0.5],
                     attention_dropout=0.1, **_LLAMA),
    "wav2vec2_pretraining": _wav2vec2_pretraining,
    "diffusers_vq": _vq,
    "llava": _llava,
    "fnet_fourier": _tf("FNetConfig", "FNetForMaskedLM", hidden_size=32,
                        num_hidden_layers=2, intermediate_size=64, vocab_size=96,
                        max_position_embeddings=64, hidden_dropout_prob=0.1,
                        use_tpu_fourier_optimizations=False, pad_token_id=0),
    "bigbird_block_sparse": _bigbird_sparse,
    "longformer_global": _tf("LongformerConfig", "LongformerForMaskedLM", _global_batch(),
                             attention_window=8, hidden_dropout_prob=0.1,
                             attention_probs_dropout_prob=0.1, pad_token_id=0, **_SMALL),
    "led_global": _tf("LEDConfig", "LEDForConditionalGeneration", _global_batch(),
                      attention_window=8, max_encoder_position_embeddings=64,
                      max_decoder_position_embeddings=64,
                      **{k: v for k, v in _SEQ2SEQ.items() if k != "max_position_embeddings"}),
    "t5_dropout": _tf("T5Config", "T5ForConditionalGeneration", vocab_size=96, d_model=32,
                      d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
                      relative_attention_num_buckets=8, decoder_start_token_id=0),
    # at 0.1 a plan's steps run on its profiled path and off it (at 0.4, all three off)
    "bart_layerdrop": _tf("BartConfig", "BartForConditionalGeneration", encoder_layerdrop=0.1,
                          decoder_layerdrop=0.1, **_SEQ2SEQ),
    "deberta_v2": _tf("DebertaV2Config", "DebertaV2ForMaskedLM", relative_attention=True,
                      position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **_SMALL),
    "funnel_pooling": _tf("FunnelConfig", "FunnelForMaskedLM", block_sizes=[1, 1],
                          d_model=32, n_head=4, d_head=8, d_inner=64, vocab_size=96,
                          hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1),
    "prophetnet_ngram": _tf("ProphetNetConfig", "ProphetNetForConditionalGeneration",
                            vocab_size=96, hidden_size=32, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, num_encoder_layers=2, num_decoder_layers=2,
                            num_encoder_attention_heads=4, num_decoder_attention_heads=4,
                            ngram=2, num_buckets=8, relative_max_distance=16,
                            max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
                            activation_dropout=0.1, pad_token_id=0, decoder_start_token_id=1),
    "perceiver_mlm": _perceiver,
    "blip2_qformer": _blip2_qformer,
    "xlm_roberta_xl": _tf("XLMRobertaXLConfig", "XLMRobertaXLForMaskedLM",
                          hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                          pad_token_id=0, **_SMALL),
    "informer_probsparse": _informer,
    "vmap_ensemble": _vmap_ensemble,
    "ema_vq": _ema_vq,
    "llama_outputs": _llama_outputs,
    "videomae_pretraining": _tf("VideoMAEConfig", "VideoMAEForPreTraining", _videomae_masked,
                                **_VIT, num_frames=4, tubelet_size=2,
                                decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                decoder_num_attention_heads=4, decoder_intermediate_size=64,
                                norm_pix_loss=True),
    "timesformer": _timesformer,
    "swin_shifted": _tf("SwinConfig", "SwinForImageClassification", _pixels(labels=True),
                        image_size=16, patch_size=2, embed_dim=16, depths=[2, 2],
                        num_heads=[2, 4], window_size=4, mlp_ratio=2.0,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                        drop_path_rate=0.2, num_labels=2),
    "mobilevit": _tf("MobileViTConfig", "MobileViTForImageClassification",
                     _pixels(size=32, labels=True), image_size=32, patch_size=2,
                     hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                     num_attention_heads=2, mlp_ratio=2.0, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, classifier_dropout_prob=0.1,
                     num_labels=2),
    "segformer_ignore": _tf("SegformerConfig", "SegformerForSemanticSegmentation",
                            _segmentation, num_encoder_blocks=2, depths=[1, 1],
                            sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                            strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                            decoder_hidden_size=32, hidden_dropout_prob=0.1,
                            attention_probs_dropout_prob=0.1, classifier_dropout_prob=0.1,
                            drop_path_rate=0.2, num_labels=3, semantic_loss_ignore_index=255),
    "convnextv2_grn": _tf("ConvNextV2Config", "ConvNextV2ForImageClassification",
                          _pixels(size=32, labels=True), patch_size=4, hidden_sizes=[16, 32],
                          depths=[2, 2], num_stages=2, drop_path_rate=0.2, num_labels=2,
                          image_size=32),
    "hubert_specaugment": _audio_ctc("HubertConfig", "HubertForCTC"),
    "sew_specaugment": _audio_ctc("SEWConfig", "SEWForCTC", squeeze_factor=2),
    "encodec": _encodec,
    "speecht5_stt": _speecht5_stt,
    "autoformer": _forecaster("AutoformerConfig", "AutoformerForPrediction",
                              moving_average=5, autocorrelation_factor=2,
                              encoder_layerdrop=0.2),
    "patchtst_masked": _patchtst,
    "time_series_transformer": _forecaster(
        "TimeSeriesTransformerConfig", "TimeSeriesTransformerForPrediction",
        counts=True, distribution_output="negative_binomial", scaling="mean",
        encoder_layerdrop=0.2),
}
NEEDS = {"diffusers_vae": "diffusers", "diffusers_vq": "diffusers",
         "diffusers_unet_cross": "diffusers", "diffusers_dit": "diffusers"}


def _call(model: torch.nn.Module, batch: Mapping) -> Any:
    return model(**batch)


def _loss_of(out: Any, loss_fn: Callable | None) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    return loss if loss is not None else loss_fn(out)


def _backward(model: torch.nn.Module, loss: torch.Tensor, how: str) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    if how == "grad":  # torch.autograd.grad, the gradients set by hand
        for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True),
                        strict=True):
            p.grad = g if p.grad is None or g is None else p.grad + g
    elif how == "inputs":  # backward(inputs=[...]): half the parameters
        loss.backward(inputs=params[::2])
    else:
        loss.backward()


def train(model: torch.nn.Module, batches: list[dict], loss_fn: Callable | None, *,
          block: Callable[[int, dict], Any] | None = None, how: str = "backward",
          bf16: bool = False, eval_at: int | None = None) -> tuple[list[dict], dict]:
    """STEPS AdamW steps; each step runs every micro-batch of ``batches`` (gradients
    accumulated), each forward and loss inside ``block(step, batch)``."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=1e-3, weight_decay=0.05)
    records, info = [], {"verified": 0, "off_path": 0, "offloaded": 0, "recomputed": 0}
    for step in range(STEPS):
        model.train(step != eval_at)
        torch.manual_seed(100 + step)
        numpy.random.seed(100 + step)  # SpecAugment draws its masks from numpy's global RNG
        rec: dict[str, Any] = {}
        for i, batch in enumerate(batches):
            cm = block(step, batch) if block is not None else contextlib.nullcontext()
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 \
                else contextlib.nullcontext()
            with amp, cm:
                loss = _loss_of(_call(model, batch), loss_fn)
            _backward(model, loss, how)
            rec[f"loss {i}"] = loss.detach().clone()
            del loss
            count_stats(info, cm)
            held = getattr(getattr(cm, "stats", None), "peak_resident_bytes", 0)
            info["peak_resident"] = max(info.get("peak_resident", 0), held)
        for n, p in model.named_parameters():
            rec[f"grad {n}"] = None if p.grad is None else p.grad.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append(after_step(model, rec))
    if getattr(model, "scout_os_seeded", False):
        for rec in records:
            del rec["rng"]
    return records, info


def _micro(batch: dict) -> list[dict]:
    """Two micro-batches of other shapes (gradient accumulation): of another sequence
    length where the batch has ``input_ids``, else of half the rows (every tensor whose
    first dimension is the batch's)."""
    if "input_ids" in batch:
        length = batch["input_ids"].shape[1]
        short = {k: (v[:, :-4].contiguous() if torch.is_tensor(v) and v.dim() == 2
                     and v.shape[1] == length else v)
                 for k, v in batch.items()}
        return [batch, short]
    rows = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0}
    if len(rows) != 1 or (n := rows.pop()) < 2:
        raise InputError("accumulate: the batch's tensors share no batch dimension to split")
    half = {k: (v[: n // 2].contiguous() if torch.is_tensor(v) and v.dim() > 0 else v)
            for k, v in batch.items()}
    return [batch, half]


EXTRAS = ["grad", "inputs", "attach", "accumulate", "eval_mid", "bf16"]


def _extra_budget(profile: slackswap.StepProfile | None) -> float:
    """Half the keep-all peak, or (a model no plan fits at half) a little above the smallest
    budget known to fit, so that the extras still run the model under a plan."""
    if profile is None:
        return 0.5
    from slackswap.planners import smallest_feasible_budget
    least = smallest_feasible_budget(profile) / max(1, profile.keep_all_peak)
    return 0.5 if least <= 0.4 else min(1.0, least + 0.12)  # bf16 needs a little more


def _extra(kind: str, pristine: torch.nn.Module, batch: dict, loss_fn: Callable | None,
           profile: slackswap.StepProfile | None) -> tuple[list[dict], dict]:
    model = copy.deepcopy(pristine)
    budget = _extra_budget(profile)
    if kind in ("grad", "inputs"):
        if profile is None:
            raise InputError("no profile to plan from")
        plan = slackswap.plan(profile, budget)
        got, info = train(model, [batch], loss_fn, how=kind, block=lambda _s, _b:
                          slackswap.apply(model, plan, profile=profile, verify=True))
        ref, _ = train(copy.deepcopy(pristine), [batch], loss_fn, how=kind)
    elif kind == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_profile = slackswap.profile(copy.deepcopy(pristine), copy.deepcopy(batch),
                                             mode="traced", loss_fn=loss_fn)
        plan = slackswap.plan(bf16_profile, max(budget, _extra_budget(bf16_profile)))
        got, info = train(model, [batch], loss_fn, bf16=True, block=lambda _s, _b:
                          slackswap.apply(model, plan, profile=bf16_profile, verify=True))
        ref, _ = train(copy.deepcopy(pristine), [batch], loss_fn, bf16=True)
    elif kind in ("attach", "eval_mid"):
        eval_at = 1 if kind == "eval_mid" else None
        attached = slackswap.attach(model, budget=budget, loss_fn=loss_fn)
        with attached:
            got, info = train(model, [batch], loss_fn, eval_at=eval_at)
            stats = attached.stats  # the last step's
            info.update(offloaded=stats.offloaded_bytes, recomputed=stats.recomputed_ops)
        ref, _ = train(copy.deepcopy(pristine), [batch], loss_fn, eval_at=eval_at)
    elif kind == "accumulate":
        step = slackswap.auto(model, budget=budget, loss_fn=loss_fn)
        got, info = train(model, _micro(batch), loss_fn, block=lambda _s, b: step(b))
        ref, _ = train(copy.deepcopy(pristine), _micro(batch), loss_fn)
    else:
        raise ValueError(kind)
    info["own_reference"] = compare(got, ref)
    return got, info


def _run_one(label: str, fn: Callable[[], tuple[list, dict]], want: list[dict] | None,
             results: dict) -> None:
    t0 = time.time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, info = fn()
        diff = compare(got, want) if want is not None else None
        diff = diff or info.get("own_reference")
        status = "FAIL" if diff else "PASS"
        detail = diff or (f"verified={info['verified']} off_path={info['off_path']} "
                          f"offloaded={info['offloaded']} recomputed={info['recomputed']} "
                          f"held={info.get('peak_resident', 0)}")
    except SlackSwapError as e:
        status, detail = "REFUSED", str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001
        status = "FAIL"
        tb = traceback.format_exc().splitlines()
        detail = f"{type(e).__name__}: {str(e)[:300]} | " + " / ".join(tb[-6:-1])[:600]
    results[label] = {"status": status, "detail": detail, "s": round(time.time() - t0, 1)}
    print(f"  {label:<18} {status:<8} {time.time() - t0:5.1f}s {detail}", flush=True)


def scout(name: str, modes: list[str], extras: list[str]) -> dict:
    needs = NEEDS.get(name) or getattr(CASES[name], "needs", None)
    if needs and importlib.util.find_spec(needs) is None:
        print(f"{name}: skipped, {needs} is not installed")
        return {"build": {"status": "SKIP", "detail": f"{needs} not installed"}}
    results: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pristine, batch, loss_fn = CASES[name]()
            want, _ = train(copy.deepcopy(pristine), [batch], loss_fn)
            again, _ = train(copy.deepcopy(pristine), [batch], loss_fn)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: build or plain step failed: {type(e).__name__}: {e}"[:400])
        return {"build": {"status": "SKIP", "detail": f"{type(e).__name__}: {e}"[:200]}}
    if (d := compare(again, want)) is not None:
        print(f"{name}: plain PyTorch not deterministic: {d}")
        return {"reference": {"status": "SKIP", "detail": d}}
    print(f"{name} ({sum(p.numel() for p in pristine.parameters())} params)", flush=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            profile = slackswap.profile(copy.deepcopy(pristine), copy.deepcopy(batch),
                                        mode="traced", loss_fn=loss_fn)
        plans = plans_for(profile, modes)
    except SlackSwapError as e:
        results["profile"] = {"status": "REFUSED", "detail": str(e).splitlines()[0][:300]}
        print(f"  profile REFUSED {str(e).splitlines()[0][:300]}", flush=True)
        plans, profile = {}, None
    for mode in list(plans):
        box = [plans.pop(mode)]
        if isinstance(box[0], str):
            results[mode] = {"status": "NOPLAN", "detail": box[0]}
            print(f"  {mode:<18} NOPLAN   {box[0]}", flush=True)
            continue

        def fn(box: list = box) -> tuple[list, dict]:
            plan, model = box.pop(), copy.deepcopy(pristine)
            got, info = train(model, [batch], loss_fn, block=lambda _s, _b: slackswap.apply(
                model, plan, profile=profile, verify=True))
            # the saved bytes a step held never exceed the simulated peak (which adds the
            # ops' temporaries): more is memory the plan did not account for
            peak = slackswap.simulate(profile, plan).peak_bytes
            if info["peak_resident"] > peak:
                info["own_reference"] = (f"held {info['peak_resident']} saved bytes, over "
                                         f"the plan's simulated peak {peak}")
            return got, info
        _run_one(mode, fn, want, results)
    for kind in extras:
        _run_one(kind, lambda kind=kind: _extra(kind, pristine, batch, loss_fn, profile),
                 None, results)
    return results


def _table(everything: dict) -> None:
    word = {"PASS": "identical", "REFUSED": "refused", "FAIL": "MISMATCH",
            "NOPLAN": "no plan", "SKIP": "skipped"}
    print(f"\n{'case':<22} outcome")
    for name, res in everything.items():
        for label, r in res.items():
            reason = f" ({r['detail'][:120]})" if r["status"] not in ("PASS",) else ""
            print(f"{name:<22} {label:<16} {word[r['status']]}{reason}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES))
    ap.add_argument("--modes", default=",".join(PLAN_MODES))
    ap.add_argument("--extra", default=",".join(EXTRAS))
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    everything = {}
    for name in args.cases:
        everything[name] = scout(name, [m for m in args.modes.split(",") if m],
                                 [e for e in args.extra.split(",") if e])
        if args.json:
            atomic_write_text(args.json, json.dumps(everything, indent=1))
    _table(everything)


if __name__ == "__main__":
    main()
