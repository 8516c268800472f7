"""Objective intelligibility of generated speech against the recording it should match.

* ``intelligibility(reference, audio)``: STOI and extended STOI (ESTOI) from the ``pystoi`` package, both
  signals brought to 16 kHz (``to_16k``: the corpus' band-limited resampler) and cut to the shorter one.
  0.36 / 0.0 is what white noise scores against speech, 1 / 1 the recording itself.
* ``log_spectral_distance(reference, audio)``: RMS over frequency of the difference of the two 16 kHz
  log power spectra (dB, 512-point frames, hop 128), averaged over frames where the reference is not
  silent: a spectral error that does not care about phase.
* ``griffin_lim(mel)``: a phase-free stand-in for a vocoder (the mel filter bank inverted by non-negative
  least squares, then Griffin-Lim iterations at S3Gen's STFT settings): the reference that says what
  a mel carries whatever the vocoder.

Example::

    from s3flow_training.intelligibility import intelligibility
    score = intelligibility(reference_16k, audio_24k, audio_rate=24000)
    score.stoi, score.estoi
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from s3flow_training.mel import S3GEN_MEL, mel_filterbank, resample

RATE = 16000


def to_16k(audio: np.ndarray, rate: int) -> np.ndarray:
    """Audio at ``rate`` -> 16 kHz float32 (unchanged when it is already)."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    return audio if rate == RATE else resample(audio, rate, RATE)


@dataclass(frozen=True)
class Intelligibility:
    stoi: float
    estoi: float


def intelligibility(reference: np.ndarray, audio: np.ndarray, reference_rate: int = RATE,
                    audio_rate: int = S3GEN_MEL.sampling_rate) -> Intelligibility:
    """STOI and ESTOI of ``audio`` against ``reference`` (each at its own rate; compared at 16 kHz)."""
    from pystoi import stoi

    x, y = to_16k(reference, reference_rate), to_16k(audio, audio_rate)
    n = min(len(x), len(y))
    if n < RATE // 4:
        raise ValueError(f"need at least 0.25 s of audio to score, got {n / RATE:.3f} s")
    x, y = x[:n].astype(np.float64), y[:n].astype(np.float64)
    return Intelligibility(float(stoi(x, y, RATE, extended=False)), float(stoi(x, y, RATE, extended=True)))


def log_spectral_distance(reference: np.ndarray, audio: np.ndarray, reference_rate: int = RATE,
                          audio_rate: int = S3GEN_MEL.sampling_rate, silence_db: float = -60.0) -> float:
    """Mean over non-silent frames of the RMS (over frequency) log power difference in dB."""
    x, y = to_16k(reference, reference_rate), to_16k(audio, audio_rate)
    n = min(len(x), len(y))
    window = torch.hann_window(512, dtype=torch.float64)

    def power_db(a: np.ndarray) -> torch.Tensor:
        spec = torch.stft(torch.from_numpy(a[:n].astype(np.float64)), 512, 128, window=window, return_complex=True)
        return 10 * torch.log10(spec.abs().pow(2) + 1e-10)

    px, py = power_db(x), power_db(y)
    loud = px.max(dim=0).values > px.max() + silence_db
    return float(((px - py).pow(2).mean(dim=0).sqrt()[loud]).mean())


def griffin_lim(mel: np.ndarray, n_iter: int = 64, seed: int = 0) -> np.ndarray:
    """A waveform (480 T,) at 24 kHz for a log-mel (80, T) without a vocoder.

    Magnitudes: ``exp(mel)`` mapped back through the mel filter bank by non-negative least squares.
    Phase: ``n_iter`` Griffin-Lim iterations with S3Gen's window (1920 Hann, hop 480), from a seeded random
    phase.
    """
    s = S3GEN_MEL
    basis = torch.from_numpy(mel_filterbank(s)).double()                      # (80, 961)
    target = torch.from_numpy(np.exp(mel)).double()
    magnitude = (torch.linalg.pinv(basis) @ target).clamp(min=1e-8)
    gram, back = basis.T @ basis, basis.T @ target
    for _ in range(100):   # non-negative least squares by multiplicative updates, from the clamped pinv
        magnitude = magnitude * back / (gram @ magnitude).clamp(min=1e-12)
    window = torch.hann_window(s.win_size, dtype=torch.float64)
    length = mel.shape[1] * s.hop_size
    gen = torch.Generator().manual_seed(seed)
    phase = torch.exp(2j * np.pi * torch.rand(magnitude.shape, generator=gen, dtype=torch.float64))

    def istft(spec: torch.Tensor) -> torch.Tensor:
        return torch.istft(spec, s.n_fft, s.hop_size, s.win_size, window=window, center=True, length=length)

    def stft(y: torch.Tensor) -> torch.Tensor:
        return torch.stft(y, s.n_fft, s.hop_size, s.win_size, window=window, center=True, return_complex=True)

    frames = magnitude.shape[1]
    for _ in range(n_iter):
        spec = stft(istft(magnitude * phase))[:, :frames]
        phase = spec / spec.abs().clamp(min=1e-12)
    # torch's frame k is centred on sample 480 k, S3Gen's mel frame k on 480 k + 240 (``mel.log_mel``)
    shift = s.hop_size // 2
    y = torch.cat([torch.zeros(shift, dtype=torch.float64), istft(magnitude * phase)[:length - shift]])
    return y.float().clamp(-1, 1).numpy()
