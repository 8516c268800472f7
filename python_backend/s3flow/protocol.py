"""The streaming protocol's request rules and validation (no Triton imports: unit-testable), and the one reading
of typed values out of Triton config ``parameters`` (:func:`parameter_number`, :func:`parameter_bool`; the
settings dataclasses' :class:`NumericSettings`; ``s3flow.serving.config_params.Params`` reads a served config
through them).

One Triton sequence (correlation id) per utterance. Every request carries the next chunk of speech
tokens; the START request also carries the speaker prompt and options; the END request finalises.

Request tensors: ``s3flow_contract.tensors.REQUEST`` (names, dtypes, dims and what each means); response
tensors: ``s3flow_contract.tensors.STREAM_RESPONSE`` (``AUDIO_RESPONSE`` too from token2wav).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping, Optional, Union

import numpy as np

from s3flow_contract.tensors import REQUEST, VOCAB_SIZE, VOICE_ID, XVECTOR_DIM

#: The request tensors the solver validates here (voice_id is resolved to a prompt before parse_request).
INPUT_DTYPES = {t.name: t.np_dtype.type for t in REQUEST if t.name != VOICE_ID}
START_ONLY = tuple(t.name for t in REQUEST if t.start_only and t.name != VOICE_ID)
#: the largest ``resume`` snapshot a request may carry (the solver's and the vocoder's state: tens of kB)
MAX_RESUME_BYTES = 1 << 20


class RequestError(ValueError):
    """A client's request is invalid; the message names the bad value. Maps to INVALID_ARG."""


#: The request header naming the tenant a request belongs to: set by the router after it authenticated the
#: client (docs/security.md), forwarded by tritonserver as a request parameter when it runs with
#: ``--grpc-header-forward-pattern`` for it; absent: the single default tenant "".
TENANT_HEADER = "s3flow-tenant"
_TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@/+=-")


def tenant_of(parameters: str) -> str:
    """The tenant named by a request's parameters (Triton's JSON of them); "" when none is."""
    import json

    if not parameters or TENANT_HEADER not in parameters:
        return ""
    try:
        value = json.loads(parameters).get(TENANT_HEADER, "")
    except (ValueError, AttributeError):
        return ""
    value = value if isinstance(value, str) else str(value)
    if len(value) > 256 or not set(value) <= _TENANT_CHARS:
        raise RequestError(f"header {TENANT_HEADER} {value[:40]!r}: at most 256 characters of A-Z a-z 0-9 "
                           "and ._:@/+=-")
    return value


class UnknownSequence(RequestError):
    """A chunk of a sequence this server does not hold (never started here, ended, or evicted): the client
    should replay the utterance (disposition ``resume``)."""


class ServerBusy(RequestError):
    """A valid START that this server cannot take now (it is full, or draining). Maps to UNAVAILABLE: the
    client should send the START again later (``retry_after_s``) or to another server."""

    def __init__(self, message: str, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def parameter_number(key: str, raw: str, integer: bool) -> Union[int, float]:
    """One Triton config ``parameters`` value (a string) as a number: an ``int`` where ``integer`` (any whole
    number, so ``"1e3"`` is 1000), else a ``float``; ValueError naming the key and the value."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"config parameter {key} must be a number, got {raw!r}") from None
    if not integer:
        return value
    if not value.is_integer():  # also NaN and Inf
        raise ValueError(f"config parameter {key} must be an integer, got {raw!r}")
    return int(value)


def parameter_bool(key: str, raw: str) -> bool:
    """One Triton config ``parameters`` value as a boolean: ``true`` or ``false`` (any case), nothing else."""
    if raw.lower() not in ("true", "false"):
        raise ValueError(f"config parameter {key} must be true or false, got {raw!r}")
    return raw.lower() == "true"


def numbers_from_parameters(cls, params: Mapping[str, str]) -> dict:
    """Keyword arguments for the numeric dataclass ``cls`` from Triton config ``parameters`` (string values): each
    field present is a number (:func:`parameter_number`), an integer where the field's default is one; unknown
    keys are ignored."""
    return {f.name: parameter_number(f.name, params[f.name], integer=isinstance(f.default, int))
            for f in fields(cls) if f.name in params}


def check_numbers(settings, what: str, lowest: Mapping[str, float]) -> None:
    """Every field of ``settings`` finite and > 0, or >= its entry in ``lowest``; the message names the field."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        low = lowest.get(f.name)
        if low is None and not value > 0:
            raise ValueError(f"{what} {f.name} must be > 0, got {value}")
        if low is not None and not value >= low:
            raise ValueError(f"{what} {f.name} must be >= {low}, got {value}")
        if not math.isfinite(value):
            raise ValueError(f"{what} {f.name} must be finite, got {value}")


class NumericSettings:
    """A dataclass of numbers, each a Triton config ``parameters`` entry, checked by its ``check``."""

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]):
        """Build from Triton config ``parameters`` (string values); unknown keys are ignored here."""
        settings = cls(**numbers_from_parameters(cls, params))
        settings.check()
        return settings

    def check(self) -> None:
        raise NotImplementedError


