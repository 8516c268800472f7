"""The one owner of a stateful model's sequences: begin, serve a chunk, commit or roll back, end, evict.

Triton's sequence batcher routes each utterance's chunks (one correlation id) to one model instance, but it
drops an idle sequence without telling the model, so the model keeps its per-sequence state itself. Both
stateful models (the solver's ``StreamingEngine`` and the vocoder) keep it in a :class:`SequenceTable`:

=====================  ==========================================================================
call                   what it does to the sequence
=====================  ==========================================================================
``begin(id, state)``   a START: the state is stored and *in flight*; a START on a live id restarts the
                       utterance (the old state is returned, to be put back if this chunk fails)
``serve(id)``          a later chunk: the state, now in flight (``UnknownSequence`` if there is none; a
                       sequence already in flight is refused: its chunks are served in order)
``commit(id, end)``    the chunk was answered: its idle time counts from now; END ends the sequence (the
                       observer hears ``sequence_ended``)
``rollback(id, old)``  the chunk failed: a START's new state goes (``old`` back in its place); a later
                       chunk's state stays as it was
``end(id, reason)``    the state goes before its END (bad request, cancelled, error, ...)
``end_all(reason)``    every state not in flight goes (the server is stopping)
``evict_idle()``       states whose last answer is ``idle_timeout_s`` old go; never one in flight, nor
                       one with a chunk on its way (``pending``)
=====================  ==========================================================================

A state is changed only by the code that holds it in flight (the engine, between ``serve`` and
``commit``); the table's own lock makes its book-keeping safe beside an idle reaper thread, and a chunk being
served is never evicted under it. Every state that goes before its END is reported to the observer's
``sequence_dropped(corr_id, reason)`` (``s3flow.engine.observer``), the reasons being ``DROP_REASONS``.

Example::

    table = SequenceTable(Capacity(max_live_sequences=64, idle_timeout_s=5.0), observer)
    old = table.begin(7, state)          # START
    ...                                  # solve the chunk with state
    table.commit(7, end=False)           # or table.rollback(7, old) when the solve failed
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

from s3flow.engine.observer import NO_OBSERVER, Observer
from s3flow.protocol import NumericSettings, RequestError, ServerBusy, UnknownSequence, check_numbers

State = TypeVar("State")

#: Why a state went before its END (the ``reason`` label of ``s3flow_sequences_dropped_total``).
DROP_REASONS = ("idle", "cancelled", "invalid END request", "failed START", "failed END", "error",
                "replaced by a new START", "utterance too long", "broken stream", "server stopping")


@dataclass
class Capacity(NumericSettings):
    """What a stateful model holds: at most ``max_live_sequences`` states per instance (at most the batcher's
    ``max_candidate_sequences``); a state whose client has been quiet for ``idle_timeout_s`` seconds (counted
    from its last answer, never while one of its chunks is being served; Triton's own grace comes on top) is
    reclaimed. Admission refuses a START that would take the server's utilization (its live streams' demand
    of the device, ``s3flow.engine.capacity``) above ``utilization_target`` (0: no such check), and tells it to
    come back when enough streams of ``expected_utterance_s`` of audio have ended (``s3flow.serving.load``).
    Each is a ``parameters`` entry of the model's config."""
    max_live_sequences: int = 64
    idle_timeout_s: float = 5.0
    utilization_target: float = 0.9
    expected_utterance_s: float = 5.0      # a sentence: what a START is planned at, and how long streams last

    def check(self) -> None:
        check_numbers(self, "capacity", lowest={"utilization_target": 0})


