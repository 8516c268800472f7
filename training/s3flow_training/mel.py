"""S3Gen's log-mel features (the ``mel`` the flow model is trained on and produces), torch only.

The settings are upstream's ``s3gen/utils/mel.py`` (Matcha-TTS' ``mel_spectrogram`` with CosyVoice's
config), written here without librosa:

=================  =========  ===========================================================
parameter          value      meaning
=================  =========  ===========================================================
``sampling_rate``  24000      audio sample rate (Hz)
``n_fft``          1920       FFT size (80 ms)
``win_size``       1920       periodic Hann window length
``hop_size``       480        20 ms: 50 frames per second, 2 frames per speech token
``num_mels``       80         mel bands (``n_feats``)
``fmin, fmax``     0, 8000    band edges (Hz)
``center``         False      the signal is reflect-padded by ``(n_fft - hop) / 2`` = 720 samples on
                              each side instead, so ``L`` samples give exactly ``L // 480`` frames
=================  =========  ===========================================================

Per frame: magnitude ``sqrt(re^2 + im^2 + 1e-9)`` of the one-sided STFT, times the Slaney-style mel
filter bank (librosa's default: Slaney mel scale, area-normalised triangles), then
``log(clamp(x, min=1e-5))``. Silence therefore sits at ``log(1e-5) = -11.5``.

Example::

    from s3flow_training.mel import log_mel, MelSettings
    mel = log_mel(torch.from_numpy(audio_24k))   # (80, len(audio) // 480)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MelSettings:
    """Upstream S3Gen's mel settings (see the module docstring)."""
    sampling_rate: int = 24000
    n_fft: int = 1920
    win_size: int = 1920
    hop_size: int = 480
    num_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0
    clip_val: float = 1e-5


S3GEN_MEL = MelSettings()


def hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep,
                    f / f_sp)


def mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    """Inverse of ``hz_to_mel_slaney``."""
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=4)
def mel_filterbank(settings: MelSettings = S3GEN_MEL) -> np.ndarray:
    """(num_mels, n_fft // 2 + 1) float32 triangles on the Slaney mel scale, Slaney area-normalised
    (``2 / (f[i + 2] - f[i])``), as ``librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax)``."""
    s = settings
    fft_freqs = np.linspace(0.0, s.sampling_rate / 2, s.n_fft // 2 + 1)
    edges = mel_to_hz_slaney(np.linspace(hz_to_mel_slaney(s.fmin), hz_to_mel_slaney(s.fmax), s.num_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


def log_mel(audio: torch.Tensor, settings: MelSettings = S3GEN_MEL) -> torch.Tensor:
    """Log-mel spectrogram of 24 kHz audio.

    Args:
        audio: (L,) or (B, L) float waveform in [-1, 1] at ``settings.sampling_rate``.

    Returns:
        (num_mels, L // hop) or (B, num_mels, L // hop) float32.
    """
    s = settings
    squeeze = audio.dim() == 1
    y = audio.float().reshape(-1, audio.shape[-1])
    pad = (s.n_fft - s.hop_size) // 2
    y = F.pad(y[:, None, :], (pad, pad), mode="reflect")[:, 0, :]
    spec = torch.stft(y, s.n_fft, hop_length=s.hop_size, win_length=s.win_size,
                      window=torch.hann_window(s.win_size), center=False, normalized=False, onesided=True,
                      return_complex=True)
    mag = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    mel = torch.matmul(torch.from_numpy(mel_filterbank(s)), mag)
    mel = torch.log(torch.clamp(mel, min=s.clip_val))
    return mel[0] if squeeze else mel


def resample(audio: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Band-limited resampling by zero-padding / truncating the spectrum (one FFT each way).

    Exact for periodic band-limited signals; for a few seconds of speech padded with silence (espeak-ng
    output) it is a clean ideal low-pass resampler. Returns ``round(len * dst / src)`` samples, float32.
    """
    audio = np.asarray(audio, dtype=np.float64)
    n_in = audio.shape[-1]
    n_out = int(round(n_in * dst_rate / src_rate))
    spec = np.fft.rfft(audio)
    keep = min(spec.shape[-1], n_out // 2 + 1)
    out_spec = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    out_spec[:keep] = spec[:keep]
    if n_in % 2 == 0 and keep == n_in // 2 + 1 and n_out > n_in:
        out_spec[keep - 1] *= 0.5  # split the input's Nyquist bin between +/- frequencies
    return (np.fft.irfft(out_spec, n_out) * (n_out / n_in)).astype(np.float32)
