"""The HiFT vocoder's neural source: the excitation between its two networks (numpy only).

The vocoder (``s3flow.model.vocoder.HiFTGenerator``) runs as two stateless networks, each a callable:

* ``f0(mel (B, n_feats, T) f32) -> (B, T) f64``: the ConvRNN F0 predictor, Hz per mel frame;
* ``decode(mel (1, n_feats, T) f32, harmonics (1, H + 1, hop * T) f32) -> (1, hop * T)``: source merge,
  upsampling network and inverse STFT; ``hop`` = 480 samples per mel frame at 24 kHz.

Between them sits the neural source filter's excitation, computed here: the harmonics of the F0 contour
as sines whose phase runs on from sample to sample, plus noise. Upstream draws the noise and the random
initial phases from the global RNG and accumulates the phase in float32 over the whole utterance; here
both are functions of (seed, frame) only and the phase is accumulated in float64 per frame, so a chunk
that re-computes a stretch of excitation gets the same values an offline pass gets (streaming:
``s3flow.engine.vocoder_stream``).

The phase integrates F0, so F0 must not depend on how the utterance was chunked: in float32 a
convolution over 40 frames and one over 120 frames round differently (about 1e-4 Hz), and the phase would
drift apart by that much per second. The F0 predictor therefore runs in float64 (``s3flow.model.vocoder``
exports it so), where the difference is about 1e-13 Hz.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from s3flow_contract.tensors import SAMPLES_PER_FRAME

#: Audio samples per mel frame at 24 kHz (upsampling 8 * 5 * 3, inverse STFT hop 4).
HOP_SAMPLES = SAMPLES_PER_FRAME

F0Fn = Callable[[np.ndarray], np.ndarray]
DecodeFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class SourceParams:
    """The neural source filter's constants (``HiFTGenerator``'s ``nsf_*`` settings)."""
    sampling_rate: int = 24000
    nb_harmonics: int = 8                # overtones above F0: H + 1 = 9 sine rows
    nsf_alpha: float = 0.1               # sine amplitude
    nsf_sigma: float = 0.003             # noise std on voiced samples
    nsf_voiced_threshold: float = 10.0   # Hz: F0 above it is voiced
    hop_samples: int = HOP_SAMPLES

    @property
    def rows(self) -> int:
        return self.nb_harmonics + 1


def trim_fade(n_trim: int = HOP_SAMPLES) -> np.ndarray:
    """Upstream's fade-in of the first ``2 * n_trim`` samples: zeros, then a raised cosine from 0 to 1."""
    fade = np.zeros(2 * n_trim, dtype=np.float32)
    fade[n_trim:] = (np.cos(np.linspace(np.pi, 0.0, n_trim)) + 1.0) / 2.0
    return fade


def apply_trim_fade(audio: np.ndarray, offset: int, fade: np.ndarray) -> np.ndarray:
    """Multiply the samples of ``audio`` (the utterance's samples from ``offset`` on) by the fade-in."""
    if offset < len(fade) and audio.size:
        n = min(len(fade) - offset, audio.shape[-1])
        audio = audio.copy()
        audio[..., :n] *= fade[offset:offset + n]
    return audio