@dataclass
class RequestRules(NumericSettings):
    """What a client's request may be; each is a ``parameters`` entry of the cfm_solver config."""
    max_steps: int = 50
    max_guidance_rate: float = 10.0
    max_prompt_tokens: int = 500          # 20 s of prompt
    max_chunk_tokens: int = 1500
    max_request_bytes: int = 1 << 20      # all tensors of one request together

    def check(self) -> None:
        check_numbers(self, "request rule", lowest={})


@dataclass
class ChunkRequest:
    """One validated request. Prompt fields are set only on START."""
    speech_tokens: np.ndarray                       # (N,) int64
    start: bool
    end: bool
    prompt_tokens: Optional[np.ndarray] = None      # (Np,) int64
    prompt_mel: Optional[np.ndarray] = None         # (n_feats, 2 Np) float32, channels-major
    speaker_embedding: Optional[np.ndarray] = None  # (192,) float32
    n_timesteps: Optional[int] = None
    guidance_rate: Optional[float] = None
    seed: int = 0
    token_offset: Optional[int] = None              # the chunk's first token in the utterance (None: append)
    chunk_steps: Optional[int] = None               # this chunk's Euler steps (a replay's; None: the server's)
    resume: Optional[bytes] = None                  # START: the snapshot the stream goes on from
    voice: Optional[str] = None                     # START by a registered voice: its id (the prompt its tensors)


def _array(inputs: Mapping[str, np.ndarray], name: str, ndim: int) -> Optional[np.ndarray]:
    value = inputs.get(name)
    if value is None:
        return None
    value = np.asarray(value)
    want = INPUT_DTYPES[name]
    if value.dtype != want:
        raise RequestError(f"{name} must be {np.dtype(want).name}, got {value.dtype.name}")
    if value.ndim != ndim:
        raise RequestError(f"{name} must have {ndim} dimensions (batch first), got shape {list(value.shape)}")
    if value.shape[0] != 1:
        raise RequestError(f"{name} must have batch size 1 (one utterance per request), got {value.shape[0]}")
    return value[0]


def _scalar(inputs, name):
    value = _array(inputs, name, 2)
    if value is None:
        return None
    if value.size != 1:
        raise RequestError(f"{name} must hold one value, got shape {[1] + list(value.shape)}")
    return value.reshape(()).item()


def _tokens(name: str, tokens: np.ndarray) -> np.ndarray:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        bad = int(tokens.max()) if tokens.max() >= VOCAB_SIZE else int(tokens.min())
        raise RequestError(f"{name} must be in [0, {VOCAB_SIZE}), got {bad}")
    return tokens.astype(np.int64, copy=False)


