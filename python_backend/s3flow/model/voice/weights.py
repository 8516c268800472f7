"""The voice front-end's weights in an S3Gen checkpoint: ``tokenizer.*`` and ``speaker_encoder.*``.

A user's ``s3gen.safetensors`` / ``s3gen.pt`` loads with no renaming. The tokenizer's mel filterbank and window
(``tokenizer._mel_filters``, ``tokenizer.window``) are buffers upstream registers but real checkpoints do not
store; they are computed here (``voice.mel``) and ignored when a file has them. Files we write record the sizes
(``VoiceConfig``) in their metadata under ``s3flow_voice_config``; a file without it is full size.

Example::

    state = random_voice_state(VoiceConfig.small(), seed=0)       # {"tokenizer.…": …, "speaker_encoder.…": …}
    tokenizer, speaker = load_voice_modules("s3gen.safetensors")
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from s3flow.model.checkpoint_io import CheckpointMismatch, describe_mismatch, read_tensors
from s3flow.model.voice.campplus import CAMPPlus, CAMPPlusConfig
from s3flow.model.voice.tokenizer import S3TokenizerV2, TokenizerConfig

TOKENIZER_PREFIX = "tokenizer."
SPEAKER_PREFIX = "speaker_encoder."
#: Buffers upstream's tokenizer registers that real checkpoints leave out (computed, never loaded).
UNSTORED_TOKENIZER_KEYS = (TOKENIZER_PREFIX + "_mel_filters", TOKENIZER_PREFIX + "window")
#: safetensors metadata key holding our VoiceConfig (absent from upstream checkpoints: they are full size).
VOICE_CONFIG_KEY = "s3flow_voice_config"


@dataclass
class VoiceConfig:
    """Sizes of the two networks; ``full()`` is S3Gen's."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig.full)
    speaker: CAMPPlusConfig = field(default_factory=CAMPPlusConfig.full)

    @classmethod
    def full(cls) -> "VoiceConfig":
        return cls()

    @classmethod
    def small(cls) -> "VoiceConfig":
        return cls(TokenizerConfig.small(), CAMPPlusConfig.small())

    def to_dict(self) -> dict:
        return {"tokenizer": self.tokenizer.to_dict(), "speaker": self.speaker.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "VoiceConfig":
        speaker = dict(d["speaker"])
        speaker["block_layers"] = tuple(speaker["block_layers"])
        return cls(TokenizerConfig(**d["tokenizer"]), CAMPPlusConfig(**speaker))


def voice_state_dict(tokenizer: S3TokenizerV2, speaker: CAMPPlus) -> dict[str, torch.Tensor]:
    """Both modules' tensors under their checkpoint names."""
    out = {TOKENIZER_PREFIX + k: v for k, v in tokenizer.state_dict().items()}
    out.update({SPEAKER_PREFIX + k: v for k, v in speaker.state_dict().items()})
    return out


@torch.no_grad()
def perturb_voice_modules(modules: list[nn.Module], seed: int, scale: float = 0.1) -> None:
    """Seeded values for every tensor that the default initialisers leave constant.

    Biases and norm shifts get N(0, scale^2), norm scales ``1 + N(0, scale^2)``, BatchNorm running means
    N(0, scale^2) and running variances ``exp(N(0, (2 scale)^2))``, so a port that dropped a bias, a norm
    affine or a running statistic changes the output.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(t):
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)

    for root in modules:
        for module in root.modules():
            if isinstance(module, (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)):
                if getattr(module, "weight", None) is not None:
                    module.weight.copy_(1.0 + scale * randn(module.weight))
                if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                    module.running_mean.copy_(scale * randn(module.running_mean))
                    module.running_var.copy_(torch.exp(2 * scale * randn(module.running_var)))
            if isinstance(getattr(module, "bias", None), torch.Tensor):
                module.bias.copy_(scale * randn(module.bias))


@torch.no_grad()
def calibrate_batchnorm(speaker: CAMPPlus, seed: int, utterances: int = 4, seconds: float = 2.0) -> None:
    """Set every BatchNorm's running statistics to those of seeded stand-in utterances (noise fbank).

    A fresh CAMPPlus in eval mode normalises with mean 0 / variance 1, which its activations do not have, so
    the signal fades over its 50-odd layers and the x-vector hardly depends on the input; with statistics
    measured on audio-like input every layer stays in range and the output follows the input.
    """
    from s3flow.model.voice.kaldi_fbank import fbank

    gen = torch.Generator().manual_seed(seed)
    feats = []
    for _ in range(utterances):
        f = fbank(0.1 * torch.randn(int(16000 * seconds), generator=gen), speaker.config.feat_dim)
        feats.append(f - f.mean(dim=0, keepdim=True))
    norms = [m for m in speaker.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = 1.0
    speaker.train()
    speaker(torch.stack(feats))
    speaker.eval()
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


@torch.no_grad()
def calibrate_quantizer(tokenizer: S3TokenizerV2, seed: int, seconds: float = 4.0) -> None:
    """Scale and centre the quantiser's projection on a seeded stand-in (chirp plus noise) so that each of its
    8 outputs spreads over about +-1 across frames: then the tokens follow the input and use many codes,
    instead of the handful a fresh projection of near-constant hidden states gives."""
    from s3flow.model.voice.mel import tokenizer_log_mel

    gen = torch.Generator().manual_seed(seed)
    n = int(16000 * seconds)
    t = torch.arange(n) / 16000.0
    wav = 0.3 * torch.sin(2 * torch.pi * (100 + 400 * t) * t) * (0.5 + 0.5 * torch.sin(2 * torch.pi * 3 * t))
    wav = wav + 0.05 * torch.randn(n, generator=gen)
    hidden = tokenizer.encoder(tokenizer_log_mel(wav)[None])[0]
    proj = tokenizer.quantizer._codebook.project_down
    h = proj(hidden)
    scale = 1.0 / h.std(dim=0).clamp_min(1e-6)
    proj.weight.mul_(scale[:, None])
    proj.bias.copy_((proj.bias - h.mean(dim=0)) * scale)


def random_voice_modules(config: VoiceConfig, seed: int = 0) -> tuple[S3TokenizerV2, CAMPPlus]:
    """Seeded random tokenizer and speaker encoder: every parameter perturbed (``perturb_voice_modules``),
    then the speaker encoder's BatchNorm statistics measured on stand-in input and perturbed again."""
    torch.manual_seed(seed)
    tokenizer, speaker = S3TokenizerV2(config.tokenizer), CAMPPlus(config.speaker)
    perturb_voice_modules([tokenizer, speaker], seed + 1)
    calibrate_batchnorm(speaker, seed + 2)
    calibrate_quantizer(tokenizer, seed + 4)
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for m in speaker.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                std = m.running_var.sqrt()
                m.running_mean.add_(0.1 * std * torch.randn(std.shape, generator=gen))
                m.running_var.mul_(torch.exp(0.2 * torch.randn(std.shape, generator=gen)))
    return tokenizer.eval(), speaker.eval()


def random_voice_state(config: VoiceConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of ``random_voice_modules`` (contiguous copies, ready to save)."""
    tokenizer, speaker = random_voice_modules(config, seed)
    return {k: v.detach().contiguous().clone() for k, v in voice_state_dict(tokenizer, speaker).items()}


def read_voice_tensors(path: Union[str, Path]) -> tuple[dict[str, torch.Tensor], Optional[VoiceConfig]]:
    """The ``tokenizer.*`` and ``speaker_encoder.*`` tensors of a checkpoint and its recorded VoiceConfig."""
    state, meta = read_tensors(path, TOKENIZER_PREFIX)
    try:
        speaker, _ = read_tensors(path, SPEAKER_PREFIX)
    except CheckpointMismatch as e:
        raise CheckpointMismatch(f"{path}: no '{SPEAKER_PREFIX}*' tensors found; the voice front-end needs "
                                 "the speaker encoder of an S3Gen checkpoint") from e
    state.update(speaker)
    recorded = meta.get(VOICE_CONFIG_KEY)
    return state, (VoiceConfig.from_dict(json.loads(recorded)) if recorded else None)


def load_voice_state(tokenizer: S3TokenizerV2, speaker: CAMPPlus, state: dict[str, torch.Tensor],
                     source: str = "checkpoint") -> None:
    """Strict load (the unstored tokenizer buffers aside); raise CheckpointMismatch listing differences."""
    state = {k: v for k, v in state.items() if k not in UNSTORED_TOKENIZER_KEYS}
    message = describe_mismatch(voice_state_dict(tokenizer, speaker), state)
    if message:
        raise CheckpointMismatch(f"{source} does not match the voice front-end:\n{message}")
    tokenizer.load_state_dict({k[len(TOKENIZER_PREFIX):]: v for k, v in state.items()
                               if k.startswith(TOKENIZER_PREFIX)}, strict=True)
    speaker.load_state_dict({k[len(SPEAKER_PREFIX):]: v for k, v in state.items()
                             if k.startswith(SPEAKER_PREFIX)}, strict=True)


def load_voice_modules(path: Union[str, Path], config: Optional[VoiceConfig] = None
                       ) -> tuple[S3TokenizerV2, CAMPPlus]:
    """Tokenizer and speaker encoder from a checkpoint; the config comes from the argument, the file's
    metadata, or the full-size upstream config."""
    state, recorded = read_voice_tensors(path)
    config = config or recorded or VoiceConfig.full()
    tokenizer, speaker = S3TokenizerV2(config.tokenizer), CAMPPlus(config.speaker)
    load_voice_state(tokenizer, speaker, state, source=str(path))
    return tokenizer.eval(), speaker.eval()