class Excitation:
    """Seeded noise and random initial phases of the source: functions of (seed, frame) only.

    Noise is drawn in blocks of ``block`` mel frames, each from its own generator keyed by
    (seed, block), so any stretch of frames gets the same values whichever chunk asks for it.
    """

    def __init__(self, seed: int, params: SourceParams, block: int = 50):
        if not 0 <= int(seed) < 2 ** 63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        self.seed, self.params, self.block = int(seed), params, int(block)
        rng = np.random.default_rng([self.seed, 0x50C])
        phase = rng.uniform(-np.pi, np.pi, params.rows)
        phase[0] = 0.0                       # the fundamental starts at phase 0 (upstream's phase_vec)
        self.initial_phase = phase           # (H + 1,) radians

    def noise(self, start: int, stop: int) -> np.ndarray:
        """(H + 1, hop * (stop - start)) standard normal noise for mel frames [start, stop)."""
        rows, hop = self.params.rows, self.params.hop_samples
        out = np.empty((rows, hop * max(stop - start, 0)), dtype=np.float32)
        if stop <= start:
            return out
        for blk in range(start // self.block, (stop - 1) // self.block + 1):
            rng = np.random.default_rng([self.seed, 0x501, blk])
            values = rng.standard_normal((rows, self.block * hop), dtype=np.float32)
            lo, hi = max(start, blk * self.block), min(stop, (blk + 1) * self.block)
            out[:, (lo - start) * hop:(hi - start) * hop] = values[:, (lo - blk * self.block) * hop:
                                                                      (hi - blk * self.block) * hop]
        return out


def harmonic_source(f0: np.ndarray, start_frame: int, phase: np.ndarray, excitation: Excitation
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The source's harmonics for mel frames [start_frame, start_frame + T) of one utterance.

    Args:
        f0: (T,) Hz per mel frame (held constant over the frame's ``hop`` samples, as upstream's nearest
            upsampling does).
        start_frame: index of the first frame in the utterance (picks the noise).
        phase: (H + 1,) float64, each harmonic's accumulated phase in cycles before the first sample
            (zeros at the utterance start).
        excitation: the utterance's seeded noise and initial phases.

    Returns:
        harmonics (H + 1, hop * T) float32: ``alpha * sin(2 pi phase + phi0)`` where voiced, plus noise of
        std ``sigma`` (voiced) or ``alpha / 3`` (unvoiced); and the phase (H + 1,) after the last sample,
        in cycles modulo 1 (float64), to continue from.
    """
    p = excitation.params
    f0 = np.asarray(f0, dtype=np.float64).reshape(-1)
    t, hop = f0.size, p.hop_samples
    if t == 0:
        return np.zeros((p.rows, 0), np.float32), np.asarray(phase, np.float64) % 1.0
    # per-sample phase increment of harmonic i in frame k: f0_k (i + 1) / sr cycles
    inc = np.arange(1, p.rows + 1, dtype=np.float64)[:, None] * f0[None, :] / p.sampling_rate   # (H+1, T)
    frame_start = np.asarray(phase, np.float64)[:, None] + np.concatenate(
        [np.zeros((p.rows, 1)), np.cumsum(hop * inc, axis=1)[:, :-1]], axis=1)                # (H+1, T)
    steps = np.arange(1, hop + 1, dtype=np.float64)
    cycles = (frame_start[:, :, None] + inc[:, :, None] * steps[None, None, :]) % 1.0        # (H+1, T, hop)
    sines = p.nsf_alpha * np.sin(2 * np.pi * cycles + excitation.initial_phase[:, None, None])
    voiced = np.repeat(f0 > p.nsf_voiced_threshold, hop)[None, :]                             # (1, hop T)
    noise_amp = np.where(voiced, p.nsf_sigma, p.nsf_alpha / 3.0)
    noise = excitation.noise(start_frame, start_frame + t)
    out = np.where(voiced, sines.reshape(p.rows, t * hop), 0.0) + noise_amp * noise
    return out.astype(np.float32), cycles[:, -1, -1].copy()


def advance_phase(phase: np.ndarray, f0: np.ndarray, params: SourceParams) -> np.ndarray:
    """Each harmonic's phase (cycles, modulo 1) after the mel frames of ``f0`` (Hz), from ``phase`` before them:
    where ``harmonic_source`` over those frames would leave it, without making their samples."""
    f0 = np.asarray(f0, dtype=np.float64).reshape(-1)
    if f0.size == 0:
        return np.asarray(phase, np.float64) % 1.0
    inc = np.arange(1, params.rows + 1, dtype=np.float64)[:, None] * f0[None, :] / params.sampling_rate
    return (np.asarray(phase, np.float64) + np.cumsum(params.hop_samples * inc, axis=1)[:, -1]) % 1.0


def offline_vocode(f0_fn: F0Fn, decode_fn: DecodeFn, mel: np.ndarray, params: SourceParams, seed: int = 0,
                   fade: bool = True) -> np.ndarray:
    """Vocode a whole utterance's mel (n_feats, T) in one pass -> (hop * T,) float32 audio."""
    mel = np.ascontiguousarray(mel, dtype=np.float32)
    if mel.shape[1] == 0:
        return np.zeros(0, np.float32)
    f0 = np.asarray(f0_fn(mel[None]), dtype=np.float64)[0]
    harmonics, _ = harmonic_source(f0, 0, np.zeros(params.rows), Excitation(seed, params))
    audio = np.asarray(decode_fn(mel[None], harmonics[None]))[0].astype(np.float32)
    return apply_trim_fade(audio, 0, trim_fade(params.hop_samples)) if fade else audio