def parse_request(inputs: Mapping[str, np.ndarray], *, start: bool, end: bool, rules: RequestRules,
                  n_feats: int = 80) -> ChunkRequest:
    """Validate one request's tensors; raise RequestError naming the bad value."""
    unknown = set(inputs) - set(INPUT_DTYPES)
    if unknown:
        raise RequestError(f"unknown input tensors: {sorted(unknown)}")
    size = sum(np.asarray(v).nbytes for v in inputs.values())
    if size > rules.max_request_bytes:
        raise RequestError(f"request holds {size} bytes, above the limit of {rules.max_request_bytes}")
    tokens = _array(inputs, "speech_tokens", 2)
    if tokens is None:
        raise RequestError("speech_tokens is required in every request")
    tokens = _tokens("speech_tokens", tokens)
    if tokens.size == 0 and not end:
        raise RequestError("speech_tokens is empty; an empty chunk is allowed only on the END request")
    if tokens.size > rules.max_chunk_tokens:
        raise RequestError(f"speech_tokens chunk has {tokens.size} tokens, above max_chunk_tokens "
                           f"{rules.max_chunk_tokens}")
    offset = _scalar(inputs, "token_offset")
    if offset is not None and offset < 0:
        raise RequestError(f"token_offset must be >= 0, got {offset}")
    chunk_steps = _scalar(inputs, "chunk_steps")
    if chunk_steps is not None and not 1 <= chunk_steps <= rules.max_steps:
        raise RequestError(f"chunk_steps must be in [1, {rules.max_steps}], got {chunk_steps}")
    req = ChunkRequest(speech_tokens=tokens, start=start, end=end, token_offset=None if offset is None else int(offset),
                       chunk_steps=None if chunk_steps is None else int(chunk_steps))
    if not start:
        given = [n for n in START_ONLY if n in inputs]
        if given:
            raise RequestError(f"{given} may only be sent with the sequence's START request")
        return req

    prompt = _array(inputs, "prompt_tokens", 2)
    mel = _array(inputs, "prompt_mel", 3)
    emb = _array(inputs, "speaker_embedding", 2)
    missing = [n for n, v in (("prompt_tokens", prompt), ("prompt_mel", mel), ("speaker_embedding", emb))
               if v is None]
    if missing:
        raise RequestError(f"the START request needs the speaker prompt: missing {missing}")
    prompt = _tokens("prompt_tokens", prompt)
    if not 1 <= prompt.size <= rules.max_prompt_tokens:
        raise RequestError(f"prompt_tokens must hold 1 to {rules.max_prompt_tokens} tokens, got {prompt.size}")
    if mel.shape != (2 * prompt.size, n_feats):
        raise RequestError(f"prompt_mel must have shape [1, {2 * prompt.size}, {n_feats}] "
                           f"(2 frames per prompt token, frames-major), got {[1] + list(mel.shape)}")
    if not np.isfinite(mel).all():
        raise RequestError(f"prompt_mel holds {int((~np.isfinite(mel)).sum())} NaN or Inf values")
    if emb.shape != (XVECTOR_DIM,):
        raise RequestError(f"speaker_embedding must have shape [1, {XVECTOR_DIM}], got {[1] + list(emb.shape)}")
    if not np.isfinite(emb).all():
        raise RequestError("speaker_embedding holds NaN or Inf values")
    if not np.any(emb):
        raise RequestError("speaker_embedding is all zeros (it is L2-normalised, so it needs a direction)")
    req.prompt_tokens, req.prompt_mel, req.speaker_embedding = prompt, np.ascontiguousarray(mel.T), emb

    steps = _scalar(inputs, "n_timesteps")
    if steps is not None and not 1 <= steps <= rules.max_steps:
        raise RequestError(f"n_timesteps must be in [1, {rules.max_steps}], got {steps}")
    rate = _scalar(inputs, "guidance_rate")
    if rate is not None and not (np.isfinite(rate) and 0.0 <= rate <= rules.max_guidance_rate):
        raise RequestError(f"guidance_rate must be in [0, {rules.max_guidance_rate}], got {rate}")
    seed = _scalar(inputs, "seed")
    if seed is not None and seed < 0:
        raise RequestError(f"seed must be >= 0, got {seed}")
    req.n_timesteps, req.guidance_rate = steps, rate
    req.seed = 0 if seed is None else int(seed)
    req.resume = _resume(inputs)
    if req.resume is None and req.token_offset:
        raise RequestError(f"token_offset of a START must be 0 (it is the utterance's first chunk), got "
                           f"{req.token_offset}; a resume START carries its snapshot in 'resume'")
    return req


def _resume(inputs) -> Optional[bytes]:
    """A START's ``resume`` snapshot (its seal and contents are the engine's to check), or None."""
    value = _array(inputs, "resume", 2)
    return None if value is None else (one_bytes(value, "resume") or None)


def one_bytes(value, name: str, limit: int = MAX_RESUME_BYTES) -> bytes:
    """The one BYTES element of a tensor (a snapshot passed between models, or a client's ``resume``); RequestError
    naming ``name`` when it holds more or other than that, or more than ``limit`` bytes."""
    value = np.asarray(value)
    if value.size != 1:
        raise RequestError(f"{name} must hold one BYTES element, got shape {list(value.shape)}")
    blob = value.reshape(-1)[0]
    if not isinstance(blob, bytes):
        raise RequestError(f"{name} must be BYTES, got {type(blob).__name__}")
    if len(blob) > limit:
        raise RequestError(f"{name} holds {len(blob)} bytes, above {limit}")
    return blob
