"""The vocoder's section of a snapshot (``s3flow.engine.snapshot``): a ``VocoderState``, and back.

What the vocoder needs to go on where it stopped: its mel window, the F0 of the window's final frames and the
source's phase at the window's start (the window's excitation is computed from them again: ``harmonic_source``
of those frames from that phase, within float rounding of the kept one; the harmonics themselves would be 9 rows
of 480 samples a frame), the phase where the excitation goes on, the audio withheld for the next cross-fade, and
where each of these stands. The section is bound to the solver section it was made beside (a resume's solver
checked that one, tenant and prompt included), so the two come from the same point of the same stream.

Example::

    snapshots = VocoderSnapshots(key, stream)
    blob = snapshots.make(state, solver_blob)      # the solver's snapshot with the vocoder's section after it
    state = snapshots.restore(blob)                 # SnapshotError if refused
"""
from __future__ import annotations

from typing import Optional

from s3flow.engine.snapshot import (SnapshotError, SnapshotKey, array_field, check_fields, int_field, pack,
                                    section_bytes, unpack)
from s3flow.engine.vocoder_stream import VocoderState, VocoderStream
from s3flow.model.vocoder_source import Excitation, harmonic_source

KIND = "vocoder"
BOUND_TO = "solver"
VERSION = 1


class VocoderSnapshots:
    """Makes and restores the vocoder's section with ``key`` (None: this server gives and takes none)."""

    def __init__(self, key: Optional[SnapshotKey], stream: VocoderStream):
        self.key, self.stream = key, stream
        s, p = stream.settings, stream.params
        self.settings = {"version": VERSION, "n_feats": stream.n_feats, "lookbehind_frames": s.lookbehind_frames,
                         "lookahead_frames": s.lookahead_frames, "first_lookahead_frames": s.first_lookahead_frames,
                         "crossfade_samples": s.crossfade_samples, "rows": p.rows, "hop": p.hop_samples,
                         "sampling_rate": p.sampling_rate}

    def make(self, state: VocoderState, solver_blob: bytes) -> bytes:
        """``solver_blob`` with this state's section after it (b"" when the solver gave none, or no key)."""
        if self.key is None or not solver_blob:
            return b""
        fields = {**self.settings, "seed": state.excitation.seed, "ctx_start": state.ctx_start,
                  "received": state.received, "src_done": state.src_done, "emitted": state.emitted}
        arrays = {"mel": state.mel, "f0": state.f0, "ctx_phase": state.ctx_phase, "phase": state.phase}
        if state.pending is not None:
            arrays["pending"] = state.pending
        return self.key.seal(KIND, pack(fields, arrays), bound=section_bytes(solver_blob, BOUND_TO),
                             after=solver_blob)

    def restore(self, blob: bytes, seed: int) -> VocoderState:
        """The state a snapshot holds (for the stream of noise ``seed``); SnapshotError naming what is wrong."""
        if self.key is None:
            raise SnapshotError("this server holds no snapshot key (S3FLOW_SNAPSHOT_KEY_FILE): resume by replaying "
                                "the utterance")
        bound = section_bytes(blob, BOUND_TO)
        fields, arrays = unpack(self.key.open(blob, KIND, bound=bound))
        check_fields(fields, {**self.settings, "seed": int(seed)}, "the vocoder's")
        p, hop = self.stream.params, self.stream.params.hop_samples
        received = int_field(fields, "received", 0)
        ctx = int_field(fields, "ctx_start", 0, received)
        src_done = int_field(fields, "src_done", ctx, received)
        emitted = int_field(fields, "emitted", 0, hop * received)
        mel = array_field(arrays, "mel", "float32", (self.stream.n_feats, received - ctx))
        f0 = array_field(arrays, "f0", "float64", (src_done - ctx,))
        ctx_phase = array_field(arrays, "ctx_phase", "float64", (p.rows,))
        phase = array_field(arrays, "phase", "float64", (p.rows,))
        pending = None
        if "pending" in arrays:
            pending = array_field(arrays, "pending", "float32", (-1,))
            if pending.size > self.stream.settings.crossfade_samples:
                raise SnapshotError(f"snapshot pending audio holds {pending.size} samples, above the cross-fade's "
                                    f"{self.stream.settings.crossfade_samples}")
        excitation = Excitation(seed, p)
        harmonics, _ = harmonic_source(f0, ctx, ctx_phase, excitation)
        return VocoderState(excitation=excitation, ctx_start=ctx, received=received, mel=mel.copy(),
                            src_done=src_done, harmonics=harmonics, phase=phase.copy(), emitted=emitted,
                            pending=None if pending is None else pending.copy(), f0=f0.copy(),
                            ctx_phase=ctx_phase.copy())
