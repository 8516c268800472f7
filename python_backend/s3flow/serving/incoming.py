"""A request as the solver's models receive it, read and refused alike by the solver and by admission.

``parse_incoming`` is the one reading of a request (a voice id replaced by its prompt, then
``s3flow.protocol.parse_request``), ``refusal`` the one mapping of a refused request to its code and disposition
(the refusals' rows of ``s3flow.serving.session``'s table). Admission (``s3flow.serving.admission``) runs in a stub
of its own ahead of the solver and needs nothing else of the session: this module imports no torch, so that stub
starts sooner and holds less memory.

Example::

    req = parse_incoming(Incoming(corr_id=7, start=True, end=False, inputs=tensors), RequestRules(), n_feats=80)
    outcome = refused(7, "sequence 7: the server is draining", Draining())   # code UNAVAILABLE, resume
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

import numpy as np

from s3flow_contract.answers import Answer, Disposition
from s3flow_contract.tensors import PROMPT, VOICE_ID
from s3flow.engine.snapshot import SnapshotError
from s3flow.protocol import ChunkRequest, RequestError, RequestRules, ServerBusy, UnknownSequence, parse_request
from s3flow.serving.responses import INVALID_ARG, UNAVAILABLE
from s3flow.serving.voice_registry import UnknownVoice

if TYPE_CHECKING:
    from s3flow.engine.chunk import ChunkResult


class Draining(ServerBusy):
    """A START while the server drains: it belongs on another server (disposition ``resume``)."""

    def __init__(self, message: str = "the server is draining (shutting down) and takes no new sequences; "
                                      "send the START to another server"):
        super().__init__(message)


class Closing(ServerBusy):
    """Any chunk once the server closes (its drain is over, or it stops): the utterance goes on elsewhere."""


@dataclass
class Incoming:
    """One request as the model received it: controls, input tensors, a cancellation probe, and the way its one
    answer goes out (``send``: the model's response sender; None where the caller takes the outcome itself)."""
    corr_id: int
    start: bool
    end: bool
    inputs: Mapping[str, np.ndarray]
    ready: bool = True                                 # False: an empty slot of the direct strategy
    tenant: str = ""                                   # whose voices a START may name (docs/security.md)
    is_cancelled: Callable[[], bool] = field(default=lambda: False)
    to_vocoder: bool = False                           # its answer goes on to the vocoder (token2wav)
    send: Optional[Callable[["Outcome"], None]] = None
    arrived: float = 0.0                               # when execute took it (the solver's book's clock)


@dataclass
class Outcome:
    """The answer to one request: a result, an error with its code and disposition (``answer``), or nothing
    (an empty slot)."""
    result: Optional[ChunkResult] = None
    error: Optional[str] = None
    code: Optional[str] = None
    answer: Optional[Answer] = None
    reason: Optional[str] = None    # a refusal's kind (admission's metric label: s3flow.serving.admission)


def failed_outcome(corr_id, message: str, code: str, disposition: Disposition, **extra) -> Outcome:
    return Outcome(error=message, code=code, answer=Answer(disposition, sequence=int(corr_id), **extra))


def refusal(exc: RequestError) -> tuple[str, Disposition, dict]:
    """(code, disposition, the answer's other fields) of a request refused with ``exc``: the refusals' rows of
    the module's table, for the solver and for admission alike."""
    if isinstance(exc, (Draining, Closing)):    # the utterance goes on another server
        return UNAVAILABLE, Disposition.RESUME, {}
    if isinstance(exc, ServerBusy):             # full: START again later
        return UNAVAILABLE, Disposition.BUSY, {"retry_after_s": exc.retry_after_s}
    if isinstance(exc, UnknownSequence):
        return INVALID_ARG, Disposition.RESUME, {}
    if isinstance(exc, UnknownVoice):
        return INVALID_ARG, Disposition.RETRY, {"resend": "prompt"}
    if isinstance(exc, SnapshotError):
        return INVALID_ARG, Disposition.RETRY, {"resend": "replay"}
    return INVALID_ARG, Disposition.FAIL, {}


def naming_sequence(corr_id, exc: RequestError) -> str:
    """``exc``'s message led by the sequence it concerns, unless it names it already."""
    text = str(exc)
    return text if text.startswith("sequence ") else f"sequence {corr_id}: {text}"


def refused(corr_id, message: str, exc: RequestError, reason: Optional[str] = None) -> Outcome:
    """The answer to a request refused with ``exc`` (:func:`refusal`), saying ``message``; ``reason``: admission's
    label for it."""
    code, disposition, extra = refusal(exc)
    outcome = failed_outcome(corr_id, message, code, disposition, **extra)
    outcome.reason = reason
    return outcome


def with_voice(inputs: Mapping[str, np.ndarray], start: bool,
               voices: Optional[Callable[[str, str], dict]], tenant: str = "") -> tuple[Mapping[str, np.ndarray],
                                                                                        Optional[str]]:
    """The request's tensors with a ``voice_id`` replaced by that voice's prompt tensors (``voices(voice_id)``
    gives them, or raises ``UnknownVoice``), and that id; unchanged and None without one. RequestError for a
    misplaced id."""
    if VOICE_ID not in inputs:
        return inputs, None
    raw = np.asarray(inputs[VOICE_ID])
    if not start:
        raise RequestError(f"{VOICE_ID} may only be sent with the sequence's START request")
    if raw.size != 1 or raw.dtype != np.object_:
        raise RequestError(f"{VOICE_ID} must be one string (BYTES), got {raw.dtype.name} shape {list(raw.shape)}")
    both = [n for n in PROMPT if n in inputs]
    if both:
        raise RequestError(f"send either {VOICE_ID} or the speaker prompt, not both (got {VOICE_ID} and {both})")
    if voices is None:
        raise RequestError(f"{VOICE_ID} given, but this server has no voice registry (no voice_encoder model)")
    value = raw.reshape(-1)[0]
    voice_id = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return {**{k: v for k, v in inputs.items() if k != VOICE_ID}, **voices(voice_id, tenant)}, voice_id


def parse_incoming(req: Incoming, rules: RequestRules, n_feats: int,
                   voices: Optional[Callable[[str, str], dict]] = None) -> ChunkRequest:
    """Validate one request, a voice id replaced by its prompt first (:func:`with_voice`): the solver's and
    admission's one reading of a request. RequestError (``UnknownVoice`` among them) naming the bad value."""
    inputs, voice_id = with_voice(req.inputs, req.start, voices, req.tenant)
    parsed = parse_request(inputs, start=req.start, end=req.end, rules=rules, n_feats=n_feats)
    parsed.voice = voice_id
    return parsed
