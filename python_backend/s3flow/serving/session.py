"""The solver's session layer: one ``execute`` batch of sequence requests in, one outcome per request out.

Everything between Triton's tensors and the streaming engine that is not Triton glue lives here, so it is
unit-tested with fake models and no server: skipping the empty slots of the ``direct`` strategy,
validation (``protocol.parse_request``), admission, running the batch, cancellation, dropping a sequence's
state (END, a bad END request, cancellation, idle) and mapping failures to error codes:

=====================================  ===========  ==================================================
what happened                          code         the sequence's state
=====================================  ===========  ==================================================
the request is invalid                 INVALID_ARG  unchanged (dropped when it was the END request)
a START while full or draining         UNAVAILABLE  none made: the message says when to send the START
                                                    again (full) or to send it to another server
the encoder or estimator call failed   UNAVAILABLE  as before the chunk: the client may send it again;
                                                    dropped when it was the END request (Triton ends
                                                    the sequence at END whatever the answer)
any other failure in the solve         INTERNAL     dropped: the client must restart the utterance
every request of the batch cancelled   CANCELLED    dropped (the client has gone)
=====================================  ===========  ==================================================

Example::

    session = SolverSession(engine, on_drop=lambda corr_id, reason: ...)
    outcomes = session.handle([Incoming(corr_id=7, start=True, end=False, inputs=tensors)])
    outcomes[0].result.mel, outcomes[0].error, outcomes[0].code
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import numpy as np

from s3flow.contract import PROMPT
from s3flow.protocol import VOICE_ID, RequestError, ServerBusy, parse_request
from s3flow.engine.streaming import Chunk, ChunkResult, StreamingEngine
from s3flow.serving.responses import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE  # noqa: F401 (re-exported)


class Cancelled(RuntimeError):
    """Every request of the batch was cancelled by its client."""


class ModelCallError(RuntimeError):
    """A call to another model (the encoder or the estimator) failed; the message names the model."""


@dataclass
class Incoming:
    """One request as the model received it: controls, input tensors, and a cancellation probe."""
    corr_id: int
    start: bool
    end: bool
    inputs: Mapping[str, np.ndarray]
    ready: bool = True                                 # False: an empty slot of the direct strategy
    is_cancelled: Callable[[], bool] = field(default=lambda: False)


@dataclass
class Outcome:
    """The answer to one request: a result, an error with its code, or nothing (an empty slot)."""
    result: Optional[ChunkResult] = None
    error: Optional[str] = None
    code: Optional[str] = None


class SolverSession:
    """Runs batches of requests through a ``StreamingEngine``.

    ``on_drop(corr_id, reason)`` is called for each state dropped before its END (for logs and metrics):
    reasons ``invalid END request``, ``cancelled``, ``idle``, ``failed END``, ``failed START``, ``error``,
    ``replaced by a new START`` (a START on a live id restarts that utterance: the old state goes).

    ``draining()`` True refuses new sequences (START) while the ones in flight go on (``s3flow.serving.drain``).
    ``voices(voice_id)`` gives a registered voice's prompt tensors for a START that names one
    (``s3flow.serving.voice_registry.VoiceRegistry.get``), or raises RequestError.
    """

    def __init__(self, engine: StreamingEngine, on_drop: Callable[[object, str], None] = lambda c, r: None,
                 name: str = "cfm_solver", draining: Callable[[], bool] = lambda: False,
                 voices: Optional[Callable[[str], dict]] = None):
        self.engine, self.on_drop, self.name, self.draining = engine, on_drop, name, draining
        self.voices = voices

    def _with_voice(self, req: Incoming) -> Mapping[str, np.ndarray]:
        """The request's tensors with a ``voice_id`` replaced by that voice's prompt tensors."""
        if VOICE_ID not in req.inputs:
            return req.inputs
        raw = np.asarray(req.inputs[VOICE_ID])
        if not req.start:
            raise RequestError(f"{VOICE_ID} may only be sent with the sequence's START request")
        if raw.size != 1 or raw.dtype != np.object_:
            raise RequestError(f"{VOICE_ID} must be one string (BYTES), got {raw.dtype.name} shape {list(raw.shape)}")
        both = [n for n in PROMPT if n in req.inputs]
        if both:
            raise RequestError(f"send either {VOICE_ID} or the speaker prompt, not both (got {VOICE_ID} and {both})")
        if self.voices is None:
            raise RequestError(f"{VOICE_ID} given, but this server has no voice registry (no voice_encoder model)")
        value = raw.reshape(-1)[0]
        voice_id = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return {**{k: v for k, v in req.inputs.items() if k != VOICE_ID}, **self.voices(voice_id)}

    @property
    def live(self) -> int:
        return len(self.engine.store)

    def evict_idle(self) -> list:
        gone = self.engine.store.evict_idle()
        for corr_id in gone:
            self.on_drop(corr_id, "idle")
        return gone

    def _drop(self, corr_id, reason: str) -> None:
        self.engine.store.drop(corr_id)
        self.on_drop(corr_id, reason)

    def handle(self, requests: list[Incoming]) -> list[Outcome]:
        self.evict_idle()
        out = [Outcome() for _ in requests]
        chunks: list[Chunk] = []
        where: list[int] = []
        for i, req in enumerate(requests):
            if not req.ready:
                continue
            try:
                parsed = parse_request(self._with_voice(req), start=req.start, end=req.end, limits=self.engine.limits,
                                       n_feats=self.engine.n_feats)
                if req.start and self.draining():
                    raise ServerBusy("the server is draining (shutting down) and takes no new sequences; "
                                     "send the START to another server")
                chunks.append(self.engine.admit(req.corr_id, parsed))
                where.append(i)
            except ServerBusy as exc:
                out[i] = Outcome(error=f"{self.name}: sequence {req.corr_id}: {exc}", code=UNAVAILABLE)
            except RequestError as exc:
                if req.end and req.corr_id in self.engine.store:
                    self._drop(req.corr_id, "invalid END request")
                msg = str(exc) if str(exc).startswith("sequence ") else f"sequence {req.corr_id}: {exc}"
                out[i] = Outcome(error=msg, code=INVALID_ARG)
        if not chunks:
            return out
        live = [requests[i] for i in where]

        def check_cancelled(step: int) -> None:
            # Stop early only when every request of the batch is gone; a cancelled one among live ones
            # rides along to the end of this chunk and is dropped below.
            if all(r.is_cancelled() for r in live):
                raise Cancelled(f"cancelled by the client before Euler step {step}")

        try:
            results = self.engine.run(chunks, on_step=check_cancelled)
        except Cancelled as exc:
            for c, i in zip(chunks, where):
                self._drop(c.corr_id, "cancelled")
                out[i] = Outcome(error=f"{self.name}: sequence {c.corr_id}: {exc}", code=CANCELLED)
            return out
        except ModelCallError as exc:
            for c, i in zip(chunks, where):
                if c.new:  # the engine dropped the state it had made (and put back any it replaced)
                    self.on_drop(c.corr_id, "failed START")
                    then = "send the START again"
                elif c.finalize:
                    self._drop(c.corr_id, "failed END")
                    then = "the END request ends the sequence: restart the utterance"
                else:
                    then = "the sequence is as before this chunk: send it again"
                out[i] = Outcome(error=f"{self.name}: sequence {c.corr_id}: {exc}; {then}", code=UNAVAILABLE)
            return out
        except Exception as exc:  # a bug, not a passing outage: retrying would fail the same way
            for c, i in zip(chunks, where):
                self._drop(c.corr_id, "error")
                out[i] = Outcome(error=f"{self.name}: sequence {c.corr_id}: {type(exc).__name__}: {exc}; "
                                       f"the sequence is ended", code=INTERNAL)
            return out
        for c, i, result in zip(chunks, where, results):
            if c.replaced is not None:  # a START on a live id restarted that utterance: say so, count it
                self.on_drop(c.corr_id, "replaced by a new START")
            if not c.finalize and requests[i].is_cancelled():
                self._drop(c.corr_id, "cancelled")
            out[i] = Outcome(result=result)
        return out
