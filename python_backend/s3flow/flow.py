"""The whole S3Gen flow (tokens -> mel) in process: encoder, conditioning, CFM solver.

This is the eager reference path and the offline synthesis that streamed, served output is compared
against. The served path (Triton ``cfm_solver``) uses the same ``build_condition`` and ``solve_cfm``
with the encoder and estimator reached over BLS.

Example::

    from s3flow import FlowConfig, S3Flow, synthesize
    flow = S3Flow(FlowConfig.small()).eval()
    out = synthesize(flow, speech_tokens, prompt_tokens, prompt_feat, embedding, seed=0)
    out.mel  # (B, n_feats, max generated frames); out.lengths: (B,)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import nn

from .encoder import EncoderConfig, FlowEncoder
from .estimator import ConditionalDecoder, EstimatorConfig
from .solver import DEFAULT_GUIDANCE_RATE, FrameNoise, solve_cfm

#: Mel frames per speech token (25 tokens/s -> 50 frames/s).
TOKEN_MEL_RATIO = 2
#: Tokens the encoder's pre-lookahead layer needs after a frame before the frame is valid.
PRE_LOOKAHEAD_TOKENS = 3


@dataclass
class FlowConfig:
    """Sizes of the encoder and the estimator; ``meanflow`` marks a distilled (Turbo) checkpoint."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig.full)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig.full)

    @classmethod
    def full(cls, meanflow: bool = False) -> "FlowConfig":
        return cls(EncoderConfig.full(), EstimatorConfig.full(meanflow=meanflow))

    @classmethod
    def small(cls, meanflow: bool = False) -> "FlowConfig":
        return cls(EncoderConfig.small(), EstimatorConfig.small(meanflow=meanflow))

    @property
    def meanflow(self) -> bool:
        return self.estimator.meanflow

    @property
    def n_feats(self) -> int:
        return self.estimator.out_channels

    @property
    def lookahead_frames(self) -> int:
        return PRE_LOOKAHEAD_TOKENS * TOKEN_MEL_RATIO

    def to_dict(self) -> dict:
        return {"encoder": dataclasses.asdict(self.encoder), "estimator": dataclasses.asdict(self.estimator)}

    @classmethod
    def from_dict(cls, d: dict) -> "FlowConfig":
        def build(kind, values):
            names = {f.name for f in dataclasses.fields(kind)}
            unknown = set(values) - names
            if unknown:
                raise ValueError(f"unknown {kind.__name__} fields in checkpoint config: {sorted(unknown)}")
            return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        return cls(build(EncoderConfig, d["encoder"]), build(EstimatorConfig, d["estimator"]))


class S3Flow(nn.Module):
    """The flow module's two networks: ``encoder`` (tokens -> mu, mask, spks) and ``estimator``."""

    def __init__(self, config: FlowConfig):
        super().__init__()
        self.config = config
        self.encoder = FlowEncoder(config.encoder)
        self.estimator = ConditionalDecoder(config.estimator)


@dataclass
class Condition:
    """What the solver needs for one padded batch of utterances.

    mu, cond: (B, n_feats, T); mask: (B, 1, T); spks: (B, n_feats); lengths: (B,) valid frames per row
    (prompt included); prompt_frames: frames of the prompt region at the start of every row.
    """
    mu: torch.Tensor
    mask: torch.Tensor
    spks: torch.Tensor
    cond: torch.Tensor
    lengths: torch.Tensor
    prompt_frames: int

    @property
    def generated(self) -> torch.Tensor:
        """(B,) generated (non-prompt) frames per row."""
        return (self.lengths - self.prompt_frames).clamp(min=0)


