"""S3TokenizerV2: 16 kHz speech to S3 speech tokens (25 per second, vocabulary 3^8 = 6561).

The network of the ``s3tokenizer`` package that upstream S3Gen holds as ``tokenizer``: a Whisper-like audio
encoder (two stride-2 GELU convolutions, 4x fewer frames than the 100 frames/s log-mel, then pre-norm blocks whose
attention has rotary position embeddings on 64-wide heads and an FSMN memory: a depthwise convolution of width 31
over the values, added to the attention output) and a finite scalar quantiser (Linear to 8 values, tanh, scaled by
0.999, rounded to {-1, 0, 1}, read as a base-3 number).

State-dict names are the checkpoint's under ``tokenizer.`` (``tokenizer.encoder.blocks.3.attn.fsmn_block.weight``,
``tokenizer.quantizer._codebook.project_down.weight``); the key projection has no bias. Only one utterance at a
time and at most 30 s (3000 mel frames): upstream switches to an overlapping-window path beyond that, which the
front-end's length limit keeps out of reach.

Example::

    tok = S3TokenizerV2(TokenizerConfig.small())
    tokens = tok.tokenize(torch.randn(16000) * 0.1)      # (1, 25) int64
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from s3flow.model.voice.mel import tokenizer_log_mel

HEAD_DIM = 64              # the rotary table is built for 64-wide heads
ROTARY_POSITIONS = 2048
FSMN_KERNEL = 31
CODEBOOK_LEVELS = 3
CODEBOOK_DIM = 8
MAX_MEL_FRAMES = 3000      # upstream's one-window limit (30 s at 100 frames/s)


@dataclass
class TokenizerConfig:
    """Encoder sizes; ``full()`` is ``speech_tokenizer_v2_25hz``'s, ``small()`` is for tests."""
    n_mels: int = 128
    n_state: int = 1280
    n_head: int = 20
    n_layer: int = 6

    @classmethod
    def full(cls) -> "TokenizerConfig":
        return cls()

    @classmethod
    def small(cls) -> "TokenizerConfig":
        return cls(n_state=128, n_head=2, n_layer=2)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rotary_tables(positions: int = ROTARY_POSITIONS, dim: int = HEAD_DIM,
                  theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (positions, dim) float32; the dim/2 frequencies are repeated for the two halves."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(positions), freqs).float()
    rot = torch.polar(torch.ones_like(angles), angles)
    cos, sin = rot.real, rot.imag
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, H, D) by position: ``x * cos + [-x_right, x_left] * sin``; cos, sin: (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None] + rotated * sin[None, :, None]


class FSMNAttention(nn.Module):
    """Multi-head self-attention with rotary q/k and an FSMN memory over v (no mask: one utterance)."""

    def __init__(self, n_state: int, n_head: int, kernel_size: int = FSMN_KERNEL):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)
        self.fsmn_block = nn.Conv1d(n_state, n_state, kernel_size, groups=n_state, bias=False)
        self.left_padding = (kernel_size - 1) // 2
        self.right_padding = kernel_size - 1 - self.left_padding

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, n_state) -> (B, T, n_state)."""
        b, t, d = x.shape
        scale = (d // self.n_head) ** -0.25
        q = self.query(x).view(b, t, self.n_head, -1)
        k = self.key(x).view(b, t, self.n_head, -1)
        v = self.value(x).view(b, t, self.n_head, -1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        flat_v = v.reshape(b, t, d)
        memory = self.fsmn_block(F.pad(flat_v.transpose(1, 2), (self.left_padding, self.right_padding)))
        memory = memory.transpose(1, 2) + flat_v
        q = q.permute(0, 2, 1, 3) * scale
        k = k.permute(0, 2, 3, 1) * scale
        w = torch.softmax((q @ k).float(), dim=-1).to(q.dtype)
        wv = (w @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).flatten(start_dim=2)
        return self.out(wv) + memory


class ResidualAttentionBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (GELU, 4x wide).

    Both LayerNorms use eps 1e-5, as the ``s3tokenizer`` release upstream installs (0.3.0) has it; older
    sources of the package had 1e-6 on ``attn_ln``, which moves the hidden states by about 5e-4 relative.
    """

    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.attn = FSMNAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, 4 * n_state), nn.GELU(), nn.Linear(4 * n_state, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), cos, sin)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoderV2(nn.Module):
    """Log-mel (B, n_mels, F) -> hidden states (B, ceil(ceil(F / 2) / 2), n_state)."""

    def __init__(self, config: TokenizerConfig):
        super().__init__()
        if config.n_state != config.n_head * HEAD_DIM:
            raise ValueError(f"n_state must be n_head * {HEAD_DIM}, got {config.n_state} and {config.n_head}")
        self.conv1 = nn.Conv1d(config.n_mels, config.n_state, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(config.n_state, config.n_state, kernel_size=3, stride=2, padding=1)
        self.blocks = nn.ModuleList(ResidualAttentionBlock(config.n_state, config.n_head)
                                    for _ in range(config.n_layer))
        cos, sin = rotary_tables()
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        t = x.shape[1]
        cos, sin = self.rotary_cos[:t], self.rotary_sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


class FSQCodebook(nn.Module):
    """Finite scalar quantiser: 8 values in {0, 1, 2} read as a base-3 index."""

    def __init__(self, dim: int):
        super().__init__()
        self.project_down = nn.Linear(dim, CODEBOOK_DIM)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T) int64 indices < 3^8."""
        h = self.project_down(x.reshape(-1, x.shape[-1])).float().tanh()
        h = (h * 0.9990000128746033).round() + 1
        powers = torch.pow(CODEBOOK_LEVELS, torch.arange(CODEBOOK_DIM, dtype=h.dtype))
        return (h * powers[None]).sum(-1).reshape(x.shape[0], x.shape[1]).long()


class FSQVectorQuantization(nn.Module):
    """Holds the codebook under the checkpoint's name (``quantizer._codebook``)."""

    def __init__(self, dim: int):
        super().__init__()
        self._codebook = FSQCodebook(dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._codebook.encode(x)


class S3TokenizerV2(nn.Module):
    """16 kHz audio to speech tokens; submodule names are the checkpoint's (under ``tokenizer.``)."""

    def __init__(self, config: TokenizerConfig | None = None):
        super().__init__()
        self.config = config or TokenizerConfig.full()
        self.encoder = AudioEncoderV2(self.config)
        self.quantizer = FSQVectorQuantization(self.config.n_state)

    def quantize(self, mel: torch.Tensor) -> torch.Tensor:
        """mel: (B, n_mels, F), F <= 3000 -> tokens (B, ceil(ceil(F / 2) / 2)) int64."""
        if mel.shape[-1] > MAX_MEL_FRAMES:
            raise ValueError(f"the tokenizer takes at most {MAX_MEL_FRAMES} mel frames (30 s), got {mel.shape[-1]}")
        return self.quantizer.encode(self.encoder(mel))

    @torch.no_grad()
    def tokenize(self, wav16: torch.Tensor) -> torch.Tensor:
        """wav16: (n,) float32 at 16 kHz -> (1, ceil(ceil((n // 160) / 2) / 2)) int64 tokens."""
        return self.quantize(tokenizer_log_mel(wav16.reshape(-1))[None])


def num_tokens(num_samples_16k: int) -> int:
    """Tokens the tokenizer yields for ``n`` samples at 16 kHz: two ceil-halvings of ``n // 160`` frames."""
    frames = num_samples_16k // 160
    return -(-(-(-frames // 2)) // 2)
