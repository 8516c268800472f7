"""HiFT's discriminators, narrowed for the small vocoder, and the adversarial losses they are trained with.

Two families judge 24 kHz audio (B, S), each a list of sub-discriminators that return a ``Judgement``: a
score map (real near 1, generated near 0: least squares) and the feature maps of every layer.

* ``MultiPeriodDiscriminator`` (HiFi-GAN's MPD): for each period p (2, 3, 5, 7, 11) the audio is folded into
  (S / p, p) and judged by 2-D convolutions that run along time only (kernel (5, 1), stride 3), so each
  sub-discriminator sees the samples p apart: the periodic structure of voiced speech.
* ``MultiResolutionSpecDiscriminator`` (UnivNet's, as CosyVoice's HiFT training uses it): the STFT magnitude
  (B, 1, frames, bins) at three (n_fft, hop, window) resolutions, judged by 2-D convolutions (kernel (3, 9),
  frequency stride 2).

``DiscriminatorConfig`` holds the widths. HiFi-GAN's MPD has 32, 128, 512, 1024, 1024 channels (41 M
parameters for five periods) and CosyVoice's spectral discriminators 32: the defaults narrow the MPD to
16, 32, 64, 128, 128 and the spectral discriminators to 16 channels (0.76 M parameters in all), for a
0.56 M-parameter generator trained on 2 CPU cores. Weight norm on every convolution, as in HiFi-GAN.

Losses (HiFi-GAN / CosyVoice ``hifigan.py``), each summed over sub-discriminators:

* ``discriminator_loss``: mean (1 - D(real))^2 + mean D(fake)^2;
* ``generator_adversarial_loss``: mean (1 - D(fake))^2;
* ``feature_matching_loss``: mean |features(real) - features(fake)| summed over layers (HiFi-GAN weighs it 2);
* ``tpr_loss``: CosyVoice's truncated pointwise relativistic loss: of the score gaps (upper - lower) below
  their median, the mean squared distance to that median, capped at ``tau``.

Example::

    judges = Discriminators(DiscriminatorConfig())
    real, fake = judges(audio), judges(generated.detach())
    loss_d = discriminator_loss(real, fake) + tpr_loss(scores(real), scores(fake))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

LRELU_SLOPE = 0.1


@dataclass(frozen=True)
class DiscriminatorConfig:
    """Widths of the two discriminator families (defaults: the small vocoder's)."""
    periods: tuple[int, ...] = (2, 3, 5, 7, 11)
    #: MPD channels: four stride-3 layers, then one stride-1 layer (HiFi-GAN: 32, 128, 512, 1024, 1024).
    period_channels: tuple[int, ...] = (16, 32, 64, 128, 128)
    #: (n_fft, hop, window) of each spectral discriminator (UnivNet's and CosyVoice's).
    resolutions: tuple[tuple[int, int, int], ...] = ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))
    #: Channels of every spectral discriminator layer (CosyVoice: 32).
    spec_channels: int = 16


class Judgement(NamedTuple):
    """One sub-discriminator's verdict on a batch."""
    score: torch.Tensor                 # (B, N): one score per patch, flattened
    features: list[torch.Tensor]        # every layer's output, the score map last


def convolved(convs: nn.ModuleList, post: nn.Module, x: torch.Tensor) -> Judgement:
    """A discriminator's stack over its input ``x`` (B, 1, H, W): each conv then a leaky ReLU, the last conv
    without one; every layer's output kept (feature matching), the last flattened into the score."""
    features = []
    for conv in convs:
        x = F.leaky_relu(conv(x), LRELU_SLOPE)
        features.append(x)
    x = post(x)
    features.append(x)
    return Judgement(torch.flatten(x, 1), features)


