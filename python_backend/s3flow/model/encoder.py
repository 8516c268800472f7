"""S3Gen's flow encoder: speech tokens + speaker x-vector -> (mu, mask, spks) for the CFM estimator.

A clean re-implementation of the token side of Chatterbox's ``CausalMaskedDiffWithXvec`` (CosyVoice 2's
``UpsampleConformerEncoder`` plus the flow's token embedding, encoder projection and speaker projection),
inference only. Parameter names equal the upstream checkpoint's ``flow.*`` names with ``flow.`` stripped,
so ``FlowEncoder.load_state_dict`` takes those tensors unchanged.

Data path for ``B`` rows of ``N`` tokens (``D`` = ``output_size``, ``F`` = ``n_feats``)::

    tokens (B, N) -> input_embedding, zeroed past token_len        (B, N, input_size)
      -> encoder.embed: Linear, LayerNorm, * sqrt(D)               (B, N, D)
      -> encoder.pre_lookahead_layer (sees 3 tokens ahead)         (B, N, D)
      -> encoder.encoders: num_blocks rel-pos conformer blocks     (B, N, D)
      -> encoder.up_layer: repeat x2 + causal conv                 (B, 2N, D)
      -> encoder.up_embed, encoder.up_encoders, encoder.after_norm (B, 2N, D)
      -> encoder_proj, channels-major                              mu (B, F, 2N)
    embedding (B, 192) -> L2-normalise -> spk_embed_affine_layer   spks (B, F)

Attention is over the whole (valid part of the) sequence, so every output frame depends on every
valid token; no lookahead trimming happens here (the caller drops the last
``pre_lookahead_len * token_mel_ratio`` frames while more tokens are still to come).

Padding: a batch row is exactly (to float rounding) what the same utterance gives alone. Upstream
differs here in one place: its pre-lookahead convolution reads the three positions after the last
valid token, which in a padded batch hold ``LayerNorm(Linear(0))`` of the padding rather than zeros,
so a padded row leaks padding into every frame. We zero the padded positions before that layer; for
an unpadded row (upstream's only supported case, batch size 1) this changes nothing.

Example::

    enc = FlowEncoder(EncoderConfig.full()).eval()
    enc.load_state_dict({k[5:]: v for k, v in ckpt.items() if k.startswith("flow.") and ...})
    mu, mask, spks = enc(tokens, token_len, xvector)   # (B, 80, 2N), (B, 1, 2N), (B, 80)
    s3flow.runtime.onnx_export.export_encoder(enc, "encoder.onnx")
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class EncoderConfig:
    """Sizes and flags of the flow encoder; the defaults are upstream's (``s3gen.py`` / ``flow.py``).

    Attributes:
        vocab_size: Speech-token vocabulary (S3 tokenizer v2: 3^8 = 6561).
        input_size: Token embedding width (also the input width of ``up_embed``; must equal
            ``output_size``, as upstream feeds the upsampled encoder state into ``up_embed``).
        output_size: Conformer width ``D``.
        attention_heads: Heads per self-attention; ``output_size`` must divide evenly.
        linear_units: Feed-forward hidden width.
        num_blocks: Conformer blocks at token rate (``encoder.encoders``).
        num_up_blocks: Conformer blocks at mel rate (``encoder.up_encoders``; upstream hard-codes 4).
        pre_lookahead_len: Future tokens the pre-lookahead convolution reads.
        token_mel_ratio: Mel frames per token (the upsampling stride).
        spk_embed_dim: Speaker x-vector width (CAM++: 192).
        n_feats: Mel bins; width of ``mu`` and ``spks``.
        dropout_rate: Upstream's training dropout; recorded only (inference applies no dropout).
        positional_dropout_rate: As ``dropout_rate``.
        attention_dropout_rate: As ``dropout_rate``.
        normalize_before: Pre-LayerNorm blocks (upstream: True; the only supported value).
        macaron_style: Macaron feed-forward (upstream: False; the only supported value).
        use_cnn_module: Conformer convolution module (upstream: False; the only supported value).
        key_bias: Whether the attention key projection has a bias.
        activation_type: Feed-forward activation (upstream: "swish" = SiLU; the only supported value).
        pos_enc_max_len: Longest sequence, in mel frames (``token_mel_ratio * N``), the precomputed
            relative positional table covers. Upstream builds 5000 and grows it on demand; 6144
            frames is 3072 tokens, about 123 s of speech.
    """

    vocab_size: int = 6561
    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    token_mel_ratio: int = 2
    spk_embed_dim: int = 192
    n_feats: int = 80
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    normalize_before: bool = True
    macaron_style: bool = False
    use_cnn_module: bool = False
    key_bias: bool = True
    activation_type: str = "swish"
    pos_enc_max_len: int = 6144

    def __post_init__(self) -> None:
        if not self.normalize_before or self.macaron_style or self.use_cnn_module:
            raise ValueError("only upstream's block layout is implemented: "
                             "normalize_before=True, macaron_style=False, use_cnn_module=False")
        if self.activation_type != "swish":
            raise ValueError(f"only the 'swish' activation is implemented, got {self.activation_type!r}")
        if self.input_size != self.output_size:
            raise ValueError(f"input_size ({self.input_size}) must equal output_size ({self.output_size})")
        if self.output_size % self.attention_heads or self.output_size % 2:
            raise ValueError("output_size must be even and divisible by attention_heads")
        if self.pre_lookahead_len < 0 or self.token_mel_ratio < 1:
            raise ValueError("pre_lookahead_len must be >= 0 and token_mel_ratio >= 1")

    @classmethod
    def full(cls) -> "EncoderConfig":
        """Upstream's full-size encoder (41.2 M parameters with the embedding and projections)."""
        return cls()

    @classmethod
    def small(cls) -> "EncoderConfig":
        """A small encoder for tests: 64 wide, 2 heads, 2 + 2 blocks; real vocabulary."""
        return cls(input_size=64, output_size=64, attention_heads=2, linear_units=128,
                   num_blocks=2, num_up_blocks=2)

    @property
    def lookahead_frames(self) -> int:
        """Frames at the end of the output that depend on tokens not received yet while streaming."""
        return self.pre_lookahead_len * self.token_mel_ratio


