"""The S3Gen vocoder: HiFTGenerator (neural source filter + iSTFTNet), mel (80 x T) -> 24 kHz audio.

Architecture (upstream ``chatterbox/models/s3gen/hifigan.py`` as ``s3gen.py`` configures it; our code):

* ``f0_predictor``: five weight-normed 3-tap convolutions (80 -> 512 -> ... 512) with ELU, a Linear to one
  value per frame, ``abs``: F0 in Hz per mel frame.
* the source: F0 held over each frame's 480 samples, 9 sines (F0 and 8 overtones, float64 phase), noise
  (``s3flow.model.vocoder_source.harmonic_source``), merged by ``m_source.l_linear`` (9 -> 1) and ``tanh``.
* ``decode``: ``conv_pre`` (80 -> 512, k 7), three upsampling stages (ConvTranspose rates 8, 5, 3, kernels
  16, 11, 7; 256, 128, 64 channels), each fused with the source's STFT (n_fft 16, hop 4) brought down to its
  rate by ``source_downs`` + ``source_resblocks`` and followed by the mean of three Snake ResBlocks (kernels
  3, 7, 11, dilations 1, 3, 5); ``conv_post`` to 18 channels = log-magnitude (9) and phase (9) of an STFT,
  inverted with hop 4: 8 * 5 * 3 * 4 = 480 samples per mel frame; clamped to +-0.99.

State-dict names are the checkpoint's under ``mel2wav.`` (``mel2wav.conv_pre.parametrizations.weight.
original0`` is a weight norm's g, ``original1`` its v: upstream uses ``torch.nn.utils.parametrizations.
weight_norm``). The STFT and its inverse are written as fixed convolutions (plain operators: the
TorchScript ONNX exporter has no ``istft``), checked against ``torch.stft`` / ``torch.istft``.

For serving the vocoder is two stateless networks: ``f0`` (mel -> F0) and ``decoder`` (mel, harmonics ->
audio); the excitation between them, which carries the phase from chunk to chunk, is numpy
(``s3flow.model.vocoder_source``; streamed by ``s3flow.engine.vocoder_stream``). Running them is runtime work
(``s3flow.runtime``): in torch on a device (``torch_vocoder.TorchVocoder``), their ONNX export and offline vocoding
(``vocoder``), ONNX Runtime sessions and the served backend's choice (``vocoder_runner``).

Example::

    from s3flow.model.vocoder import VocoderConfig, random_vocoder
    hift = random_vocoder(VocoderConfig.small(), seed=0)
    audio, f0 = hift.inference(mel, seed=0)   # mel (1, 80, T) -> audio (1, 480 T), f0 (1, T); no fade-in
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from s3flow.model.checkpoint_io import CheckpointMismatch, describe_mismatch, read_tensors, save_tensors
from s3flow.model.vocoder_source import Excitation, SourceParams, harmonic_source

#: Checkpoint prefix of the vocoder in an S3Gen checkpoint.
VOCODER_PREFIX = "mel2wav."
#: safetensors metadata key holding our VocoderConfig (absent from upstream checkpoints).
VOCODER_CONFIG_KEY = "s3flow_vocoder_config"


@dataclass
class VocoderConfig:
    """HiFTGenerator settings; ``full()`` is S3Gen's, ``small()`` keeps every stride, kernel and receptive
    field but narrows the channels (tests)."""
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple = (8, 5, 3)
    upsample_kernel_sizes: tuple = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple = (3, 7, 11)
    resblock_dilation_sizes: tuple = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple = (7, 7, 11)
    source_resblock_dilation_sizes: tuple = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    @classmethod
    def full(cls) -> "VocoderConfig":
        return cls()

    @classmethod
    def small(cls) -> "VocoderConfig":
        return cls(base_channels=32, f0_cond_channels=32)

    @property
    def hop_samples(self) -> int:
        """Audio samples per mel frame (480)."""
        return int(np.prod(self.upsample_rates)) * self.hop_len

    def source_params(self) -> SourceParams:
        return SourceParams(sampling_rate=self.sampling_rate, nb_harmonics=self.nb_harmonics,
                            nsf_alpha=self.nsf_alpha, nsf_sigma=self.nsf_sigma,
                            nsf_voiced_threshold=self.nsf_voiced_threshold, hop_samples=self.hop_samples)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VocoderConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown VocoderConfig fields: {sorted(unknown)}")

        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, (list, tuple)) else v
        return cls(**{k: tup(v) for k, v in d.items()})


# ---------------------------------------------------------------------------------------------------
# Modules


def _padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """``x + sin(alpha x)^2 / alpha`` per channel. x: (B, C, T)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Snake -> dilated conv -> Snake -> conv, residual, once per dilation. x: (B, C, T) -> same."""

    def __init__(self, channels: int, kernel_size: int, dilations):
        super().__init__()
        self.convs1 = nn.ModuleList(weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                                          padding=_padding(kernel_size, d))) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(nn.Conv1d(channels, channels, kernel_size,
                                                          padding=_padding(kernel_size))) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(a2(c1(a1(x))))
        return x


class F0Predictor(nn.Module):
    """ConvRNNF0Predictor: mel (B, in_channels, T) -> F0 (B, T) in Hz (non-negative)."""

    def __init__(self, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        layers = []
        for i in range(5):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3,
                                             padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class F0Float64(nn.Module):
    """The F0 predictor in float64, its convolutions written as matrix products of shifted copies (ONNX
    Runtime has no float64 Conv). mel (B, C, T) float32 -> f0 (B, T) float64.

    Float64 because the source's phase integrates F0: float32 F0 rounds differently for different
    window lengths (1e-4 Hz), which a stream would turn into a phase drift against offline vocoding.
    """

    def __init__(self, predictor: F0Predictor):
        super().__init__()
        convs = [m for m in predictor.condnet if isinstance(m, nn.Conv1d)]
        with torch.no_grad():
            for i, conv in enumerate(convs):
                w = conv.weight.detach().double()                       # (O, C, 3)
                self.register_buffer(f"w{i}", w.permute(0, 2, 1).reshape(w.shape[0], -1).contiguous())
                self.register_buffer(f"b{i}", conv.bias.detach().double()[:, None].clone())
            self.register_buffer("wc", predictor.classifier.weight.detach().double().clone())   # (1, C)
            self.register_buffer("bc", predictor.classifier.bias.detach().double().clone())
        self.layers = len(convs)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.double()
        for i in range(self.layers):
            p = F.pad(x, (1, 1))
            cols = torch.cat([p[:, :, :-2], p[:, :, 1:-1], p[:, :, 2:]], dim=1)         # (B, 3C, T), tap-major
            x = torch.matmul(getattr(self, f"w{i}"), cols) + getattr(self, f"b{i}")
            x = torch.where(x > 0, x, torch.exp(x) - 1.0)                               # ELU
        return (torch.matmul(self.wc, x) + self.bc[:, None])[:, 0].abs()


class SourceMerge(nn.Module):
    """``m_source``: the harmonics (B, H + 1, S) merged into one excitation (B, 1, S) by Linear + tanh."""

    def __init__(self, rows: int):
        super().__init__()
        self.l_linear = nn.Linear(rows, 1)

    def forward(self, harmonics: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l_linear(harmonics.transpose(1, 2))).transpose(1, 2)


def hann_window(n: int) -> torch.Tensor:
    """Periodic Hann window (``scipy.signal.get_window('hann', n, fftbins=True)``), float64."""
    return 0.5 - 0.5 * torch.cos(2 * math.pi * torch.arange(n, dtype=torch.float64) / n)


class ConvSTFT(nn.Module):
    """``torch.stft`` / ``torch.istft`` (Hann window, center=True, onesided) as fixed convolutions.

    ``stft(x (B, S)) -> (B, 2 (n_fft // 2 + 1), S // hop + 1)``: real parts, then imaginary parts.
    ``istft(real, imag (B, n_fft // 2 + 1, F)) -> (B, hop (F - 1))``, overlap-added and divided by the
    window's squared envelope as ``torch.istft`` does.
    """

    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        bins = n_fft // 2 + 1
        n = torch.arange(n_fft, dtype=torch.float64)
        k = torch.arange(bins, dtype=torch.float64)[:, None]
        window = hann_window(n_fft)
        angle = 2 * math.pi * k * n[None, :] / n_fft                           # (bins, n_fft)
        forward = torch.cat([torch.cos(angle), -torch.sin(angle)]) * window    # (2 bins, n_fft)
        scale = torch.full((bins, 1), 2.0, dtype=torch.float64)
        scale[0] = scale[-1] = 1.0                                             # DC and Nyquist count once
        inverse = torch.cat([scale * torch.cos(angle), -scale * torch.sin(angle)]) * window / n_fft
        self.register_buffer("forward_basis", forward[:, None, :].float(), persistent=False)
        self.register_buffer("inverse_basis", inverse[:, None, :].float(), persistent=False)
        self.register_buffer("window_sq", (window ** 2)[None, None, :].float(), persistent=False)

    def stft(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.n_fft // 2
        x = F.pad(x[:, None, :], (pad, pad), mode="reflect")
        return F.conv1d(x, self.forward_basis, stride=self.hop)

    def istft(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        frames = F.conv_transpose1d(torch.cat([real, imag], dim=1), self.inverse_basis, stride=self.hop)
        envelope = F.conv_transpose1d(torch.ones_like(real[:, :1, :]), self.window_sq, stride=self.hop)
        pad = self.n_fft // 2
        # slice before dividing: the envelope is 0 at the outer edges, and 0 / 0 there would turn the
        # gradient of everything into NaN (training), though those samples are dropped
        return frames[:, 0, pad:-pad] / envelope[:, 0, pad:-pad]


class HiFTGenerator(nn.Module):
    """The vocoder; submodule names are the checkpoint's (under ``mel2wav.``)."""

    def __init__(self, config: Optional[VocoderConfig] = None):
        super().__init__()
        c = self.config = config or VocoderConfig.full()
        base = c.base_channels
        self.m_source = SourceMerge(c.nb_harmonics + 1)
        self.conv_pre = weight_norm(nn.Conv1d(c.in_channels, base, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))
        rates = [1] + list(c.upsample_rates[::-1][:-1])
        cum = np.cumprod(rates)[::-1]                 # source STFT rate -> each stage's rate: 15, 3, 1
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(cum, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes)):
            ch, u = base // 2 ** (i + 1), int(u)
            self.source_downs.append(nn.Conv1d(c.n_fft + 2, ch, 1) if u == 1 else
                                     nn.Conv1d(c.n_fft + 2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(c.upsample_rates))
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        self.conv_post = weight_norm(nn.Conv1d(base // 2 ** len(c.upsample_rates), c.n_fft + 2, 7, padding=3))
        self.f0_predictor = F0Predictor(c.in_channels, c.f0_cond_channels)
        self.stft = ConvSTFT(c.n_fft, c.hop_len)

    @property
    def source_params(self) -> SourceParams:
        return self.config.source_params()

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel (B, in_channels, T), source (B, 1, 480 T) -> audio (B, 480 T) in [-0.99, 0.99]."""
        c = self.config
        s_stft = self.stft.stft(source[:, 0])
        x = self.conv_pre(mel)
        kernels = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                xs = xs + self.resblocks[i * kernels + j](x)
            x = xs / kernels
        x = self.conv_post(F.leaky_relu(x))            # upstream: default slope 0.01 here
        bins = c.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])
        audio = self.stft.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return audio.clamp(-c.audio_limit, c.audio_limit)

    def forward(self, mel: torch.Tensor, harmonics: torch.Tensor) -> torch.Tensor:
        """The ``decoder`` graph: mel (B, in_channels, T), harmonics (B, H + 1, 480 T) -> audio (B, 480 T)."""
        return self.decode(mel, self.m_source(harmonics))

    def inference(self, mel: torch.Tensor, seed: int = 0, noise_free: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream ``HiFTGenerator.inference`` with a seeded source: mel (1, C, T) -> audio (1, 480 T), f0.

        Weight norms folded, F0 in float64 (``F0Float64``), the source as the stream makes it
        (``harmonic_source``); no fade-in (``s3flow.runtime.vocoder.vocode`` adds upstream's).

        ``noise_free``: the source without randomness (the overtones' initial phases and all noise 0), computed
        as upstream computes it on CPU (``upstream_harmonics``, F0 from the float32 predictor with its weight
        norms), so the audio is a deterministic function of weights and mel that upstream's own
        ``inference`` run the same way reproduces; ``seed`` is unused then.
        """
        if mel.shape[0] != 1:
            raise ValueError(f"inference takes one utterance, got a batch of {mel.shape[0]}")
        if noise_free:
            with torch.inference_mode():
                m = mel.detach().cpu().float()
                f0 = self.f0_predictor(m)
                return self(m, upstream_harmonics(f0, self.source_params)), f0
        folded = self.folded()
        with torch.inference_mode():
            m = mel.detach().cpu().float()
            f0 = F0Float64(folded.f0_predictor)(m)
            harmonics, _ = harmonic_source(f0[0].numpy(), 0, np.zeros(self.config.nb_harmonics + 1),
                                           Excitation(seed, self.source_params))
            return folded(m, torch.from_numpy(harmonics[None])), f0

    def folded(self) -> "HiFTGenerator":
        """A copy with every weight norm folded into a plain weight ``g v / ||v||`` (computed in float64, so
        the result is the same in any grad mode), for export and fast inference."""
        out = HiFTGenerator(self.config)    # not deepcopy: parametrized copies share (and strip) a class
        out.load_state_dict(self.state_dict())
        with torch.no_grad():
            for module in out.modules():
                if parametrize.is_parametrized(module, "weight"):
                    g = module.parametrizations.weight.original0.double()
                    v = module.parametrizations.weight.original1.double()
                    weight = g * v / torch.linalg.vector_norm(v.flatten(1), dim=1).reshape(g.shape)
                    parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
                    module.weight.copy_(weight.to(module.weight.dtype))
        return out.eval()


def upstream_harmonics(f0: torch.Tensor, params: SourceParams, initial_phase: Optional[torch.Tensor] = None,
                       noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Upstream ``SineGen``'s harmonics, rounded as upstream's CPU torch rounds them.

    F0 is held over each frame's hop samples (nearest upsampling); harmonic i's per-sample increment
    ``f0 (i + 1) / sr`` is float32; its running sum is accumulated in float64 and each partial sum rounded
    to float32 (what torch's CPU ``cumsum`` kernel does for float32; a float32 running sum, as on GPU, drifts
    audibly over seconds); ``% 1`` and ``2 pi`` in float32; ``alpha sin(theta + phi0)`` where voiced, plus
    ``(sigma if voiced else alpha / 3) * noise``. The streaming path's ``harmonic_source`` is float64 all
    through instead (continuable from chunk to chunk); this one is for comparison with upstream.

    Args:
        f0: (B, T) Hz per mel frame.
        params: the source's constants.
        initial_phase: (B, H + 1, 1) radians (upstream draws U(-pi, pi) with the fundamental at 0); None: 0.
        noise: (B, H + 1, hop T) standard normal; None: no noise.

    Returns:
        (B, H + 1, hop T) float32.
    """
    f0_up = f0.float().repeat_interleave(params.hop_samples, dim=-1)[:, None, :]
    overtone = torch.arange(1, params.rows + 1, dtype=torch.float32)[None, :, None]
    increment = f0_up * overtone / params.sampling_rate
    theta = 2 * np.pi * (torch.cumsum(increment.double(), dim=-1).float() % 1)
    if initial_phase is not None:
        theta = theta + initial_phase.float()
    uv = (f0_up > params.nsf_voiced_threshold).float()
    out = params.nsf_alpha * torch.sin(theta) * uv
    if noise is not None:
        out = out + (uv * params.nsf_sigma + (1 - uv) * params.nsf_alpha / 3) * noise.float()
    return out


# ---------------------------------------------------------------------------------------------------
# Seeded random weights


@torch.no_grad()
def perturb_vocoder(hift: HiFTGenerator, seed: int, scale: float = 0.1) -> None:
    """Give every parameter a seeded random value that matters and keep the signal in a sane range.

    Biases get N(0, scale^2), weight-norm gains ``1 + N(0, scale^2)`` times the direction's norm, Snake
    alphas ``1 + N(0, scale^2)``, so a port that dropped a bias, a gain or an alpha changes the output.
    The F0 head and ``conv_post`` are then scaled on a seeded stand-in mel so that F0 spreads over voiced
    and unvoiced values and the inverse STFT sees varying magnitudes and phases (audio that is neither
    clipped nor nearly constant).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen)

    for name, module in hift.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            g = module.parametrizations.weight.original0
            v = module.parametrizations.weight.original1
            norm = torch.linalg.vector_norm(v.flatten(1), dim=1).reshape(g.shape)   # weight_norm's dim 0
            g.copy_(norm * (1.0 + scale * randn(g.shape)))
        if isinstance(module, Snake):
            module.alpha.copy_(1.0 + scale * randn(module.alpha.shape))
        if getattr(module, "bias", None) is not None and isinstance(module.bias, torch.Tensor):
            module.bias.copy_(scale * randn(module.bias.shape))
    # calibrate on a seeded stand-in mel: F0 about 120 +- 100 Hz before |.| (some frames fall below the
    # 10 Hz voicing threshold), conv_post's log-magnitudes and phases spread by about 0.8 around biases
    # that fall with frequency
    mel = -4.0 + 1.5 * randn((1, hift.config.in_channels, 64))
    feats = hift.f0_predictor.condnet(mel).transpose(1, 2)
    f0 = hift.f0_predictor.classifier
    f0.weight.copy_(randn(f0.weight.shape))
    f0.weight.mul_(100.0 / (feats @ f0.weight.T).std())
    f0.bias.fill_(120.0 - (feats @ f0.weight.T).mean().item())
    out = {}
    hook = hift.conv_post.register_forward_hook(lambda m, i, o: out.__setitem__("x", o - m.bias[None, :, None]))
    hift(mel, 0.1 * randn((1, hift.config.nb_harmonics + 1, mel.shape[-1] * hift.config.hop_samples)))
    hook.remove()
    post = hift.conv_post
    post.parametrizations.weight.original0.mul_(0.8 / out["x"].std())
    bins = hift.config.n_fft // 2 + 1
    post.bias[:bins] = -1.0 - 0.3 * torch.arange(bins) + scale * randn(bins)


def random_vocoder(config: Optional[VocoderConfig] = None, seed: int = 0) -> HiFTGenerator:
    """A seeded random HiFTGenerator with every parameter perturbed (see ``perturb_vocoder``)."""
    torch.manual_seed(seed)
    hift = HiFTGenerator(config or VocoderConfig.full())
    perturb_vocoder(hift, seed + 1)
    return hift.eval()


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def vocoder_state_dict(hift: HiFTGenerator) -> dict[str, torch.Tensor]:
    """The module's parameters under their checkpoint names (``mel2wav.*``)."""
    return {VOCODER_PREFIX + k: v for k, v in hift.state_dict().items()}


def _upstream_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept the older weight-norm names (``weight_g`` / ``weight_v``) as the parametrization's."""
    out = {}
    for k, v in state.items():
        if k.endswith(".weight_g"):
            k = k[:-len("weight_g")] + "parametrizations.weight.original0"
        elif k.endswith(".weight_v"):
            k = k[:-len("weight_v")] + "parametrizations.weight.original1"
        out[k] = v
    return out


def load_vocoder_state(hift: HiFTGenerator, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Strict load of ``mel2wav.*`` tensors; raise CheckpointMismatch listing the differences."""
    state = _upstream_names(state)
    expected = vocoder_state_dict(hift)
    message = describe_mismatch(expected, state)
    if message:
        raise CheckpointMismatch(f"{source} does not match the vocoder:\n{message}")
    hift.load_state_dict({k[len(VOCODER_PREFIX):]: v for k, v in state.items()}, strict=True)


def load_vocoder(path: Union[str, Path], config: Optional[VocoderConfig] = None) -> HiFTGenerator:
    """A HiFTGenerator from the ``mel2wav.*`` tensors of an S3Gen checkpoint (or one we wrote).

    The config comes from the argument, the file's metadata, or the full-size upstream config.
    """
    state, meta = read_tensors(path, VOCODER_PREFIX)
    recorded = meta.get(VOCODER_CONFIG_KEY)
    config = config or (VocoderConfig.from_dict(json.loads(recorded)) if recorded else VocoderConfig.full())
    hift = HiFTGenerator(config)
    load_vocoder_state(hift, state, source=str(path))
    return hift.eval()


def write_vocoder_checkpoint(hift: HiFTGenerator, path: Union[str, Path]) -> Path:
    """Save ``mel2wav.*`` (``.safetensors`` with our config in its metadata, or ``.pt``)."""
    state = {k: v.detach().contiguous().clone() for k, v in vocoder_state_dict(hift).items()}
    return save_tensors(state, path, {VOCODER_CONFIG_KEY: json.dumps(hift.config.to_dict())})


def write_random_vocoder_checkpoint(path: Union[str, Path], config: VocoderConfig, seed: int = 0) -> Path:
    return write_vocoder_checkpoint(random_vocoder(config, seed), path)


__all__ = ["VocoderConfig", "HiFTGenerator", "F0Float64", "random_vocoder", "load_vocoder",
           "write_vocoder_checkpoint", "write_random_vocoder_checkpoint", "upstream_harmonics", "VOCODER_PREFIX"]
