"""Flow-matching estimator of Chatterbox's S3Gen: the causal ``ConditionalDecoder`` U-Net.

The estimator predicts the flow-matching velocity ``dx/dt`` for a noisy mel
spectrogram ``x`` given the token encoder output ``mu``, a speaker embedding
``spks``, a prompt-mel condition ``cond`` and the flow time ``t`` (plus the end
time ``r`` for the "mean-flow" distilled variant).

This is an independent, dependency-free (no einops / diffusers) re-implementation
whose ``state_dict`` keys and shapes are exactly those stored in the upstream
checkpoint under the prefix ``flow.decoder.estimator.``, so upstream weights load
with ``strict=True``.  The layout (full size) is::

    time_embeddings            sinusoidal embedding of t (no parameters), dim 320
    time_mlp.linear_{1,2}      320 -> 1024 -> 1024 (SiLU in between)
    time_embed_mixer           meanflow only: Linear(2048 -> 1024, bias=False)
    down_blocks.0.{0,1,2}      resnet 320->256, 4 transformer blocks, causal conv
    mid_blocks.{0..11}.{0,1}   resnet 256->256, 4 transformer blocks
    up_blocks.0.{0,1,2}        resnet 512->256 (skip concat), 4 transformer blocks, causal conv
    final_block, final_proj    causal block 256->256, 1x1 conv 256 -> 80

Only the causal variant (the one Chatterbox uses) is implemented.  Everything is
written with plain tensor ops and no data-dependent Python control flow, so the
module traces/exports to ONNX (opset 17) with dynamic batch and time axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from s3flow.model.prefix_cache import CacheShape, PrefixCache, PrefixWalk, mask_to_attention_bias

__all__ = [
    "EstimatorConfig",
    "ConditionalDecoder",
    "CausalConv1d",
    "CausalBlock1D",
    "CausalResnetBlock1D",
    "SinusoidalPosEmb",
    "TimestepEmbedding",
    "Attention",
    "FeedForward",
    "BasicTransformerBlock",
]


@dataclass
class EstimatorConfig:
    """Hyper-parameters of :class:`ConditionalDecoder`.

    Attributes:
        in_channels: Channels of the stacked input ``[x, mu, spks, cond]``;
            must equal ``4 * out_channels``. Also the sinusoidal time-embedding size.
        out_channels: Mel bins of the predicted velocity (``n_feats``).
        channels: U-Net widths, one per down/up level (Chatterbox: one level of 256).
        attention_head_dim: Width of each attention head.
        n_blocks: Transformer blocks per U-Net stage.
        num_mid_blocks: Number of (resnet, transformers) mid stages.
        num_heads: Attention heads per transformer block.
        meanflow: Whether the model also takes the end time ``r`` (adds
            ``time_embed_mixer``).
    """

    in_channels: int = 320
    out_channels: int = 80
    channels: Tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    meanflow: bool = False

    def __post_init__(self) -> None:
        self.channels = tuple(int(c) for c in self.channels)
        if len(self.channels) == 0:
            raise ValueError("channels must have at least one entry")
        if self.in_channels != 4 * self.out_channels:
            raise ValueError(
                f"in_channels ({self.in_channels}) must be 4 * out_channels "
                f"({self.out_channels}): the input is [x, mu, spks, cond] stacked"
            )
        if self.in_channels % 2 != 0:
            raise ValueError("in_channels must be even (sinusoidal embedding)")

    @classmethod
    def full(cls, meanflow: bool = False) -> "EstimatorConfig":
        """The configuration of the released Chatterbox checkpoints (~71 M parameters)."""
        return cls(meanflow=meanflow)

    @classmethod
    def small(cls, meanflow: bool = False) -> "EstimatorConfig":
        """A tiny configuration with the same interface, for fast tests."""
        return cls(
            in_channels=320,
            out_channels=80,
            channels=(64,),
            attention_head_dim=32,
            n_blocks=1,
            num_mid_blocks=2,
            num_heads=2,
            meanflow=meanflow,
        )

    @property
    def n_feats(self) -> int:
        """Mel bins of ``x``, ``mu``, ``cond`` and the output (= ``out_channels``)."""
        return self.out_channels

    @property
    def time_embed_dim(self) -> int:
        """Width of the time embedding (``4 * channels[0]``)."""
        return 4 * self.channels[0]


# --------------------------------------------------------------------------- #
# Convolutional building blocks
# --------------------------------------------------------------------------- #
class CausalConv1d(nn.Conv1d):
    """Stride-1 1-D convolution padded on the left only (output frame i sees <= i).

    Shapes: ``(B, C_in, T) -> (B, C_out, T)``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0)
        self.left_pad = kernel_size - 1

    def forward(self, x: torch.Tensor, walk: Optional[PrefixWalk] = None) -> torch.Tensor:
        """``walk``: the frames before ``x`` come from a prefix cache (``s3flow.model.prefix_cache``)."""
        if walk is not None:
            return super().forward(walk.conv_input(x, self.left_pad, self.in_channels))
        return super().forward(F.pad(x, (self.left_pad, 0)))


