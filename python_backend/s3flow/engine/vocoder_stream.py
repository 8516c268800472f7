"""Streaming the HiFT vocoder: the neural source's excitation and the per-utterance state (numpy only).

The vocoder (``s3flow.model.vocoder.HiFTGenerator``) runs as two stateless networks, each a callable here:

* ``f0(mel (B, n_feats, T) f32) -> (B, T) f64``: the ConvRNN F0 predictor, Hz per mel frame;
* ``decode(mel (1, n_feats, T) f32, harmonics (1, H + 1, hop * T) f32) -> (1, hop * T)``: source merge,
  upsampling network and inverse STFT; ``hop`` = 480 samples per mel frame at 24 kHz.

Between them sits the neural source filter's excitation, computed here: the harmonics of the F0 contour
as sines whose phase runs on from sample to sample, plus noise. Upstream draws the noise and the random
initial phases from the global RNG and accumulates the phase in float32 over the whole utterance; here
both are functions of (seed, frame) only and the phase is accumulated in float64 per frame, so a chunk
that re-computes a stretch of excitation gets the same values an offline pass gets.

The phase integrates F0, so F0 must not depend on how the utterance was chunked: in float32 a
convolution over 40 frames and one over 120 frames round differently (about 1e-4 Hz), and the phase would
drift apart by that much per second. The F0 predictor therefore runs in float64 (``s3flow.model.vocoder``
exports it so), where the difference is about 1e-13 Hz.

:class:`VocoderStream` turns the newly final mel frames of a sequence, chunk by chunk, into newly final
audio samples. Per correlation id it keeps

* the mel tail of ``context_frames`` frames before the first not-yet-emitted frame (the network's left
  receptive field: re-vocoded with the next chunk, its audio is discarded);
* the excitation of that tail and the harmonics' phase at its end (what upstream calls ``cache_source``),
  advanced only over frames whose F0 is final (``F0_LOOKAHEAD_FRAMES`` of mel after them are known);
* ``lookahead_frames`` of audio withheld at the end until more mel (or END) arrives, and the first
  ``crossfade_samples`` of that withheld audio, which the next chunk's fresh audio is cross-faded from.

With ``context_frames`` and ``lookahead_frames`` at least the network's receptive field (the defaults),
streamed audio equals offline vocoding of the whole mel up to float rounding; smaller lookaheads trade
that for latency and the cross-fade hides the difference at the seam. The first ``2 * 480`` samples are
faded in as upstream does (``trim_fade``: 20 ms of silence, then a 20 ms raised cosine).

Example::

    stream = VocoderStream(f0_fn, decode_fn, params)
    state = stream.start(seed=0)
    for k, mel in enumerate(chunks):                 # mel: (n_feats, F_k), frame offsets continuing
        chunk = stream.push(state, mel, frame_offset, end=(k == len(chunks) - 1))
        chunk.audio, chunk.sample_offset             # newly final samples and the index of the first
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Optional

import numpy as np

#: Mel frames after a frame that the F0 predictor (five 3-tap convolutions) reads.
F0_LOOKAHEAD_FRAMES = 5
#: Audio samples per mel frame at 24 kHz (upsampling 8 * 5 * 3, inverse STFT hop 4).
HOP_SAMPLES = 480

#: Tensor names of the two exported graphs (``s3flow.model.vocoder.export_vocoder``).
F0_INPUTS, F0_OUTPUTS = ["mel"], ["f0"]
DECODER_INPUTS, DECODER_OUTPUTS = ["mel", "harmonics"], ["audio"]

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


class OnnxVocoder:
    """The two callables, over ONNX Runtime (CPU) sessions of ``f0.onnx`` and ``decoder.onnx`` in a folder."""

    def __init__(self, directory, threads: int = 0):
        import os

        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sessions = []
        for name in ("f0.onnx", "decoder.onnx"):
            path = os.path.join(str(directory), name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"vocoder graph not found: {path}")
            sessions.append(ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"]))
        self.f0_session, self.decoder_session = sessions

    def f0(self, mel: np.ndarray) -> np.ndarray:
        return self.f0_session.run(F0_OUTPUTS, {"mel": np.ascontiguousarray(mel, np.float32)})[0]

    def decode(self, mel: np.ndarray, harmonics: np.ndarray) -> np.ndarray:
        return self.decoder_session.run(DECODER_OUTPUTS, {"mel": np.ascontiguousarray(mel, np.float32),
                                                          "harmonics": np.ascontiguousarray(harmonics, np.float32)})[0]


# ---------------------------------------------------------------------------------------------------
# Streaming


@dataclass
class StreamSettings:
    """The vocoder model's knobs (each a ``parameters`` entry of its Triton config).

    ``context_frames`` and ``lookahead_frames`` default to cover the full-size HiFT's receptive field (about
    14 frames of mel each side, plus 5 for the F0 predictor on the right), so streaming is exact; a smaller
    ``lookahead_frames`` lowers latency and leaves a small, cross-faded difference near each seam.
    """
    context_frames: int = 16             # mel frames re-vocoded before the first unemitted frame
    lookahead_frames: int = 20           # mel frames of audio withheld until more mel (or END) arrives
    crossfade_samples: int = 480         # fresh audio fades in from the previous pass's withheld audio
    idle_timeout_s: float = 60.0
    max_live_sequences: int = 256
    max_utterance_frames: int = 3000

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "StreamSettings":
        kwargs = {}
        for f in fields(cls):
            if f.name in params:
                try:
                    kwargs[f.name] = type(f.default)(float(params[f.name]))
                except ValueError:
                    raise ValueError(f"config parameter {f.name} must be a number, got {params[f.name]!r}") from None
        s = cls(**kwargs)
        s.check()
        return s

    def check(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            lowest = 0 if f.name in ("context_frames", "lookahead_frames", "crossfade_samples") else 1e-9
            if not value >= lowest:
                raise ValueError(f"vocoder setting {f.name} must be >= {lowest}, got {value}")
        if self.context_frames < F0_LOOKAHEAD_FRAMES:
            raise ValueError(f"context_frames must be >= {F0_LOOKAHEAD_FRAMES} (the F0 predictor's context), "
                             f"got {self.context_frames}")


class StreamError(ValueError):
    """A chunk breaks its stream (frame gap, wrong shape, NaN, too long); maps to INVALID_ARG."""


@dataclass
class VocoderState:
    """Everything kept for one utterance between its chunks. Frame indices count the utterance's mel."""
    excitation: Excitation
    ctx_start: int = 0                   # first frame of the kept mel tail
    received: int = 0                    # mel frames received
    mel: Optional[np.ndarray] = None     # (n_feats, received - ctx_start)
    src_done: int = 0                    # excitation is final (F0 final) for frames < src_done
    harmonics: Optional[np.ndarray] = None  # (H + 1, hop * (src_done - ctx_start)) final excitation
    phase: Optional[np.ndarray] = None   # (H + 1,) cycles at the start of frame src_done
    emitted: int = 0                     # samples returned
    pending: Optional[np.ndarray] = None  # the previous pass's audio right after `emitted` (cross-fade)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class AudioChunk:
    """audio: (S,) newly final samples; sample_offset: index of the first of them in the utterance."""
    audio: np.ndarray
    sample_offset: int