class SequenceTable(Generic[State]):
    """States keyed by correlation id (see the module docstring)."""

    def __init__(self, capacity: Capacity, observer: Observer = NO_OBSERVER,
                 clock: Callable[[], float] = time.monotonic,
                 pending: Optional[Callable[[object], bool]] = None):
        """``pending(corr_id)``: whether a chunk of the sequence is on its way to the table: such a sequence is
        not idle however old its last answer (the solver: a request admission let through that has not reached
        it yet; the vocoder: a sequence the solver still holds; ``s3flow.serving.arrivals``)."""
        self.capacity, self.observer, self.clock = capacity, observer, clock
        self.pending = pending
        self._states: OrderedDict[object, State] = OrderedDict()
        self._answered: dict[object, float] = {}     # corr_id -> time of its last answer
        self._in_flight: set = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, corr_id) -> bool:
        return corr_id in self._states

    def ids(self) -> list:
        """The correlation ids held."""
        with self._lock:
            return list(self._states)

    def peek(self, corr_id) -> Optional[State]:
        """The state, if any, without serving it (tests, tools)."""
        return self._states.get(corr_id)

    def begin(self, corr_id, state: State) -> Optional[State]:
        """A START: store ``state`` in flight; return the live state it replaces, or None. Raises ServerBusy
        (with the seconds until a slot frees) when the table is full."""
        with self._lock:
            old = self._states.pop(corr_id, None)
            if len(self._states) >= self.capacity.max_live_sequences:  # (never when it replaces one)
                if old is not None:
                    self._states[corr_id] = old
                wait = self._next_eviction_s()
                raise ServerBusy(f"too many live sequences ({len(self._states)}, max_live_sequences "
                                 f"{self.capacity.max_live_sequences}); retry in {wait:.1f} s", retry_after_s=wait)
            self._states[corr_id] = state
            self._answered[corr_id] = self.clock()
            self._in_flight.add(corr_id)
            return old

    def serve(self, corr_id) -> State:
        """A later chunk's state, in flight until ``commit`` or ``rollback``."""
        with self._lock:
            state = self._states.get(corr_id)
            if state is None:
                raise UnknownSequence(f"sequence {corr_id} is not active: it never started with a START request, "
                                   f"already ended, or was evicted after {self.capacity.idle_timeout_s} s idle")
            if corr_id in self._in_flight:   # a caller that serves a sequence's chunks in order never gets here
                raise RequestError(f"sequence {corr_id} already has a chunk in flight: send its chunks one at a time")
            self._states.move_to_end(corr_id)
            self._in_flight.add(corr_id)
            return state

    def commit(self, corr_id, end: bool) -> None:
        """The chunk was answered: END ends the sequence, otherwise its idle time counts from now."""
        with self._lock:
            self._in_flight.discard(corr_id)
            ended = end and self._pop(corr_id)
            if not end and corr_id in self._states:
                self._answered[corr_id] = self.clock()
        if ended:
            self.observer.sequence_ended(corr_id)

    def rollback(self, corr_id, replaced: Optional[State], started: bool) -> None:
        """The chunk failed: a START's state goes and ``replaced`` (the state it replaced) comes back; a
        later chunk's state stays as it was before the chunk."""
        with self._lock:
            self._in_flight.discard(corr_id)
            if started:
                self._pop(corr_id)
                if replaced is not None:
                    self._states[corr_id] = replaced
                    self._answered[corr_id] = self.clock()

    def end(self, corr_id, reason: str) -> bool:
        """Drop the state before its END for ``reason`` (one of ``DROP_REASONS``); True if there was one."""
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; one of {DROP_REASONS}")
        with self._lock:
            self._in_flight.discard(corr_id)
            had = self._pop(corr_id)
        if had:
            self.observer.sequence_dropped(corr_id, reason)
        return had

    def end_all(self, reason: str) -> list:
        """Drop every state not in flight for ``reason`` (the server is stopping); returns their ids (those in
        flight go at a later call, once answered)."""
        with self._lock:
            gone = [c for c in self._states if c not in self._in_flight]
        return [c for c in gone if self.end(c, reason)]

    def evict_idle(self) -> list:
        """Reclaim the states not in flight whose last answer is more than ``idle_timeout_s`` old and that
        have no chunk waiting in the queue (``waiting``)."""
        with self._lock:
            now = self.clock()
            gone = [c for c, t in self._answered.items()
                    if c not in self._in_flight and now - t > self.capacity.idle_timeout_s and not self._queued(c)]
            for corr_id in gone:
                self._pop(corr_id)
        for corr_id in gone:
            self.observer.sequence_dropped(corr_id, "idle")
        return gone

    def next_eviction_s(self) -> float:
        """Seconds until the least recently answered state goes idle (the earliest a full table has room)."""
        with self._lock:
            return self._next_eviction_s()

    def _next_eviction_s(self) -> float:
        idle = [t for c, t in self._answered.items() if c not in self._in_flight]
        if not idle:
            return self.capacity.idle_timeout_s + 0.1
        return max(0.0, min(idle) + self.capacity.idle_timeout_s - self.clock()) + 0.1

    def _queued(self, corr_id) -> bool:
        return self.pending is not None and self.pending(corr_id)

    def _pop(self, corr_id) -> bool:
        self._answered.pop(corr_id, None)
        return self._states.pop(corr_id, None) is not None
