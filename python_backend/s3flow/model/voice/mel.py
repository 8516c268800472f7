"""The two mel spectrograms of S3Gen's front-end: the 24 kHz prompt mel and the tokenizer's 16 kHz log-mel.

* ``s3gen_mel``: what the flow is conditioned on (``prompt_feat``). Matcha-TTS/CosyVoice settings: n_fft = win
  = 1920, hop 480 (50 frames/s), 80 Slaney mel bins over 0-8 kHz. The signal is reflect-padded by
  (n_fft - hop) / 2 = 720 samples on both sides and the STFT is *not* centred, so ``T = n // 480``; the
  magnitude is ``sqrt(re^2 + im^2 + 1e-9)`` and the output ``log(max(mel, 1e-5))``.
* ``tokenizer_log_mel``: S3TokenizerV2's Whisper-style input. n_fft 400, hop 160 (100 frames/s), periodic Hann,
  centred reflect-padded STFT with the last frame dropped (``F = n // 160``), power spectrum, 128 Slaney bins
  over 0-8 kHz, ``log10(max(mel, 1e-10))`` floored at 8 below its maximum, then ``(x + 4) / 4``.

Both filterbanks are librosa's ``filters.mel`` (Slaney scale, Slaney area normalisation) computed here in float64
and rounded to float32 as librosa does; real checkpoints do not store them.

Example::

    from s3flow.model.voice.mel import s3gen_mel
    mel = s3gen_mel(torch.randn(1, 24000) * 0.1)      # (1, 80, 50)
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

S3GEN_SR = 24000
S3GEN_N_FFT = 1920
S3GEN_HOP = 480
S3GEN_N_MELS = 80
S3GEN_FMAX = 8000.0

TOKENIZER_SR = 16000
TOKENIZER_N_FFT = 400
TOKENIZER_HOP = 160
TOKENIZER_N_MELS = 128


def hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: ``f / (200/3)`` below 1 kHz, logarithmic (27 mels per factor 6.4) above."""
    freq = np.asarray(freq, dtype=np.float64)
    f_sp = 200.0 / 3
    mels = freq / f_sp
    min_log_mel = 1000.0 / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(freq >= 1000.0, min_log_mel + np.log(np.maximum(freq, 1e-300) / 1000.0) / logstep, mels)


def mel_to_hz(mels: np.ndarray) -> np.ndarray:
    """Inverse of ``hz_to_mel``."""
    mels = np.asarray(mels, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_mel = 1000.0 / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= min_log_mel, 1000.0 * np.exp(logstep * (mels - min_log_mel)), f_sp * mels)


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None) -> torch.Tensor:
    """Triangular filters (n_mels, n_fft // 2 + 1) float32, area-normalised (librosa ``filters.mel`` defaults)."""
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2:n_mels + 2] - mel_f[:n_mels])
    weights = (weights.astype(np.float64) * enorm[:, None]).astype(np.float32)
    return torch.from_numpy(weights)


def s3gen_mel(wav: torch.Tensor) -> torch.Tensor:
    """S3Gen's prompt mel of 24 kHz audio.

    Args:
        wav: (B, n) or (n,) float32 at 24 kHz, n > 720.

    Returns:
        (B, 80, n // 480) float32 log-mel (channels-major; ``prompt_feat`` is its transpose).
    """
    if wav.dim() == 1:
        wav = wav[None]
    pad = (S3GEN_N_FFT - S3GEN_HOP) // 2
    if wav.shape[-1] <= pad:
        raise ValueError(f"the 24 kHz mel needs more than {pad} samples, got {wav.shape[-1]}")
    y = torch.nn.functional.pad(wav.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(S3GEN_N_FFT, dtype=y.dtype)
    spec = torch.view_as_real(torch.stft(y, S3GEN_N_FFT, hop_length=S3GEN_HOP, win_length=S3GEN_N_FFT,
                                         window=window, center=False, normalized=False, onesided=True,
                                         return_complex=True))
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    basis = slaney_mel_filters(S3GEN_SR, S3GEN_N_FFT, S3GEN_N_MELS, 0.0, S3GEN_FMAX).to(mag.dtype)
    return torch.log(torch.clamp(torch.matmul(basis, mag), min=1e-5))


def tokenizer_log_mel(wav: torch.Tensor) -> torch.Tensor:
    """S3TokenizerV2's log-mel of 16 kHz audio.

    Args:
        wav: (n,) or (1, n) float32 at 16 kHz, n > 200.

    Returns:
        (128, n // 160) float32, or (1, 128, n // 160) for a (1, n) input. The floor (max - 8) is taken over
        the whole input, as upstream does for its one-utterance batches.
    """
    if wav.shape[-1] <= TOKENIZER_N_FFT // 2:
        raise ValueError(f"the tokenizer mel needs more than {TOKENIZER_N_FFT // 2} samples, got {wav.shape[-1]}")
    window = torch.hann_window(TOKENIZER_N_FFT, dtype=wav.dtype)
    stft = torch.stft(wav, TOKENIZER_N_FFT, TOKENIZER_HOP, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    filters = slaney_mel_filters(TOKENIZER_SR, TOKENIZER_N_FFT, TOKENIZER_N_MELS).to(magnitudes.dtype)
    log_spec = torch.clamp(filters @ magnitudes, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0
