"""One chunk pipeline: how a solve's condition, lengths, mask and starting point are built.

Offline synthesis (``flow.synthesize``) and the served streaming engine (``streaming.StreamingEngine``) both
build every solve here, so they cannot drift apart. A *solve* covers, per row:

* a conditioning **prefix**: the speaker prompt and, in bounded-context streaming, the last frames already
  emitted. Its tokens lead the encoder input, its mel fills ``cond`` (zeros after), as S3Gen was trained;
* the **frames to generate**: two per token (``TOKEN_MEL_RATIO``), less the last ``LOOKAHEAD_FRAMES`` while
  more tokens will come (the encoder's pre-lookahead has not seen their right context yet).

The starting point of the ODE is the prefix's own noise, then, for generated frames, ``noised_mels`` (the
starting point of frames made before, carried from chunk to chunk and pinned) and fresh ``FrameNoise``
beyond it. ``FrameNoise`` is a function of (seed, frame index) only, so every path starts every frame
from the same value.

Example::

    lengths = solve_frames(token_len, prefix_frames, finalize=False)
    cond = condition(mu, spks, lengths, [prompt_mel])            # Condition: mu, mask, spks, cond
    z0 = starting_point(FrameNoise(0, 80), prompt_noise, 0, 44)    # (80, Tp + 44)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from s3flow_contract.tensors import LOOKAHEAD_FRAMES, TOKEN_MEL_RATIO
from s3flow.model.solver import FrameNoise


@dataclass
class Condition:
    """What the solver needs for one padded batch of rows.

    mu, cond: (B, n_feats, T); mask: (B, 1, T); spks: (B, n_feats); lengths: (B,) valid frames per row
    (prefix included); prefix_frames: (B,) frames of the conditioning prefix at the start of each row.
    """
    mu: torch.Tensor
    mask: torch.Tensor
    spks: torch.Tensor
    cond: torch.Tensor
    lengths: torch.Tensor
    prefix_frames: torch.Tensor

    @property
    def generated(self) -> torch.Tensor:
        """(B,) generated (non-prefix) frames per row."""
        return (self.lengths - self.prefix_frames).clamp(min=0)


def solve_frames(token_len: torch.Tensor, prefix_frames: torch.Tensor, finalize) -> torch.Tensor:
    """(B,) valid frames of each row's solve: 2 per token, less ``LOOKAHEAD_FRAMES`` unless finalised
    (never below the prefix).

    Args:
        token_len: (B,) encoder tokens per row (prefix tokens included).
        prefix_frames: (B,) or scalar, frames of the conditioning prefix.
        finalize: bool, or (B,) bool: the row's last tokens have arrived.
    """
    lengths = token_len.to(torch.int64) * TOKEN_MEL_RATIO
    prefix = torch.as_tensor(prefix_frames, dtype=torch.int64, device=lengths.device).expand_as(lengths)
    trimmed = torch.maximum(lengths - LOOKAHEAD_FRAMES, prefix)
    return torch.where(torch.as_tensor(finalize, device=lengths.device).expand_as(lengths), lengths, trimmed)


def condition(mu: torch.Tensor, spks: torch.Tensor, lengths: torch.Tensor,
              prefix_mels: Sequence[torch.Tensor | np.ndarray]) -> Condition:
    """Turn encoder output into solver inputs.

    Args:
        mu: (B, n_feats, T_enc) encoder output over each row's tokens (T_enc >= max(lengths)).
        spks: (B, n_feats) projected speaker embedding.
        lengths: (B,) valid frames per row (``solve_frames``): the mask is built from these, after the
            lookahead trim (the reference builds it from the untrimmed length and crashes).
        prefix_mels: one (n_feats, P_i) conditioning mel per row (or one shared by every row), channels-major.
    """
    b, n_feats = mu.shape[0], mu.shape[1]
    lengths = lengths.to(torch.int64)
    t = int(lengths.max())
    mask = (torch.arange(t, device=mu.device)[None, :] < lengths.to(mu.device)[:, None]).to(mu.dtype)[:, None, :]
    mu = mu[:, :, :t] * mask
    cond = torch.zeros(b, n_feats, t, dtype=mu.dtype, device=mu.device)
    if len(prefix_mels) == 1 and b > 1:
        prefix_mels = list(prefix_mels) * b
    for i, p in enumerate(prefix_mels):
        cond[i, :, :p.shape[1]] = torch.as_tensor(p).to(mu.dtype)
    prefix = torch.tensor([p.shape[1] for p in prefix_mels], dtype=torch.int64, device=lengths.device)
    return Condition(mu=mu.contiguous(), mask=mask, spks=spks, cond=cond, lengths=lengths, prefix_frames=prefix)


@dataclass
class NoisedMels:
    """``noised_mels``: the ODE starting point of generated frames [start, start + values.shape[1])
    made by earlier chunks, (n_feats, F) float32."""
    values: np.ndarray
    start: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.values.shape[1]


def starting_point(noise: FrameNoise, prefix_noise: np.ndarray, lo: int, hi: int,
                   carried: Optional[NoisedMels] = None) -> np.ndarray:
    """(n_feats, P + hi - lo): the prefix's noise, then generated frames [lo, hi): ``carried`` values
    where they cover a frame (pinned), fresh ``noise.frames`` beyond.

    A carried block must start at or before ``lo`` (frames before a solve's window are never re-solved).
    """
    if carried is not None and carried.start > lo:
        raise ValueError(f"noised_mels start at frame {carried.start}, after the solve's first frame {lo}")
    parts = [prefix_noise]
    have = lo if carried is None else min(max(carried.stop, lo), hi)
    if carried is not None and have > lo:
        parts.append(carried.values[:, lo - carried.start:have - carried.start])
    if hi > have:
        parts.append(noise.frames(have, hi))
    return np.concatenate(parts, axis=1).astype(np.float32, copy=False)


def stack_rows(rows: Sequence[np.ndarray], frames: int) -> torch.Tensor:
    """(B, n_feats, frames) float32 from per-row (n_feats, F_i) arrays, zero-padded at the end."""
    out = torch.zeros(len(rows), rows[0].shape[0], frames)
    for i, r in enumerate(rows):
        out[i, :, :r.shape[1]] = torch.from_numpy(np.ascontiguousarray(r[:, :frames]))
    return out
