"""The vocoder's session layer: one request in, one outcome out (the vocoder's ``SolverSession``).

Everything between Triton's tensors and ``VocoderStream`` that is not Triton glue, unit-tested without a server:
validation, begin / serve a stream, the push (computed on a copy: the stream's state is replaced only once the
networks have answered, ``VocoderStream.push``), an answer sent again, the snapshot it hands out
(``s3flow.engine.vocoder_snapshot``) and a resume from one, and the mapping of failures to answers:

===================================  ===========  ===========  =============================================
what happened                        code         disposition  the stream's state
===================================  ===========  ===========  =============================================
the request is invalid (a mel of     INVALID_ARG  fail         unchanged (dropped when it was the END request)
the wrong shape, a frame gap)
a chunk of a stream not held here    INVALID_ARG  resume       none (never started, ended, or evicted)
the snapshot of a resume START       INVALID_ARG  retry,       none made: START again and replay
cannot be used                                    resend=
                                                  replay
a network (F0, decoder) call failed  UNAVAILABLE  retry        unchanged: send the chunk again (the solver
                                                  (resume at   answers its committed chunk again, the same
                                                  END)         frames, and the vocoder makes them this time)
any other failure                    INTERNAL     fail         dropped
the chunk the stream took last,      (its answer again)        unchanged
sent again (same frames, same
offset)
===================================  ===========  ===========  =============================================

Example::

    session = VocoderSession(stream, table, VocoderSnapshots(key, stream))
    outcome = session.handle(VocoderIncoming(corr_id=7, start=True, end=False, inputs=tensors))
    outcome.chunk.audio, outcome.snapshot, outcome.error
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from s3flow_contract.answers import Answer, Disposition
from s3flow_contract.tensors import VOCODER_INPUTS
from s3flow.engine.capacity import Work
from s3flow.engine.sequences import SequenceTable
from s3flow.engine.snapshot import SnapshotError
from s3flow.engine.vocoder_snapshot import VocoderSnapshots
from s3flow.engine.vocoder_stream import AudioChunk, NetworkCallError, StreamError, VocoderState, VocoderStream
from s3flow.protocol import RequestError, UnknownSequence, one_bytes
from s3flow.serving.responses import INTERNAL, INVALID_ARG, UNAVAILABLE

_MEL, _FRAME_OFFSET, _SEED, _SNAPSHOT, _RESUME = (t.name for t in VOCODER_INPUTS[:5])


@dataclass
class VocoderIncoming:
    """One request as the vocoder received it: controls and input tensors."""
    corr_id: int
    start: bool
    end: bool
    inputs: Mapping[str, np.ndarray]


@dataclass
class VocoderOutcome:
    """The answer: the audio chunk and the snapshot (``b""`` when none is given), or an error with its code and
    disposition; ``work``: what the networks did for it (one pass over its frames; None for an answer sent again,
    which ran none), priced by ``s3flow.serving.load``."""
    chunk: Optional[AudioChunk] = None
    snapshot: bytes = b""
    work: Optional[Work] = None
    error: Optional[str] = None
    code: Optional[str] = None
    answer: Optional[Answer] = None


@dataclass
class _Answered:
    """The last answer of a stream: sent again when the same chunk comes again."""
    frame_offset: int
    frames: bytes
    chunk: AudioChunk
    snapshot: bytes


@dataclass
class _Held:
    state: VocoderState
    last: Optional[_Answered] = None


def _bytes_of(inputs: Mapping[str, np.ndarray], name: str) -> bytes:
    return one_bytes(inputs[name], name) if name in inputs else b""


class VocoderSession:
    """Runs the vocoder's requests through ``stream``, each stream's state in ``table`` (module docstring)."""

    def __init__(self, stream: VocoderStream, table: SequenceTable, snapshots: VocoderSnapshots,
                 name: str = "vocoder"):
        self.stream, self.table, self.snapshots, self.name = stream, table, snapshots, name

    def _fail(self, r: VocoderIncoming, message: str, code: str, disposition: Disposition, **extra) -> VocoderOutcome:
        return VocoderOutcome(error=f"{self.name}: sequence {r.corr_id}: {message}", code=code,
                              answer=Answer(disposition, sequence=int(r.corr_id), **extra))

    def handle(self, r: VocoderIncoming) -> VocoderOutcome:
        try:
            mel, offset, seed, solver_snapshot, resume = self._parse(r)
        except RequestError as exc:
            if r.end:
                self.table.end(r.corr_id, "invalid END request")
            return self._fail(r, str(exc), INVALID_ARG, Disposition.FAIL)
        try:
            held, replaced = self._begin(r, seed, resume)
        except SnapshotError as exc:
            return self._fail(r, f"{exc}; START again without it and replay the utterance", INVALID_ARG,
                              Disposition.RETRY, resend="replay")
        except UnknownSequence as exc:
            return self._fail(r, str(exc), INVALID_ARG, Disposition.RESUME)
        last = held.last
        if last is not None and last.frame_offset == offset and last.frames == mel.tobytes():
            self.table.commit(r.corr_id, end=r.end)   # the answer to the chunk taken last was lost: again
            return VocoderOutcome(chunk=last.chunk, snapshot=last.snapshot)
        try:
            state, chunk = self.stream.push(held.state, mel, offset, end=r.end)
        except StreamError as exc:   # the state is as before: nothing was taken
            self._undo(r, replaced, "invalid END request")
            return self._fail(r, str(exc), INVALID_ARG, Disposition.FAIL)
        except NetworkCallError as exc:
            self._undo(r, replaced, "failed END")
            if r.end:
                return self._fail(r, f"{exc}; the END request ends the sequence: resume the utterance", UNAVAILABLE,
                                  Disposition.RESUME)
            return self._fail(r, f"{exc}; the stream is as before this chunk: send it again", UNAVAILABLE,
                              Disposition.RETRY)
        except Exception as exc:   # a bug: retrying would fail the same way
            self.table.end(r.corr_id, "error")
            return self._fail(r, f"{type(exc).__name__}: {exc}; the stream is ended", INTERNAL, Disposition.FAIL)
        snapshot = b"" if r.end else self.snapshots.make(state, solver_snapshot)
        held.state = state
        held.last = _Answered(offset, mel.tobytes(), chunk, snapshot)
        work = Work(row_frames=mel.shape[1], steps=1, frames=mel.shape[1])   # one pass of the networks
        self.table.commit(r.corr_id, end=r.end, frames=mel.shape[1], work=work)
        return VocoderOutcome(chunk=chunk, snapshot=snapshot, work=work)

    def _parse(self, r: VocoderIncoming):
        mel, offset = r.inputs.get(_MEL), r.inputs.get(_FRAME_OFFSET)
        if mel is None or offset is None:
            raise RequestError(f"the vocoder needs '{_MEL}' and '{_FRAME_OFFSET}' in every request")
        if mel.ndim != 3 or mel.shape[0] != 1 or mel.dtype != np.float32:
            raise RequestError(f"mel must be float32 [1, {self.stream.n_feats}, frames], got {mel.dtype} "
                               f"{list(mel.shape)}")
        seed = r.inputs.get(_SEED)
        seed = 0 if seed is None else int(np.asarray(seed).reshape(-1)[0])
        if seed < 0:
            raise RequestError(f"seed must be >= 0, got {seed}")
        resume = _bytes_of(r.inputs, _RESUME)
        if resume and not r.start:
            raise RequestError(f"{_RESUME} may only come with a sequence's START")
        return mel[0], int(np.asarray(offset).reshape(-1)[0]), seed, _bytes_of(r.inputs, _SNAPSHOT), resume

    def _begin(self, r: VocoderIncoming, seed: int, resume: bytes) -> tuple[_Held, Optional[_Held]]:
        """The stream's held state, in flight: a START's new one (from ``resume`` when given), else the live one."""
        if not r.start:
            return self.table.serve(r.corr_id), None
        state = self.snapshots.restore(resume, seed) if resume else self.stream.start(seed)
        held = _Held(state)
        return held, self.table.begin(r.corr_id, held)

    def _undo(self, r: VocoderIncoming, replaced: Optional[_Held], end_reason: str) -> None:
        """A push failed: a START's new state goes (any it replaced comes back); an END ends the stream."""
        self.table.rollback(r.corr_id, replaced, started=r.start)
        if r.end and not r.start:
            self.table.end(r.corr_id, end_reason)
