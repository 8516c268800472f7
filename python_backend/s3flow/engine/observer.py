"""What the streaming engine reports as it works, for metrics, logs and (later) a scheduler.

The engine calls an :class:`Observer`; nothing replaces or wraps an engine method to watch it. Every
method has a default that does nothing, so an observer implements only what it needs:

* ``estimator_step(sequences, rows, frames)``: one estimator call ran: ``sequences`` utterances solved
  together, ``rows`` batch rows (twice the sequences with classifier-free guidance), ``frames`` the padded
  length;
* ``estimator_timed(rows, frames, seconds, past)``, ``encoder_timed(tokens, seconds)``: after each estimator
  (encoder) call, how long it took for its size (``past``: the padded frames of the prefix cache each row read, 0
  for none; ``s3flow.engine.capacity`` fits the costs from them);
* ``chunk_work(corr_id, work)``: what an answered chunk cost (``s3flow.engine.capacity.Work``);
* ``worked(seconds, streams)``: the instance was busy this long (a step-loop iteration; the FIFO solver reports
  each execute itself) holding ``streams`` streams, and made the chunks answered since the last report;
* ``chunk_answered(corr_id, start, nfe, frames, delivered)``: a chunk's solve succeeded and its newly final
  ``frames`` go out; ``nfe`` its network evaluations (steps, x2 with guidance); ``start`` whether it was a START;
  ``delivered`` what the answer did to its stream's playback clock (``s3flow.engine.playback.Delivered``: the
  lead just before it, kept by the sequence table);
* ``fewer_steps(corr_id, full, steps)``: the deadline scheduler gave a late chunk ``steps`` Euler steps instead of
  its stream's ``full`` (``s3flow.engine.step_loop``);
* ``sequence_dropped(corr_id, reason)``: a sequence's state went before its END
  (``s3flow.engine.sequences.DROP_REASONS``);
* ``sequence_ended(corr_id)``: a sequence's END was answered and its state went (the one place a model learns
  that a stream ended; ``s3flow.engine.sequences.SequenceTable.commit``).

Example::

    class Counting(Observer):
        def __init__(self):
            self.steps = 0
        def estimator_step(self, sequences, rows, frames):
            self.steps += 1
    engine = StreamingEngine(encode, estimator, ..., observer=Counting())
"""
from __future__ import annotations

from s3flow.engine.playback import Delivered

NOT_FOLLOWED = Delivered()


class Observer:
    """Receives the engine's reports (see the module docstring); the defaults ignore them."""

    def estimator_step(self, sequences: int, rows: int, frames: int) -> None:
        pass

    def estimator_timed(self, rows: int, frames: int, seconds: float, past: int = 0) -> None:
        pass

    def encoder_timed(self, tokens: int, seconds: float) -> None:
        pass

    def chunk_work(self, corr_id, work) -> None:
        pass

    def chunk_answered(self, corr_id, start: bool, nfe: int, frames: int,
                       delivered: Delivered = NOT_FOLLOWED) -> None:
        pass

    def fewer_steps(self, corr_id, full: int, steps: int) -> None:
        """The scheduler gave a late chunk ``steps`` Euler steps instead of its stream's ``full``."""

    def worked(self, seconds: float, streams: int = 0) -> None:
        pass

    def sequence_dropped(self, corr_id, reason: str) -> None:
        pass

    def sequence_ended(self, corr_id) -> None:
        pass


class Observers(Observer):
    """Several observers as one (each gets every report, in order)."""

    def __init__(self, *observers: Observer):
        self.observers = observers

    def estimator_step(self, sequences: int, rows: int, frames: int) -> None:
        for o in self.observers:
            o.estimator_step(sequences, rows, frames)

    def estimator_timed(self, rows: int, frames: int, seconds: float, past: int = 0) -> None:
        for o in self.observers:
            o.estimator_timed(rows, frames, seconds, past)

    def encoder_timed(self, tokens: int, seconds: float) -> None:
        for o in self.observers:
            o.encoder_timed(tokens, seconds)

    def chunk_work(self, corr_id, work) -> None:
        for o in self.observers:
            o.chunk_work(corr_id, work)

    def chunk_answered(self, corr_id, start: bool, nfe: int, frames: int,
                       delivered: Delivered = NOT_FOLLOWED) -> None:
        for o in self.observers:
            o.chunk_answered(corr_id, start, nfe, frames, delivered)

    def fewer_steps(self, corr_id, full: int, steps: int) -> None:
        for o in self.observers:
            o.fewer_steps(corr_id, full, steps)

    def worked(self, seconds: float, streams: int = 0) -> None:
        for o in self.observers:
            o.worked(seconds, streams)

    def sequence_dropped(self, corr_id, reason: str) -> None:
        for o in self.observers:
            o.sequence_dropped(corr_id, reason)

    def sequence_ended(self, corr_id) -> None:
        for o in self.observers:
            o.sequence_ended(corr_id)


NO_OBSERVER = Observer()
