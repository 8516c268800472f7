"""Every tensor that crosses a model boundary: its name, dtype and dims, declared once (numpy only).

The repository generator writes the ``config.pbtxt`` inputs and outputs from these declarations, the python
models check their config against them at load time, the ONNX exports name their graph inputs by them, and
the client, the benchmark and the test helpers build requests with :func:`request_arrays`.

Dims are Triton's: ``-1`` is variable, ``FEATS`` stands for the mel bins (80 in every released checkpoint).
Models that batch (``max_batch_size`` > 0: the solver, the ensembles, the vocoder) omit the batch dimension;
the stateless ones (encoder, estimator, voice encoder: ``max_batch_size: 0``) include it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

VOCAB_SIZE = 6561          # S3 speech-token ids lie in [0, VOCAB_SIZE)
XVECTOR_DIM = 192          # the speaker x-vector (CAMPPlus)
FEATS = "FEATS"            # placeholder in dims for the mel bins
#: The stream's geometry, which every response obeys: speech tokens per second of audio, mel frames per speech
#: token (so 50 frames a second), frames withheld at the end of a chunk that is not the last (the encoder's 3
#: pre-lookahead tokens need them), and token2wav's audio samples per mel frame (24 kHz).
TOKENS_PER_SECOND = 25
TOKEN_MEL_RATIO = 2
FRAMES_PER_SECOND = TOKENS_PER_SECOND * TOKEN_MEL_RATIO
PRE_LOOKAHEAD_TOKENS = 3
LOOKAHEAD_FRAMES = PRE_LOOKAHEAD_TOKENS * TOKEN_MEL_RATIO
SAMPLES_PER_FRAME = 480
#: token2wav's first 40 ms, silenced and faded in (as upstream does): audio that ends there is no sound yet, so
#: first audio counts from the first response whose samples reach beyond it
SILENT_START_SAMPLES = 2 * SAMPLES_PER_FRAME

#: numpy dtype name -> (Triton config type, wire type of tritonclient's InferInput)
_TYPES = {"int64": ("TYPE_INT64", "INT64"), "int32": ("TYPE_INT32", "INT32"), "float32": ("TYPE_FP32", "FP32"),
          "bool": ("TYPE_BOOL", "BOOL"), "bytes": ("TYPE_STRING", "BYTES")}


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                    # a key of _TYPES ("bytes": numpy object arrays of bytes)
    dims: tuple
    optional: bool = False        # the model takes requests without it
    ragged: bool = False          # allow_ragged_batch (a batch of requests with different lengths)
    start_only: bool = False      # request tensors: only on a sequence's START request

    def __post_init__(self):
        if self.dtype not in _TYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} is not one of {sorted(_TYPES)}")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(object) if self.dtype == "bytes" else np.dtype(self.dtype)

    @property
    def config_type(self) -> str:
        return _TYPES[self.dtype][0]

    @property
    def wire_type(self) -> str:
        return _TYPES[self.dtype][1]

    def shape(self, n_feats: int) -> tuple:
        """The dims with ``FEATS`` resolved."""
        return tuple(n_feats if d == FEATS else d for d in self.dims)


def names(tensors: Iterable[Tensor]) -> tuple[str, ...]:
    return tuple(t.name for t in tensors)


def by_name(tensors: Iterable[Tensor]) -> dict[str, Tensor]:
    return {t.name: t for t in tensors}


# -- the public request (token2mel / token2wav ensembles, cfm_solver) ------------------------------------
# Request tensors (client -> ``token2mel``; every tensor has a leading batch dimension of 1):
#
# =================  =======  ==========  ==========================================================
# name               dtype    shape       meaning
# =================  =======  ==========  ==========================================================
# speech_tokens      INT64    [1, N]      next chunk of S3 speech tokens, ids in [0, 6561); N >= 1,
#                                         except that an END request may carry N = 0 (finalise only)
# prompt_tokens      INT64    [1, Np]     START only: the speaker prompt's tokens (Np >= 1)
# prompt_mel         FP32     [1, 2Np, 80] START only: the prompt's mel, frames-major
# speaker_embedding  FP32     [1, 192]    START only: the speaker x-vector (any scale: L2-normalised)
# n_timesteps        INT32    [1, 1]      START only, optional: Euler steps (default from the config)
# guidance_rate      FP32     [1, 1]      START only, optional: classifier-free guidance w
# seed               INT64    [1, 1]      START only, optional: noise seed (default 0)
# voice_id           BYTES    [1, 1]      START only, optional: a registered voice instead of the prompt
# token_offset       INT64    [1, 1]      optional: the index of this chunk's first token in the utterance's
#                                         speech tokens. With it a chunk sent again is never applied twice
#                                         (the chunk taken last is answered again, an older one or a gap is
#                                         refused); without it the chunk is appended
# resume             BYTES    [1, 1]      START only, optional: the last ``snapshot`` an answer carried; the
#                                         stream goes on from there (this chunk's token_offset is then the
#                                         tokens the snapshot covers), with the START's own prompt and options
# chunk_steps        INT32    [1, 1]      optional: the Euler steps to solve this chunk at, 1 to the stream's
#                                         n_timesteps: what its answer said (``steps``) when the chunk is
#                                         sent again in a replay, so the replay makes the same frames.
#                                         Absent: the stream's n_timesteps, or fewer when the server is behind
#                                         (``min_steps``, deadline scheduling)
# =================  =======  ==========  ==========================================================
#
# Response tensors: ``mel`` FP32 [1, 80, F] the frames that became final with this request, and
# ``frame_offset`` INT64 [1, 1] the index of the first of them among the utterance's generated frames
# (the prompt region excluded). Offsets continue without gap; after END the total is 2 per speech token.
# ``snapshot`` BYTES [1, 1]: the stream's state after this chunk, sealed (``s3flow.engine.snapshot``), empty when
# the server gives none (prefix mode, no snapshot key, the END): what a ``resume`` START sends back.
# ``steps`` INT32 [1, 1]: the Euler steps this chunk was solved at (the stream's n_timesteps, or fewer when the
# deadline scheduler gave it fewer to keep the stream ahead of its player): a replay sends it as ``chunk_steps``.
# (A response parameter cannot carry it: Triton 2.51's python backend InferenceResponse takes none.)
REQUEST = (
    Tensor("speech_tokens", "int64", (-1,), ragged=True),
    Tensor("prompt_tokens", "int64", (-1,), optional=True, ragged=True, start_only=True),
    Tensor("prompt_mel", "float32", (-1, FEATS), optional=True, ragged=True, start_only=True),
    Tensor("speaker_embedding", "float32", (XVECTOR_DIM,), optional=True, ragged=True, start_only=True),
    Tensor("n_timesteps", "int32", (1,), optional=True, ragged=True, start_only=True),
    Tensor("guidance_rate", "float32", (1,), optional=True, ragged=True, start_only=True),
    Tensor("seed", "int64", (1,), optional=True, ragged=True, start_only=True),
    #: a registered voice (s3flow.serving.voice_registry) instead of the three prompt tensors
    Tensor("voice_id", "bytes", (1,), optional=True, start_only=True),
    Tensor("token_offset", "int64", (1,), optional=True, ragged=True),
    #: a stream's snapshot (an earlier answer's ``snapshot``): the START of a resume goes on from it
    Tensor("resume", "bytes", (1,), optional=True, start_only=True),
    #: the Euler steps of this chunk (a replay of an answer's ``steps``)
    Tensor("chunk_steps", "int32", (1,), optional=True, ragged=True),
)
VOICE_ID = "voice_id"
_REQUEST_BY_NAME = by_name(REQUEST)
PROMPT = ("prompt_tokens", "prompt_mel", "speaker_embedding")
#: Triton's sequence controls, as the solver and the vocoder receive them
CONTROLS = ("START", "END", "READY", "CORRID")

#: what the ``admission`` step of the ensembles answers a request it lets through (the solver waits for it, so
#: a refused START never reaches the sequence batcher and takes no slot); optional on the solver, whose own
#: checks stay, so the solver also serves requests sent to it directly. ``token2mel`` maps ``admitted``,
#: ``token2wav`` ``admitted_audio`` (to the solver's ``admitted``): the output a step is asked for tells
#: admission which ensemble a START is for, and so what it costs (the vocoder's work too, or not)
ADMITTED, ADMITTED_AUDIO = Tensor("admitted", "bool", (1,)), Tensor("admitted_audio", "bool", (1,))
ADMISSION_OUTPUTS = (ADMITTED, ADMITTED_AUDIO)
SOLVER_INPUTS = REQUEST + (Tensor("admitted", "bool", (1,), optional=True),)

MEL_RESPONSE = (Tensor("mel", "float32", (FEATS, -1)), Tensor("frame_offset", "int64", (1,)))
#: the Euler steps the chunk was solved at (what a replay sends back as ``chunk_steps``)
STEPS = Tensor("steps", "int32", (1,))
AUDIO_RESPONSE = (Tensor("audio", "float32", (-1,)), Tensor("sample_offset", "int64", (1,)))
#: the stream's state after the chunk, for a resume elsewhere (b"" when none is given)
SNAPSHOT = Tensor("snapshot", "bytes", (1,))
#: what ``token2mel`` answers
STREAM_RESPONSE = MEL_RESPONSE + (SNAPSHOT, STEPS)
#: the solver answers its utterance's noise seed too, for the vocoder's source, and passes a resume START's
#: snapshot on (the vocoder's part is in it): in token2wav every vocoder input must come from the solver (Triton
#: refuses an ensemble step whose inputs come from a decoupled model and from elsewhere, and the solver is
#: decoupled under ``scheduling: deadline``); token2mel maps neither
SOLVER_OUTPUTS = STREAM_RESPONSE + (Tensor("seed", "int64", (1,)), Tensor("resume", "bytes", (1,)))

# -- the stateless models the solver calls (BLS) ------------------------------------------------------------
ENCODER_INPUTS = (Tensor("tokens", "int64", (-1, -1)), Tensor("token_len", "int64", (-1,)),
                  Tensor("embedding", "float32", (-1, XVECTOR_DIM)))
ENCODER_OUTPUTS = (Tensor("mu", "float32", (-1, FEATS, -1)), Tensor("mask", "float32", (-1, 1, -1)),
                   Tensor("spks", "float32", (-1, FEATS)))

_ESTIMATOR_INPUTS = (Tensor("x", "float32", (-1, FEATS, -1)), Tensor("mask", "float32", (-1, 1, -1)),
                     Tensor("mu", "float32", (-1, FEATS, -1)), Tensor("t", "float32", (-1,)),
                     Tensor("spks", "float32", (-1, FEATS)), Tensor("cond", "float32", (-1, FEATS, -1)))
#: meanflow (distilled) estimators also take the interval's start time r
MEANFLOW_INPUT = Tensor("r", "float32", (-1,))
ESTIMATOR_OUTPUTS = (Tensor("velocity", "float32", (-1, FEATS, -1)),)


#: A stream that keeps what it solved (the solver's ``keep_solved``, issue 50): the estimator also reads the frames
#: before each row from a cache and returns its rows' first ``keep`` frames', each one flat float32 tensor
#: (``s3flow.model.prefix_cache.CacheShape.pack_past`` / ``pack_kept``: keys, values, convolution tails, key mask
#: and, in ``past``, each row's keep)
CACHE_INPUTS = (Tensor("past", "float32", (-1,)),)
CACHE_OUTPUTS = (Tensor("kept", "float32", (-1,)),)


def estimator_inputs(meanflow: bool, cached: bool = False) -> tuple[Tensor, ...]:
    """The estimator's inputs, in graph order: x, mask, mu, t, spks, cond (+ r for meanflow) (+ the cache's)."""
    return _ESTIMATOR_INPUTS + ((MEANFLOW_INPUT,) if meanflow else ()) + (CACHE_INPUTS if cached else ())


def estimator_outputs(cached: bool = False) -> tuple[Tensor, ...]:
    """velocity (+ the kept cache's)."""
    return ESTIMATOR_OUTPUTS + (CACHE_OUTPUTS if cached else ())


#: the models the solver calls (BLS), by their Triton names
ENCODER_MODEL, ESTIMATOR_MODEL = "flow_encoder", "estimator"
STATELESS_MODELS = (ENCODER_MODEL, ESTIMATOR_MODEL)


def stateless_tensors(model: str, meanflow: bool = False,
                      cached: bool = False) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """(inputs, outputs) of ``flow_encoder`` or ``estimator`` (``meanflow`` and ``cached`` matter to the estimator
    only)."""
    if model == ESTIMATOR_MODEL:
        return estimator_inputs(meanflow, cached), estimator_outputs(cached)
    if model == ENCODER_MODEL:
        return ENCODER_INPUTS, ENCODER_OUTPUTS
    raise ValueError(f"the stateless models are {STATELESS_MODELS}, got {model!r}")


# -- the vocoder (token2wav's second step) and its two ONNX graphs --------------------------------------
VOCODER_INPUTS = (Tensor("mel", "float32", (FEATS, -1), ragged=True), Tensor("frame_offset", "int64", (1,)),
                  Tensor("seed", "int64", (1,), optional=True), Tensor("snapshot", "bytes", (1,), optional=True),
                  Tensor("resume", "bytes", (1,), optional=True), Tensor("steps", "int32", (1,), optional=True))
#: The vocoder passes the mel it was given and its offset on, so that every output of ``token2wav`` is made by
#: its last step: an ensemble prunes the steps whose outputs a request did not name, and an ensemble output that
#: was also the vocoder's input would take the vocoder (and with it the audio) away from a client that names
#: only the mel, or the solver's mel away from one that names only the audio.
VOCODER_OUTPUTS = AUDIO_RESPONSE + STREAM_RESPONSE
#: Inside ``token2wav``: the solver's outputs, by the ensemble tensor names the vocoder reads them from (never an
#: ensemble output, see above). The vocoder answers the solver's snapshot with its own section after it.
SOLVER_TO_VOCODER = {"mel": "solver_mel", "frame_offset": "solver_frame_offset", "seed": "solver_seed",
                     "snapshot": "solver_snapshot", "resume": "solver_resume", "steps": "solver_steps"}
HIFT_F0 = ((Tensor("mel", "float32", (-1, FEATS, -1)),), (Tensor("f0", "float32", (-1, -1)),))
HIFT_DECODER = ((Tensor("mel", "float32", (-1, FEATS, -1)), Tensor("harmonics", "float32", (-1, -1, -1))),
                (Tensor("audio", "float32", (-1, -1)),))

# -- the voice encoder: a reference wav (or a ready prompt) in, a voice id and its prompt out ------------
VOICE_ENCODER_INPUTS = (
    Tensor("wav", "float32", (-1,), optional=True), Tensor("sample_rate", "int32", (1,), optional=True),
    Tensor("prompt_tokens", "int64", (-1,), optional=True), Tensor("prompt_mel", "float32", (-1, FEATS), optional=True),
    Tensor("speaker_embedding", "float32", (XVECTOR_DIM,), optional=True),
    Tensor("list_voices", "bool", (1,), optional=True))
VOICE_ENCODER_OUTPUTS = (
    Tensor("voice_id", "bytes", (1,)), Tensor("prompt_tokens", "int64", (-1,)),
    Tensor("prompt_mel", "float32", (-1, FEATS)), Tensor("speaker_embedding", "float32", (XVECTOR_DIM,)),
    Tensor("voice_ids", "bytes", (-1,)))


def request_arrays(speech_tokens, *, start: bool = False, prompt_tokens=None, prompt_mel=None,
                   speaker_embedding=None, n_timesteps: Optional[int] = None,
                   guidance_rate: Optional[float] = None, seed: Optional[int] = None,
                   voice_id: Optional[str] = None, token_offset: Optional[int] = None,
                   resume: Optional[bytes] = None, chunk_steps: Optional[int] = None) -> dict[str, np.ndarray]:
    """One request's tensors, batch dimension 1, dtypes as declared. ``None`` values are left out; the
    START-only ones are refused unless ``start`` (prompt_mel is frames-major: (2 Np, FEATS))."""
    given = {"prompt_tokens": prompt_tokens, "prompt_mel": prompt_mel, "speaker_embedding": speaker_embedding,
             "n_timesteps": n_timesteps, "guidance_rate": guidance_rate, "seed": seed, "voice_id": voice_id,
             "resume": resume}
    given = {k: v for k, v in given.items() if v is not None}
    if given and not start:
        raise ValueError(f"{sorted(given)} may only be sent with a sequence's START request")
    if token_offset is not None:
        given["token_offset"] = token_offset
    if chunk_steps is not None:
        given["chunk_steps"] = chunk_steps
    spec = _REQUEST_BY_NAME
    out = {"speech_tokens": np.asarray(speech_tokens, dtype=spec["speech_tokens"].np_dtype).reshape(1, -1)}
    for name, value in given.items():
        t = spec[name]
        if t.dtype == "bytes":
            out[name] = np.array([[value.encode() if isinstance(value, str) else value]], dtype=object)
        elif t.dims == (1,):
            out[name] = np.array([[value]], dtype=t.np_dtype)
        elif name == "speaker_embedding":
            out[name] = np.asarray(value, dtype=t.np_dtype).reshape(1, -1)
        else:
            out[name] = np.asarray(value, dtype=t.np_dtype)[None]
    return out
