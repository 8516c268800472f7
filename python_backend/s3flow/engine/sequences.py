"""The one owner of a stateful model's sequences: begin, serve a chunk, commit or roll back, end, evict; and of
what each stream has had: its playback clock (lead and deadline) and its work so far.

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
``commit(id, end,      the chunk was answered with ``frames`` new frames that cost ``work``: its idle time
frames, work)``        counts from now, its playback clock and work move on; END ends the sequence (the
                       observer hears ``sequence_ended``; :meth:`recently_ended` lists it for a while)
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

What else is known of a live stream is the table's too, so nothing else keeps a copy: its playback clock
(``s3flow.engine.playback``: :meth:`deadline` for the scheduler, the lead each answer reports to the metrics) and
its work so far at full steps (:meth:`works`: what its demand is priced by, ``s3flow.serving.load``).

Example::

    table = SequenceTable(SequenceLimits(max_live_sequences=64, idle_timeout_s=5.0), observer)
    old = table.begin(7, state)          # START
    ...                                  # solve the chunk with state
    table.commit(7, end=False, frames=14, work=work)   # or table.rollback(7, old, started=True) if it failed
    table.deadline(7), table.works()
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, TypeVar

from s3flow.engine.capacity import Work
from s3flow.engine.observer import NO_OBSERVER, Observer
from s3flow.engine.playback import Delivered, Playback, PlaybackSettings
from s3flow.protocol import NumericSettings, RequestError, ServerBusy, UnknownSequence, check_numbers

State = TypeVar("State")

#: How long a sequence whose END was answered stays listed (:meth:`SequenceTable.recently_ended`: its last mel may
#: still be on its way to the vocoder, behind a queue)
ENDED_GRACE_S = 30.0
#: Why a state went before its END (the ``reason`` label of ``s3flow_sequences_dropped_total``).
DROP_REASONS = ("idle", "cancelled", "invalid END request", "failed START", "failed END", "error",
                "replaced by a new START", "utterance too long", "broken stream", "server stopping")
#: Drops whose request ended the sequence in Triton as well (an END), or that keep it in use (a new START on a
#: live id): no Triton slot to free (``s3flow.serving.triton_models.slots``).
_SLOT_ENDS_ANYWAY = ("replaced by a new START", "invalid END request", "failed END")


def releases_slot(reason: str) -> bool:
    """Whether a sequence dropped for ``reason`` (one of ``DROP_REASONS``) still holds its Triton slot."""
    return reason not in _SLOT_ENDS_ANYWAY


@dataclass
class SequenceLimits(NumericSettings):
    """What a stateful model holds: at most ``max_live_sequences`` states per instance (at most the batcher's
    ``max_candidate_sequences``); a state whose client has been quiet for ``idle_timeout_s`` seconds (counted
    from its last answer, never while one of its chunks is being served; Triton's own grace comes on top) is
    reclaimed. Each is a ``parameters`` entry of the model's config."""
    max_live_sequences: int = 64
    idle_timeout_s: float = 5.0

    def check(self) -> None:
        check_numbers(self, "sequence limit", lowest={})


@dataclass
class _Held(Generic[State]):
    """A sequence in the table: its state, its last answer's time (the idle clock), its playback clock, its work
    so far at full steps, and (between a START on a live id and its commit) the entry it replaced."""
    state: State
    answered: float
    playback: Playback
    work: Work = field(default_factory=Work)
    replaced: Optional["_Held"] = None


class SequenceTable(Generic[State]):
    """States keyed by correlation id, and what each stream has had (see the module docstring)."""

    def __init__(self, limits: SequenceLimits, observer: Observer = NO_OBSERVER,
                 clock: Callable[[], float] = time.monotonic,
                 pending: Optional[Callable[[object], bool]] = None,
                 playback: PlaybackSettings = PlaybackSettings()):
        """``pending(corr_id)``: whether a chunk of the sequence is on its way to the table: such a sequence is
        not idle however old its last answer (the solver: a request admission let through that has not reached
        it yet; the vocoder: a sequence the solver still holds; ``s3flow.serving.arrivals``). ``playback``: the
        players the streams' clocks assume. ``clock``: the time of idleness and playback alike."""
        self.limits, self.observer, self.clock = limits, observer, clock
        self.pending, self.playback = pending, playback
        self._held: OrderedDict[object, _Held[State]] = OrderedDict()
        self._in_flight: set = set()
        self._ended: OrderedDict[object, float] = OrderedDict()   # corr_id -> when its END was answered
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, corr_id) -> bool:
        return corr_id in self._held

    def ids(self) -> list:
        """The correlation ids held."""
        with self._lock:
            return list(self._held)

    def peek(self, corr_id) -> Optional[State]:
        """The state, if any, without serving it (tests, tools)."""
        held = self._held.get(corr_id)
        return None if held is None else held.state

    def begin(self, corr_id, state: State) -> Optional[State]:
        """A START: store ``state`` in flight, its playback clock started; return the live state it replaces, or
        None. Raises ServerBusy (with the seconds until a slot frees) when the table is full."""
        with self._lock:
            old = self._held.pop(corr_id, None)
            if len(self._held) >= self.limits.max_live_sequences:  # (never when it replaces one)
                if old is not None:
                    self._held[corr_id] = old
                wait = self._next_eviction_s()
                raise ServerBusy(f"too many live sequences ({len(self._held)}, max_live_sequences "
                                 f"{self.limits.max_live_sequences}); retry in {wait:.1f} s", retry_after_s=wait)
            now = self.clock()
            self._held[corr_id] = _Held(state, now, Playback(arrived=now), replaced=old)
            self._in_flight.add(corr_id)
            return None if old is None else old.state

    def serve(self, corr_id) -> State:
        """A later chunk's state, in flight until ``commit`` or ``rollback``."""
        with self._lock:
            held = self._held.get(corr_id)
            if held is None:
                raise UnknownSequence(f"sequence {corr_id} is not active: it never started with a START request, "
                                   f"already ended, or was evicted after {self.limits.idle_timeout_s} s idle")
            if corr_id in self._in_flight:   # a caller that serves a sequence's chunks in order never gets here
                raise RequestError(f"sequence {corr_id} already has a chunk in flight: send its chunks one at a time")
            self._held.move_to_end(corr_id)
            self._in_flight.add(corr_id)
            return held.state

    def commit(self, corr_id, end: bool, frames: int = 0, work: Optional[Work] = None) -> Delivered:
        """The chunk was answered with ``frames`` new frames, its solve costing ``work`` (at full steps): END ends
        the sequence, otherwise its idle time counts from now. Returns what the answer did to the stream's
        playback clock (its lead before it)."""
        with self._lock:
            self._in_flight.discard(corr_id)
            held = self._held.get(corr_id)
            if held is None:
                return Delivered()
            now = self.clock()
            held.replaced = None
            delivered = held.playback.delivered(frames, now, self.playback)
            if work is not None:
                held.work.add(work)
            if end:
                self._pop(corr_id)
                self._ended.pop(corr_id, None)   # (an id used again goes to the end: the oldest stay first)
                self._ended[corr_id] = now
                while self._ended and now - next(iter(self._ended.values())) > ENDED_GRACE_S:
                    self._ended.popitem(last=False)
            else:
                held.answered = now
        if end:
            self.observer.sequence_ended(corr_id)
        return delivered

    def rollback(self, corr_id, replaced: Optional[State], started: bool) -> None:
        """The chunk failed: a START's state goes and the entry it replaced (``replaced``: its state) comes back
        as it was; a later chunk's state stays as it was before the chunk."""
        with self._lock:
            self._in_flight.discard(corr_id)
            if started:
                held = self._held.pop(corr_id, None)
                old = held.replaced if held is not None else None
                if replaced is not None:
                    if old is None or old.state is not replaced:
                        now = self.clock()
                        old = _Held(replaced, now, Playback(arrived=now))
                    old.answered = self.clock()
                    self._held[corr_id] = old

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
            gone = [c for c in self._held if c not in self._in_flight]
        return [c for c in gone if self.end(c, reason)]

    def evict_idle(self) -> list:
        """Reclaim the states not in flight whose last answer is more than ``idle_timeout_s`` old and that
        have no chunk waiting in the queue (``pending``)."""
        with self._lock:
            now = self.clock()
            gone = [c for c, h in self._held.items()
                    if c not in self._in_flight and now - h.answered > self.limits.idle_timeout_s
                    and not self._queued(c)]
            for corr_id in gone:
                self._pop(corr_id)
        for corr_id in gone:
            self.observer.sequence_dropped(corr_id, "idle")
        return gone

    def next_eviction_s(self) -> float:
        """Seconds until the least recently answered state goes idle (the earliest a full table has room)."""
        with self._lock:
            return self._next_eviction_s()

    # -- what each stream has had ---------------------------------------------------------------------
    def deadline(self, corr_id) -> float:
        """When the stream's player needs its next frame (``s3flow.engine.playback``; the table's clock): now for a
        sequence not held (dropped while a chunk of it was being solved)."""
        with self._lock:
            held = self._held.get(corr_id)
            return self.clock() if held is None else held.playback.deadline(self.playback)

    def lead(self, corr_id, now: Optional[float] = None) -> float:
        """Seconds of audio the stream's player has in hand (0 before its first answer)."""
        with self._lock:
            return self._held[corr_id].playback.lead(self.clock() if now is None else now, self.playback)

    def works(self) -> dict:
        """corr_id -> a copy of the work (at full steps) of every stream held (``Work()``: nothing answered)."""
        with self._lock:
            return {c: dataclasses.replace(h.work) for c, h in self._held.items()}

    def recently_ended(self) -> list:
        """The sequences whose END was answered in the last ``ENDED_GRACE_S`` (not those dropped before it)."""
        with self._lock:
            now = self.clock()
            return [c for c, t in self._ended.items() if now - t <= ENDED_GRACE_S and c not in self._held]

    def _next_eviction_s(self) -> float:
        idle = [h.answered for c, h in self._held.items() if c not in self._in_flight]
        if not idle:
            return self.limits.idle_timeout_s + 0.1
        return max(0.0, min(idle) + self.limits.idle_timeout_s - self.clock()) + 0.1

    def _queued(self, corr_id) -> bool:
        return self.pending is not None and self.pending(corr_id)

    def _pop(self, corr_id) -> bool:
        return self._held.pop(corr_id, None) is not None
