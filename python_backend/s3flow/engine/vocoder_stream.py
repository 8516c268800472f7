"""Streaming the HiFT vocoder: the per-utterance state between mel chunks (numpy only).

The vocoder runs as two stateless networks, ``f0`` and ``decode`` (callables over ONNX Runtime or torch:
``s3flow.runtime.vocoder``), with the neural source's excitation between them computed in numpy
(``s3flow.model.vocoder_source``: seeded by (seed, frame), phase in float64, so a chunk that re-computes a
stretch of excitation gets the values an offline pass gets).

:class:`VocoderStream` turns the newly final mel frames of a sequence, chunk by chunk, into newly final
audio samples. Per correlation id it keeps

* the mel tail of ``lookbehind_frames`` frames before the first not-yet-emitted frame (the network's left
  receptive field: re-vocoded with the next chunk, its audio is discarded);
* the excitation of that tail and the harmonics' phase at its end (what upstream calls ``cache_source``),
  advanced only over frames whose F0 is final (``F0_LOOKAHEAD_FRAMES`` of mel after them are known);
* ``lookahead_frames`` of audio withheld at the end until more mel (or END) arrives, and the first
  ``crossfade_samples`` of that withheld audio, which the next chunk's fresh audio is cross-faded from;
* the F0 of the tail's final frames and the phase at the tail's start, from which the tail's excitation can be
  made again (``s3flow.engine.vocoder_snapshot``: what a resume elsewhere starts from).

``push`` computes on a copy: the state it was given is left as it was, and the caller keeps the new one once
the networks have answered (a failed call leaves the stream as before the chunk, so the chunk can be sent again).

With ``lookbehind_frames`` and ``lookahead_frames`` at least the network's receptive field (the defaults),
streamed audio equals offline vocoding of the whole mel up to float rounding; smaller lookaheads trade
that for latency and the cross-fade hides the difference at the seam. The first ``2 * 480`` samples are
faded in as upstream does (``trim_fade``: 20 ms of silence, then a 20 ms raised cosine).

Example::

    stream = VocoderStream(f0_fn, decode_fn, params)
    state = stream.start(seed=0)
    for k, mel in enumerate(chunks):                 # mel: (n_feats, F_k), frame offsets continuing
        state, chunk = stream.push(state, mel, frame_offset, end=(k == len(chunks) - 1))
        chunk.audio, chunk.sample_offset             # newly final samples and the index of the first
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from s3flow.model.vocoder_source import (DecodeFn, Excitation, F0Fn, SourceParams, advance_phase, apply_trim_fade,
                                         harmonic_source, trim_fade)
from s3flow.protocol import NumericSettings, check_numbers

__all__ = ["F0_LOOKAHEAD_FRAMES", "StreamSettings", "StreamError", "NetworkCallError", "VocoderState", "AudioChunk",
           "VocoderStream"]

#: Mel frames after a frame that the F0 predictor (five 3-tap convolutions) reads.
F0_LOOKAHEAD_FRAMES = 5


# ---------------------------------------------------------------------------------------------------
# Streaming


@dataclass
class StreamSettings(NumericSettings):
    """The vocoder's streaming knobs (each a ``parameters`` entry of its Triton config; what it holds is its
    ``s3flow.engine.sequences.SequenceLimits``, also config parameters).

    ``lookbehind_frames`` and ``lookahead_frames`` default to cover the full-size HiFT's receptive field (about
    14 frames of mel each side, plus 5 for the F0 predictor on the right), so streaming is exact; a smaller
    ``lookahead_frames`` lowers latency and leaves a small, cross-faded difference near each seam.
    """
    lookbehind_frames: int = 16          # mel frames re-vocoded before the first unemitted frame
    lookahead_frames: int = 20           # mel frames of audio withheld until more mel (or END) arrives
    #: the first response's lookahead (-1: ``lookahead_frames``): a smaller one lets the first mel chunk carry
    #: audio at once; its last frames' audio then lacks right context, and the next response cross-fades from
    #: it into the exact stream (``crossfade_samples``), so only the first response differs from offline
    first_lookahead_frames: int = -1
    crossfade_samples: int = 480         # fresh audio fades in from the previous pass's withheld audio
    max_utterance_frames: int = 0        # 0: no cap (the state is bounded whatever the length)

    def check(self) -> None:
        check_numbers(self, "vocoder setting",
                      lowest={"lookbehind_frames": 0, "lookahead_frames": 0, "crossfade_samples": 0,
                              "max_utterance_frames": 0, "first_lookahead_frames": -1})
        if self.lookbehind_frames < F0_LOOKAHEAD_FRAMES:
            raise ValueError(f"lookbehind_frames must be >= {F0_LOOKAHEAD_FRAMES} (the F0 predictor's context), "
                             f"got {self.lookbehind_frames}")


#: The first lookahead token2wav serves by default (``s3flow.repository``): the first response carries audio,
#: streaming is exact from the second response on (results/first_audio.md: first audio 1.11x first mel,
#: after 0.5 s within 1e-6 of offline vocoding, ESTOI unchanged). ``StreamSettings()`` itself stays exact.
SERVED_FIRST_LOOKAHEAD_FRAMES = 4


class StreamError(ValueError):
    """A chunk breaks its stream (frame gap, wrong shape, NaN, too long); maps to INVALID_ARG."""


class NetworkCallError(RuntimeError):
    """The F0 predictor or the decoder failed on a chunk (the stream is as before it: the chunk may come again)."""


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
    f0: Optional[np.ndarray] = None      # (src_done - ctx_start,) float64: F0 of the final frames of the tail
    ctx_phase: Optional[np.ndarray] = None  # (H + 1,) cycles at the start of frame ctx_start


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
                            harmonics=np.zeros((p.rows, 0), np.float32), phase=np.zeros(p.rows),
                            f0=np.zeros(0), ctx_phase=np.zeros(p.rows))

    def push(self, state: VocoderState, mel: np.ndarray, frame_offset: int, end: bool
             ) -> tuple[VocoderState, AudioChunk]:
        """The stream after the mel frames (n_feats, F) that start at ``frame_offset``, and its newly final audio;
        ``state`` itself is left as it was. StreamError for a chunk that breaks the stream, NetworkCallError when
        a network fails."""
        state = dataclasses.replace(state)   # every field below is assigned anew, never changed in place
        s, hop = self.settings, self.params.hop_samples
        mel = np.asarray(mel, dtype=np.float32)
        if mel.ndim != 2 or mel.shape[0] != self.n_feats:
            raise StreamError(f"mel must have shape (n_feats={self.n_feats}, frames), got {list(mel.shape)}")
        if frame_offset != state.received:
            raise StreamError(f"mel frame offset {frame_offset} does not continue the {state.received} frames "
                              f"received (gap or duplicate)")
        if s.max_utterance_frames and state.received + mel.shape[1] > s.max_utterance_frames:
            raise StreamError(f"utterance grows to {state.received + mel.shape[1]} mel frames, above "
                              f"max_utterance_frames {s.max_utterance_frames}")
        if not np.isfinite(mel).all():
            raise StreamError(f"mel holds {int((~np.isfinite(mel)).sum())} NaN or Inf values")
        state.mel = np.concatenate([state.mel, mel], axis=1)
        state.received += mel.shape[1]
        w0, w1 = state.ctx_start, state.received

        lookahead = s.lookahead_frames
        if state.emitted == 0 and s.first_lookahead_frames >= 0:
            lookahead = s.first_lookahead_frames
        emit_frame = w1 if end else max(w1 - lookahead, 0)
        if emit_frame * hop <= state.emitted:
            return state, AudioChunk(np.zeros(0, np.float32), state.emitted)

        # excitation: cached (final) up to src_done; continue the phase from there over the rest
        f0 = np.asarray(self._call(self.f0_fn, "F0 predictor", state.mel[None]),
                        dtype=np.float64)[0, state.src_done - w0:]
        self.network_calls += 1
        f0_final = w1 if end else max(w1 - F0_LOOKAHEAD_FRAMES, state.src_done)
        split = f0_final - state.src_done
        fresh_final, phase = harmonic_source(f0[:split], state.src_done, state.phase, state.excitation)
        fresh_rest, _ = harmonic_source(f0[split:], f0_final, phase, state.excitation)
        state.harmonics = np.concatenate([state.harmonics, fresh_final], axis=1)
        state.f0 = np.concatenate([state.f0, f0[:split]])
        state.src_done, state.phase = f0_final, phase
        harmonics = np.concatenate([state.harmonics, fresh_rest], axis=1)

        audio = np.asarray(self._call(self.decode_fn, "decoder", state.mel[None],
                                      harmonics[None]))[0].astype(np.float32)
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
        keep = max(min(emit_frame - s.lookbehind_frames, state.src_done - F0_LOOKAHEAD_FRAMES), w0, 0)
        state.mel = state.mel[:, keep - w0:]
        state.harmonics = state.harmonics[:, (keep - w0) * hop:]
        state.ctx_phase = advance_phase(state.ctx_phase, state.f0[:keep - w0], self.params)
        state.f0 = state.f0[keep - w0:]
        state.ctx_start = keep
        return state, chunk

    @staticmethod
    def _call(fn, what: str, *args):
        try:
            return fn(*args)
        except Exception as exc:   # ONNX Runtime, torch: the stream is as before the chunk
            raise NetworkCallError(f"the vocoder's {what} failed: {type(exc).__name__}: {exc}") from exc
