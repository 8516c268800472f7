"""What a stream keeps between its chunks and what one chunk is on its way through the engine.

* :class:`SequenceState`: everything the server keeps for one utterance between its chunks (its prompt, noise,
  the tokens a later chunk still needs, ``noised_mels``, the last emitted frames, its kept solve);
* :class:`Chunk`: an admitted chunk: its sequence's state (unchanged until the solve succeeded), the new tokens and
  the planned solve (``s3flow.engine.streaming.StreamingEngine.admit`` makes it, ``commit`` applies it);
* :class:`ChunkResult`: its answer, the newly final mel frames; :class:`Answered`: the chunk a sequence took last
  and that answer, sent again if the chunk comes again.

The engine (``s3flow.engine.streaming``) and the solving loop (``s3flow.engine.step_loop``) both work on these; the
loop does not know the engine beyond what it calls (``step_loop.ChunkEngine``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np

from s3flow.engine.reuse import StreamCache
from s3flow.engine.stepping import StepCaches
from s3flow.model.chunks import NoisedMels
from s3flow.model.solver import FrameNoise
from s3flow.protocol import ChunkRequest


#: the metadata of the fields a START sets (``SequenceState.started``)
START = {"start": True}


@dataclass
class SequenceState:
    """Everything the server keeps for one utterance between its chunks."""
    #: the prompt's tokens and mel that may condition a chunk (the last ``prompt_frames`` when capped)
    prompt_tokens: np.ndarray = field(metadata=START)          # (Np,) int64
    prompt_mel: np.ndarray = field(metadata=START)             # (n_feats, Tp) float32, Tp = 2 Np
    speaker_embedding: np.ndarray = field(metadata=START)      # (192,) float32
    n_steps: int = field(metadata=START)
    guidance_rate: float = field(metadata=START)
    noise: FrameNoise = field(metadata=START)
    prompt_noise: np.ndarray = field(metadata=START)   # (n_feats, Tp): the kept prompt frames' fixed starting point
    #: the speech tokens a later chunk can still use: those from token ``token_offset`` on (prefix mode: all;
    #: bounded context: from the first token of the next chunk's context on)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_offset: int = 0
    received_tokens: int = 0           # speech tokens received in all (the utterance's length so far)
    noised_mels: Optional[NoisedMels] = None  # ODE start of generated frames made (prefix mode: from 0)
    emitted: int = 0                   # generated frames already returned
    #: the last emitted frames, (n_feats, F) covering [emitted - F, emitted): bounded-context conditioning
    mel_tail: Optional[np.ndarray] = None
    tenant: str = field(default="", metadata=START)   # whose stream (a snapshot is sealed for it)
    #: its prompt's cache comes from a prompt pass (started by a registered voice, or resumed from a stream that
    #: was): the same for every stream of the voice at its steps and guidance (``s3flow.engine.voice_prompts``)
    prompt_pass: bool = field(default=False, metadata=START)
    cache: Optional[StreamCache] = None   # keep_solved: the solved frames kept (``s3flow.engine.reuse``)
    #: keep_solved 1: the tokens of the stream's first chunk when that chunk made the kept prompt cache (None
    #: otherwise): a snapshot carries them, and a resumed stream solves that chunk again to make the same cache
    cache_tokens: Optional[np.ndarray] = None
    last: Optional["Answered"] = None  # the chunk taken last and its answer: sent again if the chunk comes again

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mel.shape[1]

    def started(self) -> "SequenceState":
        """The state as its START made it, before any chunk: the fields a START sets (``START``), nothing since
        (a first chunk planned on it is that stream's: ``Chunk.replay``)."""
        return SequenceState(**{f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("start")})


@dataclass
class Answered:
    """The chunk a sequence took last (where it started, its tokens, END) and the answer it got."""
    token_offset: int
    tokens: np.ndarray
    end: bool
    result: "ChunkResult"

    def is_again(self, req: ChunkRequest) -> bool:
        return (req.token_offset == self.token_offset and req.end == self.end
                and np.array_equal(req.speech_tokens, self.tokens))



@dataclass
class Chunk:
    """An admitted chunk: its sequence's state (unchanged until the solve succeeded), the new tokens, and
    the planned solve.

    The solve's row holds the conditioning prefix (the prompt's last ``prompt_frames`` frames ++ the
    context mel, ``prefix_mel``) and then
    generated frames ``[first_frame, valid_frames)`` of the utterance; ``encoder_tokens`` is its encoder
    input and ``start`` its ODE starting point. After the chunk, generated frames below ``final_frames``
    are final (the rest wait for the lookahead tokens or the hold-back).
    """
    corr_id: object
    state: SequenceState
    tokens: np.ndarray                 # (N,) int64: the new speech tokens
    finalize: bool                     # END
    started: bool                      # START: the state was made for this chunk
    replaced: Optional[SequenceState]  # the live state a START replaced (put back if it fails)
    encoder_tokens: np.ndarray         # (Nq,) prompt ++ context tokens ++ the rest
    prefix_mel: np.ndarray             # (n_feats, P) prompt mel ++ context mel
    prompt_frames: int                 # the prompt's frames in prefix_mel (the rest is context)
    start: np.ndarray                  # (n_feats, P + valid_frames - first_frame) ODE starting point
    first_frame: int                   # first generated frame in the solve (0 in prefix mode)
    valid_frames: int                  # generated frames valid after this chunk
    final_frames: int                  # generated frames final after this chunk
    #: Euler steps of its solve: the stream's ``n_steps``, the request's ``chunk_steps`` (a replay), or fewer
    #: given by the scheduler before its first step (``StreamingEngine.fewer_steps``)
    steps: int = 0
    pinned: bool = False               # the request named its steps: no scheduler changes them
    #: keep_solved: the stream's cache the solve reads (the first ``skipped`` frames of ``start`` not solved), and
    #: the leading frames of the solve whose cache it keeps
    past: Optional[list[StepCaches]] = None
    skipped: int = 0
    keep: int = 0
    #: keep_solved 1, the first chunk of a resumed stream: its stream's first chunk again, on a fresh state (the
    #: same solve), whose prompt cache this chunk reads once it is made (``StepLoop._replay``); or, for a stream
    #: whose prompt's cache comes from a prompt pass not held yet, that pass (the prompt alone)
    replay: Optional["Chunk"] = None

    @property
    def frames(self) -> int:
        """Frames of the conditioning and start (prefix included)."""
        return self.start.shape[1]

    @property
    def solved_frames(self) -> int:
        """Frames of the solve's rows."""
        return self.frames - self.skipped

    @property
    def rows(self) -> int:
        """Estimator rows of one of its steps (2 with guidance)."""
        return 2 if self.state.guidance_rate else 1

    @property
    def nfe(self) -> int:
        """Network evaluations of the chunk's solve: steps, twice over with guidance."""
        return self.steps * self.rows

    @property
    def full_nfe(self) -> int:
        """The same at its stream's full step count (what capacity is defined at)."""
        return self.state.n_steps * self.rows

    @property
    def past_frames(self) -> int:
        """Frames of the prefix cache its rows read (its stream's kept prompt and context; 0: none)."""
        return self.past[0][0].frames if self.past else 0


@dataclass
class ChunkResult:
    """mel: (n_feats, F) the newly final frames; frame_offset: index of the first of them; seed: the
    utterance's noise seed (the vocoder's source is seeded by it too); snapshot: the stream's state after the
    chunk, sealed (b"" when there is none to give: prefix mode, no key, END); steps: the Euler steps it was
    solved at (a replay sends them back as ``chunk_steps``)."""
    mel: np.ndarray
    frame_offset: int
    seed: int = 0
    snapshot: bytes = b""
    steps: int = 0
