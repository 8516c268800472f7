"""Floating-point operations of the estimator (ConditionalDecoder), counted from its config, B and T.

One multiply-add counts as 2 FLOPs, and only the matrix products are counted: linear layers, convolutions
(regular, strided and transposed) and the two attention products ``q k^T`` and ``p v``. Biases, norms,
activations, softmax and the sinusoidal time embedding are left out; they are a few per cent of the time
on a CPU and under 0.1 % of the FLOPs. That is the convention of ``torch.utils.flop_counter.FlopCounterMode``,
so the two agree exactly on our module (``tests/test_flops.py``), which writes attention as two
``matmul`` calls. FlopCounterMode undercounts a module whose attention goes through the fused CPU
attention kernel (no formula for it): count by config, as here, when reporting GFLOP/s.

Example::

    from s3flow.model.estimator import EstimatorConfig
    from s3flow.model.flops import estimator_flops
    estimator_flops(EstimatorConfig.full(), batch=2, frames=300).total / 1e9   # 99.96 GFLOP

Full-size figures (B = 2, guided): T = 100 / 300 / 600 frames -> 28.75 / 99.96 / 241.19 GFLOP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from s3flow_contract.tensors import TOKEN_MEL_RATIO
from s3flow.model.chunks import solve_frames
from s3flow.model.estimator import EstimatorConfig


@dataclass
class EstimatorFlops:
    """FLOPs of one estimator forward, by kind of product."""
    linear: int = 0          # q/k/v/out projections and feed-forward layers, time MLPs
    attention: int = 0       # q k^T and p v
    conv: int = 0            # causal, 1x1, strided and transposed convolutions

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.conv

    def __add__(self, other: "EstimatorFlops") -> "EstimatorFlops":
        return EstimatorFlops(self.linear + other.linear, self.attention + other.attention, self.conv + other.conv)


def _conv(b: int, t_out: int, c_in: int, c_out: int, k: int) -> int:
    return 2 * b * t_out * c_in * c_out * k


def _linear(rows: int, d_in: int, d_out: int) -> int:
    return 2 * rows * d_in * d_out


def _resnet(f: EstimatorFlops, b: int, t: int, c_in: int, c_out: int, temb: int) -> None:
    f.linear += _linear(b, temb, c_out)                       # time embedding -> channels
    f.conv += _conv(b, t, c_in, c_out, 3) + _conv(b, t, c_out, c_out, 3) + _conv(b, t, c_in, c_out, 1)


def _transformers(f: EstimatorFlops, b: int, t: int, dim: int, cfg: EstimatorConfig, t_k: int | None = None) -> None:
    """``t`` query frames (each projected: q, k, v, out, feed-forward) attending to ``t_k`` keys (default ``t``;
    more: keys and values of frames kept from earlier calls, not projected again)."""
    inner = cfg.num_heads * cfg.attention_head_dim
    t_k = t if t_k is None else t_k
    per_block_linear = (_linear(b * t, dim, inner) * 3 + _linear(b * t, inner, dim)     # q, k, v, out
                        + _linear(b * t, dim, 4 * dim) + _linear(b * t, 4 * dim, dim))  # feed-forward
    per_block_attention = 2 * (2 * b * cfg.num_heads * t * t_k * cfg.attention_head_dim)
    f.linear += cfg.n_blocks * per_block_linear
    f.attention += cfg.n_blocks * per_block_attention


def estimator_flops(config: EstimatorConfig, batch: int, frames: int, key_frames: int | None = None) -> EstimatorFlops:
    """FLOPs of one forward of a ConditionalDecoder built from ``config`` on (batch, n_feats, frames).

    ``batch`` is the estimator's batch: 2 B rows for a guided call on B utterances. Padded frames count
    (the network computes them); attention is full over the padded length. ``key_frames`` (default ``frames``):
    what the ``frames`` queries attend to, when the keys and values of the others are kept from an earlier call
    (a cached prompt or context, issue 50's count): attention grows with queries x keys, everything else with the
    queries.
    """
    if batch < 1 or frames < 1 or (key_frames is not None and key_frames < frames):
        raise ValueError(f"batch and frames must be >= 1 and key_frames >= frames, got {batch}, {frames}, "
                         f"{key_frames}")
    cfg, b = config, int(batch)
    ch, temb = cfg.channels, cfg.time_embed_dim
    f = EstimatorFlops()
    time_mlps = 2 if cfg.meanflow else 1
    f.linear += time_mlps * (_linear(b, cfg.in_channels, temb) + _linear(b, temb, temb))
    if cfg.meanflow:
        f.linear += _linear(b, 2 * temb, temb)                # time_embed_mixer

    # down path: level l runs at t_l frames; all but the last level downsample (stride-2 conv, k 3, pad 1)
    lengths, t, prev = [], int(frames), cfg.in_channels
    t_k = int(key_frames if key_frames is not None else frames)
    for level, c in enumerate(ch):
        lengths.append((t, t_k))
        _resnet(f, b, t, prev, c, temb)
        _transformers(f, b, t, c, cfg, t_k)
        if level == len(ch) - 1:
            f.conv += _conv(b, t, c, c, 3)                    # causal conv
        else:
            t, t_k = (t + 1) // 2, (t_k + 1) // 2             # ceil(t / 2)
            f.conv += _conv(b, t, c, c, 3)                    # Downsample1D
        prev = c
    for _ in range(cfg.num_mid_blocks):
        _resnet(f, b, t, ch[-1], ch[-1], temb)
        _transformers(f, b, t, ch[-1], cfg, t_k)
    # up path: mirror of the down path, skip connections concatenated (2 x channels in)
    up = tuple(ch[::-1]) + (ch[0],)
    for i in range(len(up) - 1):
        c_in, c_out = 2 * up[i], up[i + 1]
        t, t_k = lengths[len(lengths) - 1 - i]
        _resnet(f, b, t, c_in, c_out, temb)
        _transformers(f, b, t, c_out, cfg, t_k)
        if i == len(up) - 2:
            f.conv += _conv(b, t, c_out, c_out, 3)            # causal conv
        else:
            f.conv += _conv(b, t, c_out, c_out, 4)            # Upsample1D: transposed conv, k 4, on t frames in
    t = int(frames)
    f.conv += _conv(b, t, up[-1], up[-1], 3) + _conv(b, t, up[-1], cfg.out_channels, 1)   # final block, proj
    return f


def solve_flops(config: EstimatorConfig, calls: Iterable[tuple[int, int]]) -> int:
    """Total estimator FLOPs over ``calls``, each (batch, frames) of one forward."""
    return sum(estimator_flops(config, b, t).total for b, t in calls)


def chunk_calls(config: EstimatorConfig, prompt_tokens: int, chunks: list[int], steps: int,
                guided: bool) -> list[tuple[int, int]]:
    """The (batch, frames) of every estimator call of one utterance streamed alone in ``chunks``.

    Each chunk re-runs the prefix: T = 2 (prompt + tokens so far), less the 6 lookahead frames until the
    last chunk. One chunk is offline synthesis. A guided call has 2 rows, a meanflow / unguided call 1.
    """
    calls, have = [], 0
    for k, n in enumerate(chunks):
        have += n
        frames = int(solve_frames(torch.tensor([prompt_tokens + have]), TOKEN_MEL_RATIO * prompt_tokens,
                                  k == len(chunks) - 1)[0])
        calls += [(2 if guided and not config.meanflow else 1, frames)] * steps
    return calls