def length_mask(lengths: torch.Tensor, max_len: Union[int, torch.Tensor]) -> torch.Tensor:
    """Boolean validity mask from lengths (traceable: ``max_len`` may be a traced size).

    Args:
        lengths: (B,) integer valid lengths.
        max_len: Padded length T.

    Returns:
        (B, T) bool, True where ``t < lengths[b]``.
    """
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def relative_position_table(max_len: int, d_model: int) -> torch.Tensor:
    """ESPnet's relative positional sinusoids for positions ``max_len - 1`` down to ``-(max_len - 1)``.

    Row ``r`` encodes relative position ``max_len - 1 - r`` (query index minus key index), with
    ``sin`` in the even and ``cos`` in the odd columns, as upstream's ``EspnetRelPositionalEncoding``.

    Args:
        max_len: Longest sequence length to cover.
        d_model: Embedding width (even).

    Returns:
        (2 * max_len - 1, d_model) float32.
    """
    rel = torch.arange(max_len - 1, -max_len, -1, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    angle = rel * inv_freq
    return torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).reshape(2 * max_len - 1, d_model)


def rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """Turn scores against relative positions into query-by-key scores (Transformer-XL shift).

    Args:
        scores: (B, H, T, 2T - 1); column ``c`` is relative position ``T - 1 - c``.

    Returns:
        (B, H, T, T) with ``out[..., i, j] = scores[..., i, T - 1 - i + j]`` (relative position i - j).
    """
    b, h, t, p = scores.shape
    padded = F.pad(scores, (1, 0))  # (B, H, T, 2T): a zero column in front of every row
    shifted = padded.reshape(b, h, p + 1, t)[:, :, 1:].reshape(b, h, t, p)
    return shifted[..., :t]