class VocoderStream:
    """Mel chunks in, final audio chunks out, for many sequences (the state is passed in)."""

    def __init__(self, f0_fn: F0Fn, decode_fn: DecodeFn, params: SourceParams,
                 settings: Optional[StreamSettings] = None, n_feats: int = 80):
        self.f0_fn, self.decode_fn, self.params = f0_fn, decode_fn, params
        self.settings = settings or StreamSettings()
        self.settings.check()
        self.n_feats = n_feats
        self.fade = trim_fade(params.hop_samples)
        self.network_calls = 0

    def start(self, seed: int = 0) -> VocoderState:
        p = self.params
        return VocoderState(excitation=Excitation(seed, p),
                            mel=np.zeros((self.n_feats, 0), np.float32),
                            harmonics=np.zeros((p.rows, 0), np.float32), phase=np.zeros(p.rows))

    def push(self, state: VocoderState, mel: np.ndarray, frame_offset: int, end: bool) -> AudioChunk:
        """Append the mel frames (n_feats, F) that start at ``frame_offset``; return newly final audio."""
        s, p, hop = self.settings, self.params, self.params.hop_samples
        mel = np.asarray(mel, dtype=np.float32)
        if mel.ndim != 2 or mel.shape[0] != self.n_feats:
            raise StreamError(f"mel must have shape (n_feats={self.n_feats}, frames), got {list(mel.shape)}")
        if frame_offset != state.received:
            raise StreamError(f"mel frame offset {frame_offset} does not continue the {state.received} frames "
                              f"received (gap or duplicate)")
        if state.received + mel.shape[1] > s.max_utterance_frames:
            raise StreamError(f"utterance grows to {state.received + mel.shape[1]} mel frames, above "
                              f"max_utterance_frames {s.max_utterance_frames}")
        if not np.isfinite(mel).all():
            raise StreamError(f"mel holds {int((~np.isfinite(mel)).sum())} NaN or Inf values")
        state.mel = np.concatenate([state.mel, mel], axis=1)
        state.received += mel.shape[1]
        w0, w1 = state.ctx_start, state.received

        emit_frame = w1 if end else max(w1 - s.lookahead_frames, 0)
        if emit_frame * hop <= state.emitted:
            return AudioChunk(np.zeros(0, np.float32), state.emitted)

        # excitation: cached (final) up to src_done; continue the phase from there over the rest
        f0 = np.asarray(self.f0_fn(state.mel[None]), dtype=np.float64)[0, state.src_done - w0:]
        self.network_calls += 1
        f0_final = w1 if end else max(w1 - F0_LOOKAHEAD_FRAMES, state.src_done)
        split = f0_final - state.src_done
        fresh_final, phase = harmonic_source(f0[:split], state.src_done, state.phase, state.excitation)
        fresh_rest, _ = harmonic_source(f0[split:], f0_final, phase, state.excitation)
        state.harmonics = np.concatenate([state.harmonics, fresh_final], axis=1)
        state.src_done, state.phase = f0_final, phase
        harmonics = np.concatenate([state.harmonics, fresh_rest], axis=1)

        audio = np.asarray(self.decode_fn(state.mel[None], harmonics[None]))[0].astype(np.float32)
        self.network_calls += 1
        lo, hi = state.emitted - w0 * hop, emit_frame * hop - w0 * hop
        out = audio[lo:hi].copy()
        if state.pending is not None and s.crossfade_samples:
            n = min(len(state.pending), len(out))
            ramp = (0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 0.5) / n)).astype(np.float32)
            out[:n] = ramp * out[:n] + (1.0 - ramp) * state.pending[:n]
        state.pending = audio[hi:hi + s.crossfade_samples].copy() if hi < audio.size else None
        out = apply_trim_fade(out, state.emitted, self.fade)
        chunk = AudioChunk(out, state.emitted)
        state.emitted = emit_frame * hop

        # keep the left context of the next pass (at least the F0 predictor's before src_done)
        keep = max(min(emit_frame - s.context_frames, state.src_done - F0_LOOKAHEAD_FRAMES), w0, 0)
        state.mel = state.mel[:, keep - w0:]
        state.harmonics = state.harmonics[:, (keep - w0) * hop:]
        state.ctx_start = keep
        return chunk
