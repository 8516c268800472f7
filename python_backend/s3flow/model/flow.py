"""The whole S3Gen flow (tokens -> mel) in process: encoder, conditioning, CFM solver.

This is the eager reference path and the offline synthesis that streamed, served output is compared
against. It builds its solve with ``s3flow.model.chunks`` and integrates with ``solve_cfm``, exactly as the
served streaming engine does (there with the encoder and estimator reached over BLS).

Example::

    from s3flow.model.flow import FlowConfig, S3Flow, synthesize
    flow = S3Flow(FlowConfig.small()).eval()
    out = synthesize(flow, speech_tokens, prompt_tokens, prompt_feat, embedding, seed=0)
    out.mel  # (B, n_feats, max generated frames); out.lengths: (B,)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from s3flow.model.chunks import condition, solve_frames, stack_rows, starting_point
from s3flow.model.encoder import EncoderConfig, FlowEncoder
from s3flow.model.estimator import ConditionalDecoder, EstimatorConfig
from s3flow.model.solver import DEFAULT_GUIDANCE_RATE, EstimatorInputs, FrameNoise, solve_cfm


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


def join_tokens(speech_tokens: torch.Tensor, speech_token_len: torch.Tensor,
                prompt_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompt ++ speech`` per row: (B, Np + N) int64 and lengths (B,). Padding stays at the end."""
    b = speech_tokens.shape[0]
    prompt = prompt_tokens.reshape(1, -1).expand(b, -1).to(torch.int64)
    tokens = torch.cat([prompt, speech_tokens.to(torch.int64)], dim=1)
    return tokens, speech_token_len.to(torch.int64) + prompt.shape[1]


@dataclass
class SynthesisResult:
    """mel: (B, n_feats, max generated frames), zero past each row's length; lengths: (B,); nfe."""
    mel: torch.Tensor
    lengths: torch.Tensor
    nfe: int


class TorchEstimator:
    """Adapter: a torch ConditionalDecoder as a solver estimator (no autograd); it takes a prefix cache."""
    carries_prefix = True

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, inputs: EstimatorInputs):
        with torch.inference_mode():
            if inputs.past is None and inputs.keep is None:
                return self.module(**inputs.named())
            return self.module(**inputs.named(), past=inputs.past, keep=inputs.keep)


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
    mu, _, spks = flow.encoder(tokens, token_len, emb)
    if prompt_feat.shape[0] != 1:
        raise ValueError(f"prompt_feat must hold one prompt shared by every row, (1, Tp, n_feats); got "
                         f"{tuple(prompt_feat.shape)}")
    prompt_mel = prompt_feat[0].T  # (n_feats, Tp)
    tp = prompt_mel.shape[1]
    cond = condition(mu, spks, solve_frames(token_len, tp, finalize), [prompt_mel])
    if z is None:
        seeds = [seed] * b if isinstance(seed, int) else list(seed)
        rows = []
        for s, g in zip(seeds, cond.generated.tolist()):
            noise = FrameNoise(s, flow.config.n_feats)
            rows.append(starting_point(noise, noise.prompt(tp), 0, g))
        z = stack_rows(rows, cond.mu.shape[2])
    elif tuple(z.shape) != tuple(cond.mu.shape):
        raise ValueError(f"z must have shape {tuple(cond.mu.shape)}, got {tuple(z.shape)}")
    est = estimator if estimator is not None else TorchEstimator(flow.estimator)
    result = solve_cfm(est, z.to(cond.mu), cond.mu, cond.mask, cond.spks, cond.cond,
                       meanflow=flow.config.meanflow, n_steps=n_steps, guidance_rate=guidance_rate)
    mel = result.x[:, :, tp:] * cond.mask[:, :, tp:]
    return SynthesisResult(mel=mel, lengths=cond.generated, nfe=result.nfe)