class LinearInput(nn.Module):
    """Linear, LayerNorm, then scale by sqrt(D) (upstream ``LinearNoSubsampling`` + its pos-enc scale).

    Args:
        idim: Input width.
        odim: Output width ``D``.
    """

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, idim) -> (B, T, odim)."""
        return self.out(x) * self.xscale


class RelPositionSelfAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (``pos_bias_u``/``_v``).

    Args:
        n_head: Heads H.
        n_feat: Width D (H * d_k).
        key_bias: Whether ``linear_k`` has a bias.
    """

    def __init__(self, n_head: int, n_feat: int, key_bias: bool = True):
        super().__init__()
        self.h = n_head
        self.d_k = n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """Attend over the valid keys of each row.

        Args:
            x: (B, T, D) normalised input.
            key_mask: (B, T) bool, True for valid positions (keys past the length get no weight).
            pos_emb: (1, 2T - 1, D) relative positional embedding (see ``relative_position_table``).

        Returns:
            (B, T, D).
        """
        b = x.size(0)
        q = self.linear_q(x).view(b, -1, self.h, self.d_k)                   # (B, T, H, d_k)
        k = self.linear_k(x).view(b, -1, self.h, self.d_k).transpose(1, 2)   # (B, H, T, d_k)
        v = self.linear_v(x).view(b, -1, self.h, self.d_k).transpose(1, 2)   # (B, H, T, d_k)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)  # (1, H, 2T-1, d_k)

        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))  # (B, H, T, T)
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (B,H,T,2T-1)
        scores = (content + rel_shift(position)) / math.sqrt(self.d_k)

        masked = ~key_mask[:, None, None, :]                                  # (B, 1, 1, T)
        attn = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).masked_fill(masked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    """Position-wise feed-forward: ``w_2(SiLU(w_1(x)))``.

    Args:
        idim: Width D.
        hidden_units: Hidden width.
    """

    def __init__(self, idim: int, hidden_units: int):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = nn.SiLU()
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.w_2(self.activation(self.w_1(x)))


class ConformerBlock(nn.Module):
    """Pre-norm block: relative-position self-attention then feed-forward, each residual.

    (Upstream's ``ConformerEncoderLayer`` with no macaron feed-forward and no convolution module.)

    Args:
        size: Width D.
        heads: Attention heads.
        linear_units: Feed-forward hidden width.
        key_bias: Whether the key projection has a bias.
    """

    def __init__(self, size: int, heads: int, linear_units: int, key_bias: bool = True):
        super().__init__()
        self.self_attn = RelPositionSelfAttention(heads, size, key_bias)
        self.feed_forward = FeedForward(size, linear_units)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """(B, T, D), (B, T) bool, (1, 2T - 1, D) -> (B, T, D)."""
        x = x + self.self_attn(self.norm_mha(x), key_mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Residual two-convolution layer that lets token ``t`` see tokens ``t - 2 .. t + lookahead``.

    ``conv1`` (kernel ``lookahead + 1``, zero right padding) reads tokens ``t .. t + lookahead``; after a
    leaky ReLU, ``conv2`` (kernel 3, zero left padding) mixes positions ``t - 2 .. t``.

    Args:
        channels: Width D.
        pre_lookahead_len: Future tokens read.
    """

    def __init__(self, channels: int, pre_lookahead_len: int = 3):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); positions past T read as zeros."""
        y = x.transpose(1, 2)
        y = F.leaky_relu(self.conv1(F.pad(y, (0, self.pre_lookahead_len))))
        y = self.conv2(F.pad(y, (2, 0)))
        return x + y.transpose(1, 2)


class CausalUpsample(nn.Module):
    """Nearest-neighbour upsampling by ``stride`` followed by a causal convolution (kernel 2s + 1).

    Args:
        channels: Input width.
        out_channels: Output width.
        stride: Upsampling factor.
    """

    def __init__(self, channels: int, out_channels: int, stride: int = 2):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, out_channels, kernel_size=2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, out_channels, stride * T); frame ``f`` depends on tokens <= f // stride."""
        x = x.unsqueeze(-1).expand(-1, -1, -1, self.stride).flatten(2)  # each frame repeated
        return self.conv(F.pad(x, (2 * self.stride, 0)))


class UpsampleConformerEncoder(nn.Module):
    """Token-rate conformer, x``token_mel_ratio`` upsampling, mel-rate conformer (upstream's layout).

    Holds one non-persistent relative positional table shared by both stages (not in the state dict;
    it is rebuilt from the config, so build on a real device or call ``reset_pos_table`` after
    ``to_empty``).

    Args:
        config: Sizes.
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        c = config
        self.max_len = c.pos_enc_max_len
        self.embed = LinearInput(c.input_size, c.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(c.output_size, c.pre_lookahead_len)
        self.encoders = nn.ModuleList([
            ConformerBlock(c.output_size, c.attention_heads, c.linear_units, c.key_bias)
            for _ in range(c.num_blocks)])
        self.up_layer = CausalUpsample(c.output_size, c.output_size, c.token_mel_ratio)
        self.up_embed = LinearInput(c.input_size, c.output_size)
        self.up_encoders = nn.ModuleList([
            ConformerBlock(c.output_size, c.attention_heads, c.linear_units, c.key_bias)
            for _ in range(c.num_up_blocks)])
        self.after_norm = nn.LayerNorm(c.output_size, eps=1e-5)
        self.register_buffer("pos_table", relative_position_table(self.max_len, c.output_size),
                             persistent=False)

    @torch.no_grad()
    def reset_pos_table(self) -> None:
        """Recompute the positional table in place (after ``to_empty`` from the meta device)."""
        d = self.after_norm.normalized_shape[0]
        self.pos_table.copy_(relative_position_table(self.max_len, d))

    def position_embedding(self, length: Union[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """(1, 2 * length - 1, D) slice of the table for relative positions length-1 .. -(length-1)."""
        center = self.max_len - 1
        return self.pos_table[center - length + 1:center + length].unsqueeze(0).to(dtype)

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Encode a padded batch of token embeddings.

        Args:
            xs: (B, N, input_size) token embeddings (padded positions may hold anything).
            xs_lens: (B,) int64 valid tokens per row.

        Returns:
            Tuple of the encoder state (B, ratio * N, D) and the frame validity mask (B, 1, ratio * N)
            bool.
        """
        n = xs.size(1)
        if not torch.jit.is_tracing() and self.up_layer.stride * n > self.max_len:
            raise ValueError(f"{n} tokens need {self.up_layer.stride * n} positions; the relative "
                             f"positional table covers {self.max_len} (raise pos_enc_max_len)")
        token_mask = length_mask(xs_lens, n)                                  # (B, N)
        xs = self.embed(xs)
        # Zero the padding so the lookahead convolution reads exactly what an unpadded row would.
        xs = xs * token_mask[:, :, None].to(xs.dtype)
        xs = self.pre_lookahead_layer(xs)
        pos_emb = self.position_embedding(n, xs.dtype)
        for block in self.encoders:
            xs = block(xs, token_mask, pos_emb)

        xs = self.up_layer(xs.transpose(1, 2)).transpose(1, 2)                # (B, T, D)
        t = xs.size(1)
        frame_mask = length_mask(xs_lens * self.up_layer.stride, t)           # (B, T)
        xs = self.up_embed(xs)
        pos_emb = self.position_embedding(t, xs.dtype)
        for block in self.up_encoders:
            xs = block(xs, frame_mask, pos_emb)
        return self.after_norm(xs), frame_mask[:, None, :]


class FlowEncoder(nn.Module):
    """Speech tokens and a speaker x-vector to the CFM estimator's ``mu``, ``mask`` and ``spks``.

    Attribute names match upstream's ``CausalMaskedDiffWithXvec`` (``input_embedding``,
    ``spk_embed_affine_layer``, ``encoder``, ``encoder_proj``), so the checkpoint's ``flow.<name>.*``
    tensors load with the ``flow.`` prefix stripped.

    Args:
        config: Sizes (default: upstream's full size).
    """

    def __init__(self, config: Optional[EncoderConfig] = None):
        super().__init__()
        self.config = config if config is not None else EncoderConfig.full()
        c = self.config
        self.input_embedding = nn.Embedding(c.vocab_size, c.input_size)
        self.spk_embed_affine_layer = nn.Linear(c.spk_embed_dim, c.n_feats)
        self.encoder = UpsampleConformerEncoder(c)
        self.encoder_proj = nn.Linear(c.output_size, c.n_feats)

    def forward(self, tokens: torch.Tensor, token_len: torch.Tensor,
                embedding: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode a padded batch.

        Args:
            tokens: (B, N) int64 speech tokens (prompt tokens first, if any); positions at or past
                ``token_len`` are padding and may hold any value (e.g. -1).
            token_len: (B,) int64 valid tokens per row, 0 < token_len <= N.
            embedding: (B, spk_embed_dim) float32 speaker x-vector; its scale does not matter.

        Returns:
            Tuple of
              - mu: (B, n_feats, token_mel_ratio * N) float32, channels-major, zero on padded frames;
              - mask: (B, 1, token_mel_ratio * N) float32, 1.0 on valid frames;
              - spks: (B, n_feats) projected L2-normalised x-vector.
        """
        n = tokens.size(1)
        token_mask = length_mask(token_len, n)
        # Padding ids may be out of range (-1, stop tokens): clamp, then zero them like upstream.
        ids = tokens.clamp(0, self.config.vocab_size - 1)
        x = self.input_embedding(ids) * token_mask[:, :, None].to(self.input_embedding.weight.dtype)
        h, frame_mask = self.encoder(x, token_len)
        mask = frame_mask.to(h.dtype)                                         # (B, 1, T)
        mu = self.encoder_proj(h).transpose(1, 2) * mask                      # (B, n_feats, T)
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        return mu, mask, spks


def random_encoder_inputs(config: EncoderConfig, batch: int, n_tokens: int, seed: int = 0,
                          pad_token: int = -1) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random padded inputs: row 0 is full length, the others 1..n_tokens, padding ``pad_token``.

    Args:
        config: Supplies the vocabulary and x-vector sizes.
        batch: Rows B.
        n_tokens: Padded length N.
        seed: RNG seed.
        pad_token: Id written past each row's length.

    Returns:
        tokens (B, N) int64, token_len (B,) int64, embedding (B, spk_embed_dim) float32.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, n_tokens), generator=gen)
    token_len = torch.randint(1, n_tokens + 1, (batch,), generator=gen)
    token_len[0] = n_tokens
    tokens[~length_mask(token_len, n_tokens)] = pad_token
    embedding = torch.randn(batch, config.spk_embed_dim, generator=gen) * 5.0
    return tokens, token_len, embedding
