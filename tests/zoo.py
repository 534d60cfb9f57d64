"""Small CPU models of families the runtime was not built around, one step each.

Every factory returns ``(model, batch, loss_fn)`` with a fixed seed, the model in training
mode with dropout on. The batch is a dict (called as ``model(**batch)``), a tuple
(``model(*batch)``) or a tensor (``model(batch)``); the loss is ``output.loss``,
``output["loss"]`` or ``loss_fn(output)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from cnn_models import BasicBlock
from torch import nn

Case = tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]


@dataclass
class Output:
    """A model output with a ``.loss`` attribute, like Hugging Face's."""

    loss: torch.Tensor
    logits: torch.Tensor


def _first_class_loss(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against class 0: a loss_fn that needs no target tensor."""
    return out.logsumexp(-1).mean() - out[..., 0].mean()


# -- recurrent ----------------------------------------------------------------------------
class _LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.rnn = nn.LSTM(32, 64, num_layers=2, dropout=0.1, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h, _ = self.rnn(self.drop(self.emb(ids)))
        logits = self.head(h[:, :-1])
        return {"loss": F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())}


def lstm() -> Case:
    """A 2-layer LSTM language model with dropout between layers, returning a dict."""
    torch.manual_seed(0)
    model = _LSTMLM().train()
    return model, {"ids": torch.randint(0, 64, (8, 10))}, None


class _GRUTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(32, 48, num_layers=2, dropout=0.1, batch_first=True,
                          bidirectional=True)
        self.head = nn.Linear(96, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, last = self.rnn(x)
        return self.head(h) + last.mean(0).unsqueeze(1).repeat(1, 1, 2)[..., :5]


def gru() -> Case:
    """A bidirectional 2-layer GRU over a float tensor batch, loss from ``loss_fn``."""
    torch.manual_seed(0)
    return _GRUTagger().train(), torch.randn(8, 8, 32), _first_class_loss


# -- convolutional ------------------------------------------------------------------------
class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
            nn.Hardswish(inplace=True), nn.Dropout2d(0.1), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.head(self.features(pixels).flatten(1))
        return Output(F.cross_entropy(logits, labels), logits)


def cnn_bn_inplace() -> Case:
    """Conv + BatchNorm + in-place ReLU/Hardswish + Dropout2d, returning ``.loss``."""
    torch.manual_seed(0)
    batch = {"pixels": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, 10, (4,))}
    return _BNNet().train(), batch, None


class _TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.layer2(self.layer1(self.stem(x)))
        return {"loss": F.cross_entropy(self.fc(self.pool(h).flatten(1)), labels)}


def resnet() -> Case:
    """Two torchvision-style BasicBlocks (one downsampling), called with a tuple batch."""
    torch.manual_seed(0)
    return _TinyResNet().train(), (torch.randn(4, 3, 12, 12), torch.randint(0, 10, (4,))), None


# -- vision transformer -------------------------------------------------------------------
def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth as timm writes it: drop whole samples, rescale the rest."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    mask.div_(keep)
    return x * mask


class _DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)


class _ViTAttention(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float) -> None:
        super().__init__()
        self.heads, self.drop = heads, drop
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v,
                                           dropout_p=self.drop if self.training else 0.0)
        return self.proj_drop(self.proj(h.transpose(1, 2).reshape(b, n, c)))


class _ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float, path: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _ViTAttention(dim, heads, drop)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(drop),
                                 nn.Linear(2 * dim, dim), nn.Dropout(drop))
        self.drop_path = _DropPath(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class _TinyViT(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.pos_drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(_ViTBlock(dim, 4, 0.1, 0.2 * (i + 1) / depth)
                                    for i in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = self.pos_drop(torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)[:, 0])


def vit() -> Case:
    """A 2-block ViT: SDPA with dropout, hand-written per-sample drop path, loss_fn."""
    torch.manual_seed(0)
    return _TinyViT().train(), torch.randn(4, 3, 16, 16), _first_class_loss


# -- diffusion UNet -----------------------------------------------------------------------
def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps, as DDPM writes it."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(8, cin), nn.GroupNorm(8, cout)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.drop = nn.Dropout(0.1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.drop(F.silu(self.norm2(h))))
        return self.skip(x) + h


class _TinyUNet(nn.Module):
    def __init__(self, ch: int = 16, tdim: int = 32) -> None:
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.down1 = _ResBlock(ch, ch, tdim)
        self.downsample = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.down2 = _ResBlock(ch, 2 * ch, tdim)
        self.mid = _ResBlock(2 * ch, 2 * ch, tdim)
        self.upsample = nn.Conv2d(2 * ch, 2 * ch, 3, padding=1)
        self.up = _ResBlock(3 * ch, ch, tdim)
        self.norm_out = nn.GroupNorm(8, ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def denoise(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time_mlp(timestep_embedding(t, self.tdim))
        h1 = self.down1(self.conv_in(x), temb)
        h = self.mid(self.down2(self.downsample(h1), temb), temb)
        h = self.upsample(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.up(torch.cat([h, h1], 1), temb)  # skip connection
        return self.conv_out(F.silu(self.norm_out(h)))

    def forward(self, images: torch.Tensor, timesteps: torch.Tensor) -> dict[str, torch.Tensor]:
        noise = torch.randn_like(images)  # drawn in the step, as diffusion training does
        alpha = torch.cos((timesteps.float() / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2
        alpha = alpha[:, None, None, None]
        noisy = alpha.sqrt() * images + (1 - alpha).sqrt() * noise
        return {"loss": F.mse_loss(self.denoise(noisy, timesteps), noise)}


def unet() -> Case:
    """A DDPM-style UNet: GroupNorm, SiLU, timestep embedding, skip concat, noise drawn in
    forward."""
    torch.manual_seed(0)
    batch = {"images": torch.randn(2, 3, 16, 16), "timesteps": torch.randint(0, 1000, (2,))}
    return _TinyUNet().train(), batch, None


# -- Hugging Face encoder-decoders ---------------------------------------------------------
def _seq2seq_batch(pad: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, 9:], mask[1, 9:] = pad, 0
    labels = torch.randint(3, 100, (2, 7), generator=gen)
    labels[0, 5:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def t5() -> Case:
    """T5ForConditionalGeneration from a tiny config: relative position bias, padding."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.1,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    return model, _seq2seq_batch(pad=0), None


def bart() -> Case:
    """BartForConditionalGeneration from a tiny config, SDPA attention, dropout on."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    return model, _seq2seq_batch(pad=1), None


# -- torch.nn attention -------------------------------------------------------------------
class _MHAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.attn = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True,
                                                norm_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(ids)
        n = ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        a, _ = self.attn(h, h, h, attn_mask=causal)  # need_weights: the explicit path
        h = self.layer(self.norm(h + a), src_key_padding_mask=padding)
        logits = self.head(h[:, :-1])
        return {"loss": F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())}


def multihead_attention() -> Case:
    """nn.MultiheadAttention (causal mask, weights returned) and an nn.TransformerEncoderLayer
    with a key padding mask."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 10))
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[2, 7:] = True
    return _MHAModel().train(), {"ids": ids, "padding": padding}, None


# -- custom autograd.Function ---------------------------------------------------------------
class _ScaledSwish(torch.autograd.Function):
    """Saves an input and a tensor made inside forward, and a non-tensor on ctx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, beta: float) -> torch.Tensor:
        s = torch.sigmoid(beta * x)
        ctx.save_for_backward(x, s)
        ctx.beta = beta
        return x * s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, s = ctx.saved_tensors
        return grad * (s + ctx.beta * x * s * (1 - s)), None


class _TopK(torch.autograd.Function):
    """Two outputs, the integer one marked non-differentiable and saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, idx = x.topk(k, -1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        ctx.shape = x.shape
        return values, idx

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        (idx,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter(-1, idx, grad), None


class _CustomFunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 64)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.b(self.drop(_ScaledSwish.apply(self.a(x), 1.5)))
        values, idx = _TopK.apply(h, 8)
        return {"loss": self.out(values * (idx.float() + 1) / 64).square().mean()}


def custom_function() -> Case:
    """Custom torch.autograd.Functions: one saving a tensor it made, one with an integer
    non-differentiable output."""
    torch.manual_seed(0)
    return _CustomFunctionNet().train(), torch.randn(64, 32), None


# -- a loss_fn over targets ---------------------------------------------------------------
class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def targets_loss_fn() -> Case:
    """The commonest training loop: the model returns logits and ``loss_fn`` compares them
    with a target tensor it closes over."""
    torch.manual_seed(0)
    targets = torch.randint(0, 5, (64,))
    return _Classifier().train(), torch.randn(64, 32), lambda out: F.cross_entropy(out, targets)


def mixtral() -> Case:
    """MixtralForCausalLM from a tiny config: a sparse mixture of experts (top-2 routing by
    topk, tokens sorted to their experts, grouped matmuls), attention dropout on."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, attention_dropout=0.1,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    return model, {"input_ids": ids, "labels": ids}, None


def deberta() -> Case:
    """DebertaV2ForMaskedLM from a tiny config: disentangled relative attention, whose
    log-bucket positions read constants made by ``torch.tensor`` in forward (no op makes
    them), and dropout masks made by in-place ``bernoulli_`` and ``div_``."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.DebertaV2Config(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, relative_attention=True,
        position_buckets=8, pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    model = transformers.DebertaV2ForMaskedLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    return model, {"input_ids": ids, "labels": ids}, None


def mamba() -> Case:
    """MambaForCausalLM from a tiny config, its sequential scan in PyTorch ops: the
    convolution's SiLU output is saved by multiplies whose backward runs before the
    input projection's, so a rebuild of the projection's input copy needs it made again."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MambaConfig(vocab_size=100, hidden_size=32, state_size=8,
                                      num_hidden_layers=2, expand=2, conv_kernel=4,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    return model, {"input_ids": ids, "labels": ids}, None


# tiny speech encoders (wav2vec2 and HuBERT): two conv layers, two transformer layers
_SPEECH = dict(
    vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
    num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
    hidden_dropout=0.1, attention_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.0,
    pad_token_id=0, ctc_loss_reduction="mean",
)


def wav2vec2() -> Case:
    """Wav2Vec2ForCTC from a tiny config: a convolutional feature encoder with group norm,
    a grouped convolution for positions under weight norm, and a CTC loss, whose saves
    differ while a dispatch mode is on (NOTE [ops a dispatch mode changes])."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.Wav2Vec2Config(**_SPEECH)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    gen = torch.Generator().manual_seed(1)
    return model, {"input_values": torch.randn(2, 400, generator=gen),
                   "labels": torch.randint(1, 20, (2, 6), generator=gen)}, None


def hubert() -> Case:
    """HubertForCTC from a tiny config: Wav2Vec2's convolutional feature encoder and
    weight-normed positional convolution, under another family's modules, and a CTC loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.HubertConfig(**_SPEECH)
    torch.manual_seed(0)
    model = transformers.HubertForCTC(config).train()
    gen = torch.Generator().manual_seed(1)
    return model, {"input_values": torch.randn(2, 200, generator=gen),
                   "labels": torch.randint(1, 20, (2, 6), generator=gen)}, None


def wav2vec2_conformer() -> Case:
    """Wav2Vec2ConformerForCTC from a tiny config: rotary positions that its embedding
    module caches on itself (the program holds that saved activation past the step, so
    moving it frees nothing: ``StepProfile.held_past_step``), a depthwise convolution
    with BatchNorm and GLU, and a CTC loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.Wav2Vec2ConformerConfig(
        vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
        layerdrop=0.0, conv_depthwise_kernel_size=7, position_embeddings_type="rotary",
        pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ConformerForCTC(config).train()
    g = torch.Generator().manual_seed(1)
    return model, {"input_values": torch.randn(2, 800, generator=g),
                   "labels": torch.randint(1, 20, (2, 5), generator=g)}, None


def perceiver() -> Case:
    """PerceiverForMaskedLM from a tiny config: cross-attention from a learned latent array
    to the inputs, self-attention over the latents, and a decoder whose queries are
    position embeddings."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.PerceiverConfig(
        num_latents=8, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=4, num_cross_attention_heads=4, qk_channels=32,
        v_channels=32, cross_attention_widening_factor=1, self_attention_widening_factor=1,
        vocab_size=100, max_position_embeddings=16, attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    model = transformers.PerceiverForMaskedLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    return model, {"inputs": ids, "labels": ids}, None


def funnel() -> Case:
    """FunnelForMaskedLM from a tiny config: attention with relative positions whose
    sequence is pooled between blocks, and a decoder that upsamples it back."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.FunnelConfig(
        vocab_size=100, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=4,
        d_head=8, d_inner=64, hidden_dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.FunnelForMaskedLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    return model, {"input_ids": ids, "labels": ids}, None


def switch() -> Case:
    """SwitchTransformersForConditionalGeneration from a tiny config: top-1 routing with
    expert capacity, multiplicative router jitter drawn by ``uniform_`` in forward, and a
    router z-loss and load-balancing loss added to the loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.SwitchTransformersConfig(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, expert_capacity=8, num_layers=2,
        num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1,
        num_heads=4, num_experts=4, relative_attention_num_buckets=8, dropout_rate=0.1,
        router_jitter_noise=0.01, decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(config).train()
    return model, _seq2seq_batch(pad=0), None


def longformer() -> Case:
    """LongformerForMaskedLM from a tiny config: sliding-window attention by chunked
    ``as_strided`` views and diagonal padding, plus one token of global attention."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LongformerConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, attention_window=[4, 4], max_position_embeddings=40,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LongformerForMaskedLM(config).train()
    ids = torch.randint(3, 100, (2, 16))
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    return model, {"input_ids": ids, "global_attention_mask": global_mask, "labels": ids}, None


def _bigbird(attention_type: str) -> Case:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BigBirdConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, attention_type=attention_type,
        block_size=2, num_random_blocks=1, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    model = transformers.BigBirdForMaskedLM(config).train()
    ids = torch.randint(3, 100, (2, 32))
    return model, {"input_ids": ids, "labels": ids}, None


def bigbird_full() -> Case:
    """BigBirdForMaskedLM from a tiny config with full attention."""
    return _bigbird("original_full")


def bigbird_sparse() -> Case:
    """BigBirdForMaskedLM from a tiny config with block-sparse attention: random blocks
    drawn by NumPy (seeded per layer in training), gathered by index tensors made from
    NumPy arrays in forward."""
    return _bigbird("block_sparse")


# -- graph message passing -----------------------------------------------------------------
class _MessagePassing(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.message = nn.Linear(2 * dim, dim)
        self.update = nn.Linear(3 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        m = F.relu(self.message(torch.cat([x[src], x[dst]], -1)))
        index = dst[:, None].expand_as(m)
        amax = x.new_zeros(x.shape).scatter_reduce(0, index, m, "amax", include_self=False)
        total = x.new_zeros(x.shape).index_add(0, dst, m)
        degree = x.new_zeros(x.shape[0]).index_add(0, dst, torch.ones_like(dst, dtype=x.dtype))
        mean = total / degree.clamp(min=1)[:, None]
        return self.norm(x + self.drop(self.update(torch.cat([x, amax, mean], -1))))


class _GNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layers = nn.ModuleList(_MessagePassing(32) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, src, dst)
        return {"loss": F.cross_entropy(self.head(h), labels)}


def gnn() -> Case:
    """Graph message passing: messages gathered by edge index, aggregated by
    ``scatter_reduce`` (amax) and ``index_add`` (mean), node classification."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    edges = torch.randint(0, 40, (2, 160), generator=gen)
    batch = {"x": torch.randn(40, 16, generator=gen), "src": edges[0], "dst": edges[1],
             "labels": torch.randint(0, 4, (40,), generator=gen)}
    return _GNN().train(), batch, None


# -- parameter-efficient fine-tuning and parametrizations -----------------------------------
class _LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update, as peft's LoRA writes it."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # peft starts at zero; a step moves it
        self.drop = nn.Dropout(0.1)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.drop(x))) * self.scaling


class _LoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32).requires_grad_(False)
        self.up = _LoRALinear(nn.Linear(32, 64))
        self.down = _LoRALinear(nn.Linear(64, 32))
        self.norm = nn.LayerNorm(32).requires_grad_(False)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        logits = self.head(h[:, :-1])
        return {"loss": F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())}


def lora() -> Case:
    """LoRA-wrapped Linears over frozen weights (a frozen embedding and norm too): most
    saved activations serve only the adapters' gradients."""
    torch.manual_seed(0)
    return _LoRANet().train(), {"ids": torch.randint(0, 64, (8, 12))}, None


class _Parametrized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm, weight_norm

        self.conv = spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
        self.conv2 = weight_norm(nn.Conv2d(8, 8, 3, stride=2, padding=1))
        self.fc = weight_norm(nn.Linear(8 * 4 * 4, 32))
        self.drop = nn.Dropout(0.1)
        self.head = spectral_norm(nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.conv(x), 0.2)
        h = F.avg_pool2d(F.leaky_relu(self.conv2(h), 0.2), 2)
        return self.head(self.drop(F.leaky_relu(self.fc(h.flatten(1)), 0.2)))


def parametrizations() -> Case:
    """spectral_norm and weight_norm from torch.nn.utils.parametrizations: weights made
    in forward from parameters, spectral norm's power iteration updating its ``_u`` and
    ``_v`` buffers in place in training mode."""
    torch.manual_seed(0)
    return _Parametrized().train(), torch.randn(4, 3, 16, 16), _first_class_loss


class _DiffusersUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        self.unet = UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4,
            attention_head_dim=4, dropout=0.1,
        )

    def forward(self, images: torch.Tensor, timesteps: torch.Tensor) -> dict[str, torch.Tensor]:
        noise = torch.randn_like(images)
        alpha = torch.cos((timesteps.float() / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2
        alpha = alpha[:, None, None, None]
        noisy = alpha.sqrt() * images + (1 - alpha).sqrt() * noise
        return {"loss": F.mse_loss(self.unet(noisy, timesteps).sample, noise)}


def diffusers_unet() -> Case:
    """diffusers' UNet2DModel from a tiny config (ResNet blocks with dropout, an attention
    block each way), trained on noise drawn in forward."""
    torch.manual_seed(0)
    batch = {"images": torch.randn(2, 3, 8, 8), "timesteps": torch.randint(0, 1000, (2,))}
    return _DiffusersUNet().train(), batch, None



def segformer() -> Case:
    """SegformerForSemanticSegmentation from a tiny config: attention over a sequence
    reduced by a strided convolution, Mix-FFN with a depthwise convolution, drop path,
    and a decode head that upsamples every stage (bilinear) and concatenates them. Its
    stages' outputs reach the head through forward hooks transformers registers on the
    first call (``capture_outputs``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=16, drop_path_rate=0.2, hidden_dropout_prob=0.1, num_labels=5,
    )
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config).train()
    batch = {"pixel_values": torch.randn(2, 3, 32, 32),
             "labels": torch.randint(0, 5, (2, 32, 32))}
    return model, batch, None


def swin() -> Case:
    """SwinForImageClassification from a tiny config: attention in windows shifted by
    ``torch.roll`` with a mask between them, patch merging, and drop path."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 2],
        window_size=4, drop_path_rate=0.2, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, num_labels=10,
    )
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(config).train()
    return model, {"pixel_values": torch.randn(2, 3, 16, 16),
                   "labels": torch.randint(0, 10, (2,))}, None


def bloom() -> Case:
    """BloomForCausalLM from a tiny config: ALiBi position biases added to the scores by
    ``baddbmm``, and dropout fused with the residual add."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4,
                                      hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).train()
    ids = torch.randint(0, 100, (2, 12))
    return model, {"input_ids": ids, "labels": ids}, None


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 4, 1)
        self.expand = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.expand(F.relu(self.reduce(F.adaptive_avg_pool2d(x, 1))))
        return x * F.hardsigmoid(scale)


class _MBConv(nn.Module):
    """MobileNetV3 / EfficientNet's inverted residual: expand, depthwise, squeeze and
    excite, project, with stochastic depth on the residual branch."""

    def __init__(self, channels: int, expand: int, path: float) -> None:
        super().__init__()
        wide = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, wide, 1, bias=False),
                                    nn.BatchNorm2d(wide), nn.Hardswish(inplace=True))
        self.depthwise = nn.Sequential(
            nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False),
            nn.BatchNorm2d(wide), nn.SiLU(inplace=True))
        self.excite = _SqueezeExcite(wide)
        self.project = nn.Sequential(nn.Conv2d(wide, channels, 1, bias=False),
                                     nn.BatchNorm2d(channels))
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(self.excite(self.depthwise(self.expand(x))))
        return x + drop_path(h, self.path, self.training)


class _EfficientNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.SiLU(inplace=True))
        self.blocks = nn.Sequential(_MBConv(8, 4, 0.1), _MBConv(8, 4, 0.2))
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.blocks(self.stem(x)).mean((2, 3))))


def efficientnet_channels_last() -> Case:
    """EfficientNet-style inverted residuals (depthwise convolutions, squeeze and excite,
    in-place Hardswish and SiLU, stochastic depth), model and batch in ``channels_last``
    memory format: every saved activation is strided NHWC."""
    torch.manual_seed(0)
    model = _EfficientNet().train().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    return model, x, _first_class_loss

MODELS: dict[str, Callable[[], Case]] = {
    "lstm": lstm,
    "gru": gru,
    "cnn_bn_inplace": cnn_bn_inplace,
    "resnet": resnet,
    "vit": vit,
    "unet": unet,
    "t5": t5,
    "bart": bart,
    "mixtral": mixtral,
    "deberta": deberta,
    "mamba": mamba,
    "wav2vec2": wav2vec2,
    "hubert": hubert,
    "wav2vec2_conformer": wav2vec2_conformer,
    "perceiver": perceiver,
    "funnel": funnel,
    "switch": switch,
    "longformer": longformer,
    "bigbird_full": bigbird_full,
    "bigbird_sparse": bigbird_sparse,
    "gnn": gnn,
    "lora": lora,
    "parametrizations": parametrizations,
    "diffusers_unet": diffusers_unet,
    "multihead_attention": multihead_attention,
    "custom_function": custom_function,
    "targets_loss_fn": targets_loss_fn,
    "segformer": segformer,
    "swin": swin,
    "bloom": bloom,
    "efficientnet_channels_last": efficientnet_channels_last,
}