class _Transpose12(nn.Module):
    """Swaps dims 1 and 2 (channels <-> time); parameter-free."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """Causal conv(k=3) -> LayerNorm over channels -> Mish, masked in and out.

    ``block`` is a Sequential whose indices match the checkpoint
    (``block.0`` conv, ``block.2`` LayerNorm; 1 and 3 are transposes, 4 Mish).
    """

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3),
            _Transpose12(),
            nn.LayerNorm(dim_out),
            _Transpose12(),
            nn.Mish(),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor, walk: Optional[PrefixWalk] = None) -> torch.Tensor:
        """Applies the block.

        Args:
            x: (B, dim, T).
            mask: (B, 1, T) float frame mask.
            walk: the prefix cache's pass (``s3flow.model.prefix_cache``), or None.

        Returns:
            (B, dim_out, T), zero on padded frames.
        """
        if walk is None:
            return self.block(x * mask) * mask
        h = self.block[0](x * mask, walk)   # the causal conv reads the prefix; the rest as the Sequential runs it
        for i in range(1, len(self.block)):
            h = self.block[i](h)
        return h * mask


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with an additive time embedding and a 1x1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time_emb: torch.Tensor,
                walk: Optional[PrefixWalk] = None) -> torch.Tensor:
        """Applies the residual block.

        Args:
            x: (B, dim, T).
            mask: (B, 1, T) float frame mask.
            time_emb: (B, time_emb_dim) (or (1, time_emb_dim), broadcast).

        Returns:
            (B, dim_out, T). Padded frames are *not* zeroed (they hold the
            residual conv bias, as upstream); later stages mask their inputs.
        """
        h = self.block1(x, mask, walk)
        h = h + self.mlp(time_emb).unsqueeze(-1)
        h = self.block2(h, mask, walk)
        return h + self.res_conv(x * mask)


class Downsample1D(nn.Module):
    """Stride-2 conv (only used when ``len(channels) > 1``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.conv(x)


class Upsample1D(nn.Module):
    """Stride-2 transposed conv (only used when ``len(channels) > 1``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.conv(x)


# --------------------------------------------------------------------------- #
# Time embedding
# --------------------------------------------------------------------------- #
class SinusoidalPosEmb(nn.Module):
    """Sinusoidal embedding of a scalar time, scaled by 1000 (Grad-TTS style)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim % 2 != 0:
            raise ValueError("SinusoidalPosEmb requires an even dim")
        self.dim = dim

    def forward(self, t: torch.Tensor, scale: float = 1000.0) -> torch.Tensor:
        """Embeds times.

        Args:
            t: (B,) times (a 0-d tensor is treated as (1,)).
            scale: Multiplier applied to ``t`` before the sinusoids.

        Returns:
            (B, dim) float32 embedding ``[sin(..), cos(..)]``.
        """
        if t.dim() < 1:
            t = t.unsqueeze(0)
        half = self.dim // 2
        step = math.log(10000.0) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        arg = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat((arg.sin(), arg.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    """``linear_2(SiLU(linear_1(emb)))``: (B, in_channels) -> (B, time_embed_dim)."""

    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.linear_2(self.act(self.linear_1(sample)))


def make_time_embed_mixer(dim: int) -> nn.Linear:
    """Bias-free ``Linear(2*dim -> dim)`` initialised to ``[I | 0]``.

    With this initialisation ``mixer(cat([t_emb, r_emb]))`` equals ``t_emb``, i.e. a
    fresh mean-flow model ignores ``r`` (IntMeanFlow, arXiv:2510.07979, sec. 3.3).
    """
    layer = nn.Linear(2 * dim, dim, bias=False)
    reset_time_embed_mixer(layer)
    return layer


def reset_time_embed_mixer(layer: nn.Linear) -> None:
    """(Re)sets a mixer's weight (dim, 2*dim) to ``[I | 0]`` in place."""
    dim = layer.out_features
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[:, :dim].copy_(torch.eye(dim, device=layer.weight.device, dtype=layer.weight.dtype))


# --------------------------------------------------------------------------- #
# Transformer (diffusers-style BasicTransformerBlock, self-attention only)
# --------------------------------------------------------------------------- #
class Attention(nn.Module):
    """Multi-head self-attention with bias-free q/k/v and a biased output projection.

    Key names follow diffusers' ``Attention``: ``to_q``, ``to_k``, ``to_v``,
    ``to_out.0`` (index 1 upstream is a parameter-free dropout, omitted).
    """

    def __init__(self, query_dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.dim_head = dim_head
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim, bias=True)])

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, walk: Optional[PrefixWalk] = None) -> torch.Tensor:
        """Attends every query to all (unmasked) key frames (with ``walk``: the prefix cache's first).

        Args:
            x: (B, T, query_dim).
            attn_bias: (B, 1, 1, T) additive key bias (``s3flow.model.prefix_cache.mask_to_attention_bias``).
            walk: the prefix cache's pass (``s3flow.model.prefix_cache``), or None.

        Returns:
            (B, T, query_dim).
        """
        b, t = x.shape[0], x.shape[1]

        def split(y: torch.Tensor) -> torch.Tensor:  # (B, T, H*D) -> (B, H, T, D)
            return y.reshape(b, t, self.heads, self.dim_head).transpose(1, 2)

        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        if walk is not None:
            k, v, attn_bias = walk.attend(k, v, attn_bias)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale + attn_bias
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, self.heads * self.dim_head)
        return self.to_out[0](out)


