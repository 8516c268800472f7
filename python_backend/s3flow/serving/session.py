"""The solver's session layer: one ``execute`` batch of sequence requests in, one outcome per request out.

Everything between Triton's tensors and the streaming engine that is not Triton glue lives here, so it is
unit-tested with fake models and no server: skipping the empty slots of the ``direct`` strategy,
validation (``protocol.parse_request``), admission, running the batch, cancellation, dropping a sequence's
state (END, a bad END request, cancellation, idle) and mapping failures to error codes:

===================================  ===========  ===========  =============================================
what happened                        code         disposition  the sequence's state
===================================  ===========  ===========  =============================================
the request is invalid               INVALID_ARG  fail         unchanged (dropped when it was the END request)
a chunk of a sequence not held here  INVALID_ARG  resume       none (never started, ended, or evicted)
a START naming a voice not held      INVALID_ARG  retry,       none made: START again with the speaker
                                                  resend=      prompt itself
                                                  prompt
a resume START whose snapshot        INVALID_ARG  retry,       none made: START again without it and
cannot be used here                               resend=      replay the answered chunks
                                                  replay
the chunk the sequence took last,    (its answer again)        unchanged
sent again (same token_offset)
a START while full                   UNAVAILABLE  busy         none made; ``retry_after_s`` says when
a START while draining               UNAVAILABLE  resume       none made: START on another server
any chunk while the server closes    UNAVAILABLE  resume       dropped: resume on another server
the encoder or estimator call        UNAVAILABLE  retry        as before the chunk: send it again
failed                                            (resume at   (the END request: dropped, Triton ends the
                                                  END)         sequence at END whatever the answer)
any other failure in the solve       INTERNAL     fail         dropped
every request of the batch           CANCELLED    fail         dropped (the client has gone)
cancelled
===================================  ===========  ===========  =============================================

The disposition travels as the message's tag (``s3flow_contract.answers``, written by
``s3flow.serving.responses.error_response``), so a client acts on data, not on the wording. The refusals (the
rows down to "a START while draining") are one mapping, ``s3flow.serving.incoming.refusal``, which admission
(``s3flow.serving.admission``) answers by too, and both read a request by ``incoming.parse_incoming``.

Every state that goes before its END is reported to the engine's observer (``sequence_dropped``), by the
engine's ``SequenceTable``.

Example::

    session = SolverSession(engine, RequestRules())
    outcomes = session.handle([Incoming(corr_id=7, start=True, end=False, inputs=tensors)])
    outcomes[0].result.mel, outcomes[0].error, outcomes[0].code
"""
from __future__ import annotations

from typing import Callable, Optional

from s3flow_contract.answers import Disposition
from s3flow.engine.snapshot import SnapshotError
from s3flow.protocol import RequestError, RequestRules, ServerBusy
from s3flow.serving.incoming import (Closing, Draining, Incoming, Outcome, failed_outcome, naming_sequence,
                                     parse_incoming, refused)
from s3flow.engine.step_loop import Flight, StepCancelled
from s3flow.engine.chunk import Chunk, ChunkResult
from s3flow.engine.streaming import StreamingEngine
from s3flow.serving.responses import CANCELLED, INTERNAL, UNAVAILABLE


class ModelCallError(RuntimeError):
    """A call to another model (the encoder or the estimator) failed; the message names the model."""