def join_tokens(speech_tokens: torch.Tensor, speech_token_len: torch.Tensor,
                prompt_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompt ++ speech`` per row: (B, Np + N) int64 and lengths (B,). Padding stays at the end."""
    b = speech_tokens.shape[0]
    prompt = prompt_tokens.reshape(1, -1).expand(b, -1).to(torch.int64)
    tokens = torch.cat([prompt, speech_tokens.to(torch.int64)], dim=1)
    return tokens, speech_token_len.to(torch.int64) + prompt.shape[1]


def build_condition(mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, token_len: torch.Tensor,
                    prompt_feat: torch.Tensor, *, finalize: bool,
                    lookahead_frames: int = PRE_LOOKAHEAD_TOKENS * TOKEN_MEL_RATIO) -> Condition:
    """Turn encoder output into solver inputs.

    Args:
        mu: (B, n_feats, T_enc) encoder output for prompt + speech tokens; mask: (B, 1, T_enc).
        spks: (B, n_feats) projected speaker embedding.
        token_len: (B,) prompt + speech tokens per row.
        prompt_feat: (1 or B, n_feats, Tp) prompt mel, channels-major.
        finalize: False while more tokens will come: the last ``lookahead_frames`` frames of each row
            are not valid yet and are dropped, and the mask is built from the trimmed length (the
            reference builds it from the untrimmed one and crashes).
    """
    n_feats, tp = prompt_feat.shape[1], prompt_feat.shape[2]
    lengths = token_len.to(torch.int64) * TOKEN_MEL_RATIO
    if not finalize:
        lengths = (lengths - lookahead_frames).clamp(min=tp)
    t = int(lengths.max())
    frame_mask = (torch.arange(t, device=mu.device)[None, :] < lengths[:, None]).to(mu.dtype)
    frame_mask = frame_mask[:, None, :]
    mu = mu[:, :, :t] * frame_mask
    cond = torch.zeros(mu.shape[0], n_feats, t, dtype=mu.dtype, device=mu.device)
    cond[:, :, :tp] = prompt_feat.to(mu.dtype)
    return Condition(mu=mu.contiguous(), mask=frame_mask, spks=spks, cond=cond, lengths=lengths,
                     prompt_frames=tp)


def noise_for(cond: Condition, seeds: list[int]) -> torch.Tensor:
    """(B, n_feats, T) initial noise from ``FrameNoise``: a function of (seed, frame) per row."""
    b, c, t = cond.mu.shape
    z = torch.zeros(b, c, t)
    for i, seed in enumerate(seeds):
        gen = int(cond.generated[i])
        z[i, :, :cond.prompt_frames + gen] = torch.from_numpy(
            FrameNoise(seed, c).full(cond.prompt_frames, gen))
    return z.to(cond.mu.dtype)


@dataclass
class SynthesisResult:
    """mel: (B, n_feats, max generated frames), zero past each row's length; lengths: (B,); nfe."""
    mel: torch.Tensor
    lengths: torch.Tensor
    nfe: int


class TorchEstimator:
    """Adapter: a torch ConditionalDecoder as a solver estimator (no autograd)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x, mask, mu, t, spks, cond, r=None):
        with torch.inference_mode():
            return self.module(x, mask, mu, t, spks, cond, r)


@torch.inference_mode()
def synthesize(flow: S3Flow, speech_tokens: torch.Tensor, prompt_tokens: torch.Tensor,
               prompt_feat: torch.Tensor, embedding: torch.Tensor, *,
               speech_token_len: Optional[torch.Tensor] = None, finalize: bool = True,
               z: Optional[torch.Tensor] = None, seed: int | list[int] = 0,
               n_steps: Optional[int] = None, guidance_rate: float = DEFAULT_GUIDANCE_RATE,
               estimator=None) -> SynthesisResult:
    """Offline synthesis of a padded batch of utterances sharing one speaker prompt.

    Args:
        speech_tokens: (B, N) int64, rows padded at the end; speech_token_len: (B,) (default all N).
        prompt_tokens: (1, Np) int64; prompt_feat: (1, 2 * Np, n_feats) float32, frames-major.
        embedding: (1 or B, 192) speaker x-vector.
        z: (B, n_feats, T) the whole initial noise, prompt region included (T = 2 (Np + N), minus 6
            when not finalised); default: ``FrameNoise`` of ``seed`` (one seed or one per row).
        estimator: the estimator callable (default: the torch module in ``flow``).
    """
    b = speech_tokens.shape[0]
    if speech_token_len is None:
        speech_token_len = torch.full((b,), speech_tokens.shape[1], dtype=torch.int64)
    tokens, token_len = join_tokens(speech_tokens, speech_token_len, prompt_tokens)
    emb = embedding.reshape(-1, embedding.shape[-1]).expand(b, -1).float()
    mu, mask, spks = flow.encoder(tokens, token_len, emb)
    cond = build_condition(mu, mask, spks, token_len, prompt_feat.transpose(1, 2), finalize=finalize,
                           lookahead_frames=flow.config.lookahead_frames)
    if z is None:
        seeds = [seed] * b if isinstance(seed, int) else list(seed)
        z = noise_for(cond, seeds)
    elif tuple(z.shape) != tuple(cond.mu.shape):
        raise ValueError(f"z must have shape {tuple(cond.mu.shape)}, got {tuple(z.shape)}")
    est = estimator if estimator is not None else TorchEstimator(flow.estimator)
    result = solve_cfm(est, z.to(cond.mu.dtype), cond.mu, cond.mask, cond.spks, cond.cond,
                       meanflow=flow.config.meanflow, n_steps=n_steps, guidance_rate=guidance_rate)
    tp = cond.prompt_frames
    mel = result.x[:, :, tp:] * cond.mask[:, :, tp:]
    return SynthesisResult(mel=mel, lengths=cond.generated, nfe=result.nfe)
