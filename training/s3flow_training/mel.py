"""S3Gen's log-mel features (the ``mel`` the flow model is trained on and produces), torch only.

The settings are upstream's ``s3gen/utils/mel.py`` (Matcha-TTS' ``mel_spectrogram`` with CosyVoice's
config); the function is serving's ``s3flow.model.voice.mel.s3gen_mel`` (one implementation: a prompt's mel at
serving time is the corpus' mel at training time). The resamplers stay apart: the corpus is resampled here by
FFT zero-padding (``resample``), a request's reference audio by serving's windowed sinc; their gap on the
prompt mel is stated by ``tests/test_training.py``.

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
from dataclasses import dataclass

import numpy as np
import torch

from s3flow.model.voice.mel import s3gen_mel, slaney_mel_filters


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


@functools.lru_cache(maxsize=4)
def mel_filterbank(settings: MelSettings = S3GEN_MEL) -> np.ndarray:
    """(num_mels, n_fft // 2 + 1) float32 triangles on the Slaney mel scale, Slaney area-normalised: serving's
    ``s3flow.model.voice.mel.slaney_mel_filters`` (librosa's ``filters.mel``)."""
    s = settings
    return slaney_mel_filters(s.sampling_rate, s.n_fft, s.num_mels, s.fmin, s.fmax).numpy()


def log_mel(audio: torch.Tensor) -> torch.Tensor:
    """Log-mel spectrogram of 24 kHz audio: serving's ``s3flow.model.voice.mel.s3gen_mel``, the one function
    both the corpus (training) and the prompt of a request (serving) go through.

    Args:
        audio: (L,) or (B, L) float waveform in [-1, 1] at 24 kHz.

    Returns:
        (num_mels, L // hop) or (B, num_mels, L // hop) float32.
    """
    mel = s3gen_mel(audio.float().reshape(-1, audio.shape[-1]))
    return mel[0] if audio.dim() == 1 else mel


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