class SolverSession:
    """Runs batches of requests through a ``StreamingEngine``, validating them by ``rules``.

    ``draining()`` True refuses new sequences (START) while the ones in flight go on (``s3flow.server.drain``);
    ``closing()`` True refuses every chunk and drops its sequence (the idle reaper drops the rest).
    ``voices(voice_id, tenant)`` gives a registered voice's prompt tensors for a START that names one
    (``s3flow.serving.voice_registry.VoiceRegistry.get``), or raises RequestError.
    """

    def __init__(self, engine: StreamingEngine, rules: RequestRules = RequestRules(), name: str = "cfm_solver",
                 draining: Callable[[], bool] = lambda: False, voices: Optional[Callable[[str, str], dict]] = None,
                 closing: Callable[[], bool] = lambda: False):
        self.engine, self.rules, self.name, self.draining, self.closing = engine, rules, name, draining, closing
        self.voices = voices

    @property
    def live(self) -> int:
        return len(self.engine.sequences)

    def evict_idle(self) -> list:
        return self.engine.sequences.evict_idle()

    def cancel(self, corr_id) -> bool:
        """End a live sequence at once (its client went away); True if there was one."""
        return self.engine.sequences.end(corr_id, "cancelled")

    def _drop(self, corr_id, reason: str) -> None:
        self.engine.sequences.end(corr_id, reason)

    def _gone(self, chunk: Chunk, reason: str) -> None:
        """A chunk failed and the sequence ends for ``reason``: a START's state is already gone (the engine
        rolled it back), so only the report is left to make; a later chunk's state is dropped."""
        if chunk.started:
            self.engine.observer.sequence_dropped(chunk.corr_id, reason)
        else:
            self._drop(chunk.corr_id, reason)

    def admit(self, req: Incoming) -> tuple[Optional[Chunk], Optional[Outcome]]:
        """Validate one request and admit its chunk (its sequence's state now in flight): (chunk, None), or
        (None, its outcome already: the refusal with its code and disposition, or the answer again to a chunk
        sent again)."""
        try:
            parsed = parse_incoming(req, self.rules, self.engine.n_feats, self.voices)
            if self.closing():
                raise Closing("the server is stopping; resume the utterance on another server")
            if req.start and self.draining():
                raise Draining()
            admitted = self.engine.admit(req.corr_id, parsed, tenant=req.tenant)
            if isinstance(admitted, ChunkResult):   # the chunk taken last, sent again: its answer again
                return None, Outcome(result=admitted)
            return admitted, None
        except RequestError as exc:   # refused (``refusal``); closing drops the sequence, and so does a bad END
            if isinstance(exc, Closing):
                self._drop(req.corr_id, "server stopping")
            elif req.end and not isinstance(exc, ServerBusy):
                self._drop(req.corr_id, "invalid END request")
            elif req.start and not req.end and req.corr_id not in self.engine.sequences:
                # no state was made, but Triton holds the START's sequence slot until an END or its idle window
                # (a forged snapshot's START made a server's stop wait its whole exit timeout): give it back
                self.engine.observer.sequence_dropped(req.corr_id, "failed START")
            return None, refused(req.corr_id, self._refusal_message(req.corr_id, exc), exc)

    def _refusal_message(self, corr_id, exc: RequestError) -> str:
        """A busy server names itself; a refused snapshot says what to do instead."""
        if isinstance(exc, ServerBusy):
            return f"{self.name}: sequence {corr_id}: {exc}"
        if isinstance(exc, SnapshotError):
            return f"{naming_sequence(corr_id, exc)}; START again without it and replay the utterance"
        return naming_sequence(corr_id, exc)

    def failed(self, c: Chunk, exc: BaseException) -> Outcome:
        """The answer to a chunk whose solve failed with ``exc`` (the engine rolled it back already), the
        sequence's end reported or made where the failure ends it: the one mapping of causes to answers."""
        if isinstance(exc, StepCancelled):
            self._gone(c, "cancelled")
            return failed_outcome(c.corr_id, f"{self.name}: sequence {c.corr_id}: {exc}", CANCELLED, Disposition.FAIL)
        if isinstance(exc, ModelCallError):
            disposition = Disposition.RETRY
            if c.started:  # the engine rolled back: the state it made went (any it replaced is back)
                self._gone(c, "failed START")
                then = "send the START again"
            elif c.finalize:
                self._drop(c.corr_id, "failed END")
                then, disposition = "the END request ends the sequence: restart the utterance", Disposition.RESUME
            else:
                then = "the sequence is as before this chunk: send it again"
            return failed_outcome(c.corr_id, f"{self.name}: sequence {c.corr_id}: {exc}; {then}", UNAVAILABLE, disposition)
        # a bug, not a passing outage: retrying would fail the same way
        self._gone(c, "error")
        return failed_outcome(c.corr_id, f"{self.name}: sequence {c.corr_id}: {type(exc).__name__}: {exc}; "
                                  f"the sequence is ended", INTERNAL, Disposition.FAIL)

    def done(self, d: Flight, is_cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        """The answer to a chunk the step loop finished (its ``s3flow.engine.step_loop.Flight``, answered)."""
        if d.cause is not None:
            return self.failed(d.chunk, d.cause)
        if not d.chunk.finalize and is_cancelled():
            self._drop(d.chunk.corr_id, "cancelled")
        return Outcome(result=d.result)

    def handle(self, requests: list[Incoming]) -> list[Outcome]:
        """One batch (the ``fifo`` scheduling): admit every request, solve the admitted chunks whole together
        (``StreamingEngine.solve``: the one loop, every chunk in every step), answer each."""
        self.evict_idle()
        out = [Outcome() for _ in requests]
        chunks: list[Chunk] = []
        where: list[int] = []
        try:
            for i, req in enumerate(requests):
                if not req.ready:
                    continue
                chunk, answered = self.admit(req)
                if answered is not None:   # refused, or a chunk sent again answered again
                    out[i] = answered
                    continue
                chunks.append(chunk)
                where.append(i)
        except BaseException:  # a bug while admitting: no admitted chunk may stay in flight
            for c in chunks:
                self.engine.sequences.rollback(c.corr_id, c.replaced, started=c.started)
            raise
        if not chunks:
            return out
        live = [requests[i] for i in where]

        def all_cancelled() -> bool:
            # Stop early only when every request of the batch is gone; a cancelled one among live ones
            # rides along to the end of this chunk and is dropped (``done``).
            return all(r.is_cancelled() for r in live)

        for i, d in zip(where, self.engine.solve(chunks, is_cancelled=all_cancelled)):
            out[i] = self.done(d, requests[i].is_cancelled)
        return out