class GELUProj(nn.Module):
    """``gelu(proj(x))`` with the exact (erf) GELU; key ``proj``."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """``net.2(net.1(net.0(x)))``: GELU projection to ``mult*dim``, (no-op) dropout, projection back."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        inner = dim * mult
        # Index 1 is upstream's dropout (p=0 in Chatterbox); kept so keys are net.0 / net.2.
        self.net = nn.ModuleList([GELUProj(dim, inner), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nn.Module):
    """Pre-norm block: ``x += attn1(norm1(x)); x += ff(norm3(x))``.

    (Upstream has no ``norm2``/``attn2``: no cross-attention.)
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, num_heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, walk: Optional[PrefixWalk] = None) -> torch.Tensor:
        """Applies the block.

        Args:
            x: (B, T, dim).
            attn_bias: (B, 1, 1, T) additive key bias.
            walk: the prefix cache's pass (``s3flow.model.prefix_cache``), or None.

        Returns:
            (B, T, dim).
        """
        x = x + self.attn1(self.norm1(x), attn_bias, walk)
        return x + self.ff(self.norm3(x))


def _transformer_stack(dim: int, cfg: EstimatorConfig) -> nn.ModuleList:
    return nn.ModuleList(
        [BasicTransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks)]
    )


def _run_transformers(
    blocks: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor, walk: Optional[PrefixWalk] = None
) -> torch.Tensor:
    """(B, C, T) -> transformers over time -> (B, C, T), keys masked by ``mask`` (B, 1, T)."""
    bias = mask_to_attention_bias(mask).to(x.dtype)
    h = x.transpose(1, 2)
    for block in blocks:
        h = block(h, bias, walk)
    return h.transpose(1, 2)


# --------------------------------------------------------------------------- #
# The U-Net
# --------------------------------------------------------------------------- #
class ConditionalDecoder(nn.Module):
    """Causal 1-D U-Net with transformer stages that predicts the flow velocity.

    Args:
        config: Hyper-parameters; defaults to :meth:`EstimatorConfig.full`.
    """

    def __init__(self, config: Optional[EstimatorConfig] = None) -> None:
        super().__init__()
        cfg = config if config is not None else EstimatorConfig.full()
        self.config = cfg
        self.meanflow = cfg.meanflow
        self.in_channels = cfg.in_channels
        self.out_channels = cfg.out_channels
        ch = cfg.channels
        temb = cfg.time_embed_dim

        self.time_embeddings = SinusoidalPosEmb(cfg.in_channels)
        self.time_mlp = TimestepEmbedding(cfg.in_channels, temb)

        self.down_blocks = nn.ModuleList()
        self.mid_blocks = nn.ModuleList()
        self.up_blocks = nn.ModuleList()

        prev = cfg.in_channels
        for i, c in enumerate(ch):
            is_last = i == len(ch) - 1
            resample: nn.Module = CausalConv1d(c, c, 3) if is_last else Downsample1D(c)
            self.down_blocks.append(
                nn.ModuleList([CausalResnetBlock1D(prev, c, temb), _transformer_stack(c, cfg), resample])
            )
            prev = c

        for _ in range(cfg.num_mid_blocks):
            self.mid_blocks.append(
                nn.ModuleList([CausalResnetBlock1D(ch[-1], ch[-1], temb), _transformer_stack(ch[-1], cfg)])
            )

        up_ch = ch[::-1] + (ch[0],)
        for i in range(len(up_ch) - 1):
            c_in, c_out = 2 * up_ch[i], up_ch[i + 1]
            is_last = i == len(up_ch) - 2
            resample = CausalConv1d(c_out, c_out, 3) if is_last else Upsample1D(c_out)
            self.up_blocks.append(
                nn.ModuleList([CausalResnetBlock1D(c_in, c_out, temb), _transformer_stack(c_out, cfg), resample])
            )

        self.final_block = CausalBlock1D(up_ch[-1], up_ch[-1])
        self.final_proj = nn.Conv1d(up_ch[-1], cfg.out_channels, 1)
        self.initialize_weights()

        # Created after initialize_weights so it keeps its [I | 0] init (as upstream).
        self.time_embed_mixer: Optional[nn.Linear] = make_time_embed_mixer(temb) if cfg.meanflow else None

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype (of ``final_proj``)."""
        return self.final_proj.weight.dtype

    def initialize_weights(self) -> None:
        """Upstream init: Kaiming-normal conv/linear weights, zero biases.

        LayerNorms and the transposed conv keep PyTorch defaults; the mean-flow
        mixer (if any) is not touched (see :func:`reset_time_embed_mixer`).
        """
        for m in self.modules():
            if isinstance(m, (nn.Conv1d, nn.Linear)) and m is not getattr(self, "time_embed_mixer", None):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def embed_time(self, t: torch.Tensor, r: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Time conditioning vector.

        Args:
            t: (B,) flow time (or (1,), broadcast over the batch).
            r: (B,) end time; required iff ``config.meanflow``.

        Returns:
            (B, time_embed_dim).
        """
        if self.meanflow and r is None:
            raise ValueError("this is a meanflow estimator: r (end time) is required")
        if not self.meanflow and r is not None:
            raise ValueError("r is only accepted by meanflow estimators")
        emb = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        if self.time_embed_mixer is not None:
            r_emb = self.time_mlp(self.time_embeddings(r).to(t.dtype))
            emb = self.time_embed_mixer(torch.cat([emb, r_emb], dim=1))
        return emb

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        r: Optional[torch.Tensor] = None,
        past: Optional[PrefixCache] = None,
        keep: Optional[torch.Tensor] = None,
    ):
        """Predicts the velocity field.

        Args:
            x: (B, n_feats, T) current noisy mel.
            mask: (B, 1, T) float, 1 on valid frames, 0 on padding.
            mu: (B, n_feats, T) encoder output (upsampled tokens).
            t: (B,) flow time in [0, 1] (or (1,), broadcast).
            spks: (B, n_feats) projected speaker embedding.
            cond: (B, n_feats, T) prompt mel (zeros outside the prompt).
            r: (B,) end time; required iff ``config.meanflow``.
            past: the states of frames before each row (``s3flow.model.prefix_cache``): the rows are read as
                following them.
            keep: (B,) int64: also return the states of each row's first ``keep`` frames, for a later call's
                ``past``.

        Returns:
            (B, out_channels, T) velocity, exactly zero on padded frames; with ``keep``, (velocity, PrefixCache).
        """
        walk = None
        if past is not None or keep is not None:
            if len(self.down_blocks) > 1:
                raise ValueError("a prefix cache needs the one-level U-Net (no down/upsampling)")
            walk = PrefixWalk(past, keep, CacheShape.of(self.config).width, frames=x.shape[-1])
        temb = self.embed_time(t, r)

        spk_map = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        h = torch.cat([x, mu, spk_map, cond], dim=1)

        skips: List[torch.Tensor] = []
        masks: List[torch.Tensor] = [mask]  # one per resolution level
        n_down = len(self.down_blocks)
        for level, (resnet, transformers, resample) in enumerate(self.down_blocks):
            m = masks[-1]
            h = resnet(h, m, temb, walk)
            h = _run_transformers(transformers, h, m, walk)
            skips.append(h)
            h = resample(h * m) if walk is None else resample(h * m, walk)
            if level < n_down - 1:  # static: the last level does not downsample
                masks.append(m[:, :, ::2])

        m = masks[-1]
        for resnet, transformers in self.mid_blocks:
            h = resnet(h, m, temb, walk)
            h = _run_transformers(transformers, h, m, walk)

        for resnet, transformers, resample in self.up_blocks:
            m = masks.pop()
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
            h = resnet(h, m, temb, walk)
            h = _run_transformers(transformers, h, m, walk)
            h = resample(h * m) if walk is None else resample(h * m, walk)

        h = self.final_block(h, m, walk)
        v = self.final_proj(h * m) * mask
        return (v, walk.recorded()) if keep is not None else v
