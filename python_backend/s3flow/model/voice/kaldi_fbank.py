"""Kaldi log-mel filterbank features, numerically torchaudio's ``compliance.kaldi.fbank`` as CAMPPlus uses it.

Upstream's speaker encoder calls ``Kaldi.fbank(wav, num_mel_bins=80)`` on 16 kHz samples in [-1, 1] with every
other option at its default: dither 0, 25 ms frames every 10 ms with ``snip_edges`` (only whole frames), per-frame
DC removal, pre-emphasis 0.97, the "povey" window (Hann ** 0.85), zero padding to 512 for the FFT, power
spectrum, 80 triangular bins on Kaldi's mel scale (``1127 ln(1 + f / 700)``) from 20 Hz to Nyquist, and
``log(max(energy, float32 eps))``. The filterbank is built in float32 with the same operations as torchaudio's,
so the features agree to float32 rounding.

Example::

    from s3flow.model.voice.kaldi_fbank import fbank
    feats = fbank(torch.randn(16000) * 0.1)     # (98, 80)
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

FRAME_LENGTH_MS = 25.0
FRAME_SHIFT_MS = 10.0
PREEMPHASIS = 0.97
LOW_FREQ = 20.0
POVEY_POWER = 0.85
EPSILON = torch.finfo(torch.float32).eps


def mel_scale(freq: float) -> float:
    """Kaldi's mel scale: ``1127 ln(1 + f / 700)``."""
    return 1127.0 * math.log(1.0 + freq / 700.0)


@lru_cache(maxsize=8)
def mel_banks(num_bins: int, padded_window: int, sample_frequency: float, low_freq: float = LOW_FREQ,
              high_freq: float = 0.0) -> torch.Tensor:
    """Triangular filters (num_bins, padded_window // 2 + 1) float32, the last (Nyquist) column zero.

    ``high_freq <= 0`` is an offset from Nyquist, as in Kaldi.
    """
    if num_bins <= 3:
        raise ValueError(f"need more than 3 mel bins, got {num_bins}")
    nyquist = 0.5 * sample_frequency
    if high_freq <= 0.0:
        high_freq += nyquist
    if not (0.0 <= low_freq < nyquist and 0.0 < high_freq <= nyquist and low_freq < high_freq):
        raise ValueError(f"bad mel range: low {low_freq}, high {high_freq}, nyquist {nyquist}")
    bin_width = sample_frequency / padded_window
    mel_low, mel_high = mel_scale(low_freq), mel_scale(high_freq)
    delta = (mel_high - mel_low) / (num_bins + 1)
    b = torch.arange(num_bins).unsqueeze(1)                         # int64: the products below are float32
    left = mel_low + b * delta
    center = mel_low + (b + 1.0) * delta
    right = mel_low + (b + 2.0) * delta
    mel = 1127.0 * (1.0 + bin_width * torch.arange(padded_window / 2) / 700.0).log()
    mel = mel.unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down))
    return torch.nn.functional.pad(banks, (0, 1))


@lru_cache(maxsize=4)
def povey_window(size: int) -> torch.Tensor:
    """Kaldi's default window: a symmetric Hann window to the power 0.85 (zero at both ends)."""
    return torch.hann_window(size, periodic=False, dtype=torch.float32).pow(POVEY_POWER)


def num_frames(num_samples: int, sample_frequency: float = 16000.0) -> int:
    """Whole 25 ms frames every 10 ms (``snip_edges``): ``1 + (n - 400) // 160`` at 16 kHz, 0 if shorter."""
    size = int(sample_frequency * FRAME_LENGTH_MS * 0.001)
    shift = int(sample_frequency * FRAME_SHIFT_MS * 0.001)
    return 0 if num_samples < size else 1 + (num_samples - size) // shift


def fbank(waveform: torch.Tensor, num_mel_bins: int = 80, sample_frequency: float = 16000.0) -> torch.Tensor:
    """Log mel filterbank energies of one mono waveform.

    Args:
        waveform: (n,) float32 samples in [-1, 1] (no 16-bit scaling, as upstream calls it).
        num_mel_bins: Number of triangular filters.
        sample_frequency: Sample rate of ``waveform`` in Hz.

    Returns:
        (num_frames, num_mel_bins) float32, ``num_frames = 1 + (n - 400) // 160`` at 16 kHz.
    """
    if waveform.dim() != 1:
        raise ValueError(f"fbank takes one mono waveform (n,), got shape {tuple(waveform.shape)}")
    size = int(sample_frequency * FRAME_LENGTH_MS * 0.001)
    shift = int(sample_frequency * FRAME_SHIFT_MS * 0.001)
    padded = 1 << (size - 1).bit_length()
    m = num_frames(waveform.numel(), sample_frequency)
    if m == 0:
        raise ValueError(f"fbank needs at least {size} samples (one {FRAME_LENGTH_MS:g} ms frame), "
                         f"got {waveform.numel()}")
    wav = waveform.contiguous()
    frames = wav.as_strided((m, size), (shift * wav.stride(0), wav.stride(0)))
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.nn.functional.pad(frames.unsqueeze(0), (1, 0), mode="replicate").squeeze(0)[:, :-1]
    frames = frames - PREEMPHASIS * previous
    frames = frames * povey_window(size).to(frames.dtype).unsqueeze(0)
    frames = torch.nn.functional.pad(frames, (0, padded - size))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    banks = mel_banks(num_mel_bins, padded, float(sample_frequency)).to(power.dtype)
    energies = torch.mm(power, banks.T)
    return torch.max(energies, torch.tensor(EPSILON, dtype=energies.dtype)).log()