class PeriodDiscriminator(nn.Module):
    """HiFi-GAN's ``DiscriminatorP``: audio folded by ``period``, judged along time."""

    def __init__(self, period: int, channels: Sequence[int]):
        super().__init__()
        self.period = period
        widths = [1, *channels]
        strides = [3] * (len(channels) - 1) + [1]
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv2d(c_in, c_out, (5, 1), (stride, 1), padding=(2, 0)))
            for c_in, c_out, stride in zip(widths[:-1], widths[1:], strides))
        self.conv_post = weight_norm(nn.Conv2d(widths[-1], 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, audio: torch.Tensor) -> Judgement:
        """audio: (B, S) -> Judgement with score (B, N)."""
        batch, samples = audio.shape
        pad = (-samples) % self.period
        x = F.pad(audio[:, None], (0, pad), mode="reflect") if pad else audio[:, None]
        return convolved(self.convs, self.conv_post, x.view(batch, 1, (samples + pad) // self.period, self.period))


class SpecDiscriminator(nn.Module):
    """UnivNet's / CosyVoice's ``SpecDiscriminator``: the STFT magnitude judged by 2-D convolutions."""

    def __init__(self, n_fft: int, hop: int, window: int, channels: int):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(window), persistent=False)
        widths = [1] + [channels] * 5
        kernels = [(3, 9)] * 4 + [(3, 3)]
        strides = [(1, 1)] + [(1, 2)] * 3 + [(1, 1)]
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv2d(c_in, c_out, k, s, padding=(k[0] // 2, k[1] // 2)))
            for c_in, c_out, k, s in zip(widths[:-1], widths[1:], kernels, strides))
        self.conv_post = weight_norm(nn.Conv2d(channels, 1, 3, 1, padding=1))

    def magnitude(self, audio: torch.Tensor) -> torch.Tensor:
        """audio (B, S) -> |STFT| (B, 1, frames, n_fft // 2 + 1)."""
        spec = torch.stft(audio, self.n_fft, self.hop, self.window.shape[0], self.window, return_complex=True)
        # |.| through sqrt(re^2 + im^2 + eps): abs has no gradient at 0 (digital silence)
        return torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9).transpose(1, 2)[:, None]

    def forward(self, audio: torch.Tensor) -> Judgement:
        return convolved(self.convs, self.conv_post, self.magnitude(audio))


class MultiPeriodDiscriminator(nn.Module):
    """One ``PeriodDiscriminator`` per period."""

    def __init__(self, config: DiscriminatorConfig):
        super().__init__()
        self.discriminators = nn.ModuleList(PeriodDiscriminator(p, config.period_channels) for p in config.periods)

    def forward(self, audio: torch.Tensor) -> list[Judgement]:
        return [d(audio) for d in self.discriminators]


class MultiResolutionSpecDiscriminator(nn.Module):
    """One ``SpecDiscriminator`` per (n_fft, hop, window) resolution."""

    def __init__(self, config: DiscriminatorConfig):
        super().__init__()
        self.discriminators = nn.ModuleList(SpecDiscriminator(n, h, w, config.spec_channels)
                                            for n, h, w in config.resolutions)

    def forward(self, audio: torch.Tensor) -> list[Judgement]:
        return [d(audio) for d in self.discriminators]


class Discriminators(nn.Module):
    """Both families: ``judges(audio (B, S))`` -> the MPD's judgements, then the spectral ones."""

    def __init__(self, config: DiscriminatorConfig = DiscriminatorConfig()):
        super().__init__()
        self.config = config
        self.mpd = MultiPeriodDiscriminator(config)
        self.mrd = MultiResolutionSpecDiscriminator(config)

    def forward(self, audio: torch.Tensor) -> list[Judgement]:
        return self.mpd(audio) + self.mrd(audio)


# ---------------------------------------------------------------------------------------------------
# Losses


def scores(judgements: Sequence[Judgement]) -> list[torch.Tensor]:
    return [j.score for j in judgements]


def discriminator_loss(real: Sequence[Judgement], fake: Sequence[Judgement]) -> torch.Tensor:
    """LSGAN: sum over sub-discriminators of mean (1 - D(real))^2 + mean D(fake)^2."""
    return sum(((1 - r.score) ** 2).mean() + (f.score ** 2).mean() for r, f in zip(real, fake))


def generator_adversarial_loss(fake: Sequence[Judgement]) -> torch.Tensor:
    """LSGAN: sum over sub-discriminators of mean (1 - D(fake))^2."""
    return sum(((1 - f.score) ** 2).mean() for f in fake)


def feature_matching_loss(real: Sequence[Judgement], fake: Sequence[Judgement]) -> torch.Tensor:
    """Sum over sub-discriminators and layers of mean |features(real) - features(fake)| (real held fixed)."""
    return sum((r_map.detach() - f_map).abs().mean()
               for r, f in zip(real, fake) for r_map, f_map in zip(r.features, f.features))


def tpr_loss(upper: Sequence[torch.Tensor], lower: Sequence[torch.Tensor], tau: float = 0.04) -> torch.Tensor:
    """CosyVoice's truncated pointwise relativistic loss over score maps (B, N) of the same shapes.

    Per sub-discriminator: the gaps g = upper - lower, their median m; of the gaps below it, the mean of
    (g - m)^2, capped at ``tau``; summed. The discriminator minimises it with (real, fake), the generator
    with (fake, real).
    """
    total = upper[0].new_zeros(())
    for u, l in zip(upper, lower):
        gap = u - l
        m = gap.median()
        below = gap < m
        if below.any():
            spread = ((gap - m)[below] ** 2).mean()
            total = total + tau - F.relu(tau - spread)
    return total


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
