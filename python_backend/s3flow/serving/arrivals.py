"""When requests arrived at the ensembles, for the models further down: per-server marks in shared memory.

The ensembles' first step (admission) sees every request arrive before Triton's sequence batcher queues it;
the solver and the vocoder are separate processes further down. Marks per correlation id cross between them, each
kind a table in shared memory (``s3flow.serving.mark_table``: opened once per process, read and written without a
system call):

* **starts** (``kind="starts"``): each admitted START. The vocoder takes the mark at the utterance's START and
  observes ``now - mark`` when its first samples beyond the silent start go out (``s3flow_first_audio_seconds``).
  A token2mel utterance never reaches a vocoder: its mark's slot is free again after ``RETAIN_S``.
* **gone** (``kind="gone"``): written by the solver, not admission: each sequence it dropped before its END, with
  why (``s3flow.serving.triton_models.slots``: Triton's slot is then freed, so a late chunk never reaches the
  solver; admission answers it with the solver's words).
* **vocoded** (``kind="vocoded"``): written by the vocoder, not admission: every answer it sends, counted. A
  ``token2wav`` stream's answer leaves the server from the vocoder, after a queue of its own (seen: over 5 s at
  32 streams at once on 2 cores), so the solver's idle clock for it counts from the vocoder's answer, not its
  own (:class:`Delivery`).
* **seen** (``kind="seen"``): every request, counted (:meth:`ArrivalMarks.count`: the sequence's requests since
  its START, and the last one's time). More requests counted than the solver instance has picked up means a
  chunk is on its way or waiting in Triton's queue: the sequence is not idle, whatever its last answer's age
  (``s3flow.engine.sequences.SequenceTable``'s ``pending``), so overload never evicts what it accepted. Unless
  the chunk will never come: a client that goes between admission and the solver cancels its request, and the
  ensemble, which checks cancellation between its steps, never sends it on. :class:`OnTheWay` tells the two
  apart by what the solver instance has seen of Triton's queue since.

Example::

    starts = ArrivalMarks(ArrivalMarks.default_folder("starts"))
    starts.mark(corr_id)              # admission, START admitted
    started = starts.take(corr_id)    # vocoder, START (None: not marked, e.g. the vocoder called directly)

    seen = ArrivalMarks(ArrivalMarks.default_folder("seen"))
    seen.count(corr_id, start=True)   # admission, every request it lets through
    on_the_way = OnTheWay(seen, slack_s=1.0)
    SequenceTable(capacity, on_the_way, pending=on_the_way.pending)   # solver: busy(), picked_up(), free()
"""
from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from s3flow.engine.observer import Observer
from s3flow.serving.mark_table import MarkTable
from s3flow.serving.records import server_folder

#: a request counted by admission and not seen by the solver this long after is taken for one that never comes
#: (its client cancelled it between the two), even while the solver never idles (overload)
MAX_TRANSIT_S = 60.0
#: the records kept as marks (``s3flow.serving.records``: their writers and readers)
KINDS = ("starts", "seen", "gone", "vocoded")
#: the table's file in a record's per-server folder, and the lock file of counts several processes make
TABLE, LOCK = "marks", ".lock"


class ArrivalMarks:
    def __init__(self, folder: Path, clock: Callable[[], float] = time.time, shared: bool = False):
        """``shared``: several processes count the same sequences (several admission instances): each count
        reads the last and writes the next under a lock file of their own (two system calls); else none."""
        self.folder, self.shared = Path(folder), shared
        self.table = MarkTable(self.folder / TABLE, clock)

    @staticmethod
    def default_folder(kind: str, server_pid: Optional[int] = None) -> Path:
        """The per-run folder of a server for ``kind`` (one of ``KINDS``)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return server_folder(kind, server_pid)

    def mark(self, corr_id: int, note: str = "") -> None:
        """Mark ``corr_id`` now, with an optional one-line ``note`` (:meth:`note` reads it back). A request outside
        any sequence (id 0: Triton's batcher refuses it further on) leaves no mark."""
        if corr_id:
            self.table.put(corr_id, note=note)

    def _live(self, corr_id: int):
        m = self.table.newest(corr_id)
        return None if m is None or m.cleared else m

    def peek(self, corr_id: int) -> Optional[float]:
        """The latest mark's time (wall clock), left in place; None when there is none."""
        m = self._live(corr_id)
        return None if m is None else m.time

    def note(self, corr_id: int) -> Optional[str]:
        """The latest mark's note ("" when it has none); None when there is no mark."""
        m = self._live(corr_id)
        return None if m is None else m.note

    def count(self, corr_id: int, start: bool) -> int:
        """Count one more request of ``corr_id`` (``start``: the first of a sequence, counted as 1) and mark its
        time. Returns the count."""
        if not self.shared:
            return self._count(corr_id, start)
        with open(self.folder / LOCK, "a") as lock:   # (not the table's file: claiming a lane locks that)
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
            return self._count(corr_id, start)

    def _count(self, corr_id: int, start: bool) -> int:
        counted = None if start else self.counted(corr_id)
        n = 1 if counted is None else counted[0] + 1
        if corr_id:   # (id 0: no sequence, no mark)
            self.table.put(corr_id, count=n)
        return n

    def counted(self, corr_id: int) -> Optional[tuple[int, float]]:
        """(requests counted since the START, the last one's time); None when the sequence has no count."""
        m = self._live(corr_id)
        return None if m is None or m.count <= 0 else (m.count, m.time)

    def close(self) -> None:
        """Let go of the table's mapping (a reader done with it; the writers keep theirs for the server's life)."""
        self.table.close()

    def take(self, corr_id: int) -> Optional[float]:
        """The latest mark's time (wall clock), the mark taken (no one reads it again); None when there is none."""
        m = self._live(corr_id)
        if m is None:
            return None
        self.table.put(corr_id, cleared=True)
        return m.time


class OnTheWay(Observer):
    """Whether a request that admission counted (``seen``) is still on its way to this solver instance.

    The instance counts the requests of each sequence it takes (:meth:`picked_up`, from its START); while
    admission has counted more, one is on its way however long it waits in Triton's queue (at overload, behind
    everything older: seen 5 s and more on 2 cores) and however the hops between admission and the batcher
    reorder requests (the earlier rule, "a request picked up that was marked more than 1 s after yours means yours
    is not coming", lost 21 of 32 token2wav streams at once that way). Only one that will never come is told
    apart: the instance has been free for ``slack_s`` since its mark (Triton hands a free instance whatever is
    queued for it within its queue delay; ``slack_s`` covers that, the hop from admission to the batcher and the
    order admission's instances count in), or ``max_transit_s`` has passed since (the instance never idles). An
    Observer of the sequence table: a sequence's count goes with its state.
    """

    def __init__(self, marks: ArrivalMarks, slack_s: float, wall: Callable[[], float] = time.time,
                 max_transit_s: float = MAX_TRANSIT_S):
        if slack_s <= 0:
            raise ValueError(f"slack_s must be > 0, got {slack_s}")
        self.marks, self.slack_s, self.wall, self.max_transit_s = marks, slack_s, wall, max_transit_s
        self._picked: dict[int, int] = {}            # corr_id -> requests picked up since its START
        self._horizon = float("-inf")
        self._free_since: Optional[float] = wall()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The sequences whose requests the instance counts (those it holds)."""
        return len(self._picked)

    def busy(self) -> None:
        """The instance starts on a batch of requests."""
        with self._lock:
            self._free_since = None

    def picked_up(self, requests: Iterable[tuple[int, bool]]) -> None:
        """These requests, (corr_id, START) each, reached the instance and are its own now: answered (``fifo``:
        a request picked up but not yet served must still count as on its way, or the reaper could take its
        sequence in the moment between) or queued where the table sees them (the stepped path). Not the
        solver's own requests, which never passed admission."""
        with self._lock:
            for corr_id, start in requests:
                self._picked[corr_id] = 1 if start else self._picked.get(corr_id, 0) + 1

    def free(self) -> None:
        """The instance answered what it had and is free for the next requests."""
        with self._lock:
            self._free_since = self.wall()

    def horizon(self) -> float:
        """Every request that arrived before this time (wall clock) has reached the instance."""
        with self._lock:
            now = self.wall()
            if self._free_since is not None and now - self._free_since >= self.slack_s:
                self._horizon = max(self._horizon, now - self.slack_s)
            return self._horizon

    def pending(self, corr_id: int) -> bool:
        """A request of the sequence that admission counted has not reached the instance and may still come
        (``SequenceTable``'s ``pending``)."""
        counted = self.marks.counted(corr_id)
        if counted is None:
            return False
        n, when = counted
        with self._lock:
            picked = self._picked.get(corr_id, 0)
        return n > picked and when >= self.horizon() and self.wall() - when < self.max_transit_s

    # -- the sequence table's reports: a sequence's count goes with its state ---------------------------------
    def sequence_ended(self, corr_id) -> None:
        with self._lock:
            self._picked.pop(corr_id, None)

    def sequence_dropped(self, corr_id, reason: str) -> None:
        self.sequence_ended(corr_id)


class Delivery(Observer):
    """Whether a stream's client may not have its latest answer yet, for the streams whose answers the solver
    sends on to the vocoder (``token2wav``): the client sends its next chunk when it hears the vocoder's answer,
    so the stream is not idle until ``idle_s`` after that, however long the vocoder's queue held the answer
    (``vocoded`` counts: the vocoder counts its answers from each START). The solver instance counts what it sent
    on (:meth:`answered`); an Observer of its sequence table, a stream's count goes with its state.

    An answer never vocoded is on its way no more when the vocoder that holds the stream has been seen with nothing
    queued for it ``slack_s`` after it was sent (``vocoder_free_at``, from the vocoder's load report: the start of a
    batch smaller than its max, or an idle spell, ``VocoderInstance.free_at``; the ensemble drops an answer whose
    client went, its request cancelled), or when it was sent
    before the vocoder serving now was made (``vocoders_since``: it died with its stub), or ``max_transit_s`` on.
    """

    def __init__(self, vocoded: ArrivalMarks, idle_s: float, wall: Callable[[], float] = time.time,
                 max_transit_s: float = MAX_TRANSIT_S, vocoders_since: Callable[[], Optional[float]] = lambda: None,
                 vocoder_free_at: Callable[[int], Optional[float]] = lambda corr_id: None, slack_s: float = 1.0):
        """``vocoders_since``: when the vocoder instances serving now were made (wall clock; None: unknown);
        ``vocoder_free_at(corr_id)``: when the vocoder instance holding the stream was last seen free (None:
        unknown); ``slack_s``: the ensemble's hop and the vocoder's queue delay (class docstring)."""
        if slack_s <= 0:
            raise ValueError(f"slack_s must be > 0, got {slack_s}")
        self.vocoded, self.idle_s, self.wall, self.max_transit_s = vocoded, idle_s, wall, max_transit_s
        self.vocoders_since, self.vocoder_free_at, self.slack_s = vocoders_since, vocoder_free_at, slack_s
        self._sent: dict[int, list] = {}       # corr_id -> [answers sent on since its START, START's time, last's]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sent)

    def answered(self, corr_id: int, start: bool) -> None:
        """The instance answered a chunk (not the END) whose answer goes on to the vocoder."""
        now = self.wall()
        with self._lock:
            sent = self._sent.get(corr_id) if not start else None
            if sent is None:
                self._sent[corr_id] = [1, now, now]
            else:
                sent[0] += 1
                sent[2] = now

    def pending(self, corr_id: int) -> bool:
        """An answer is still on its way through the vocoder (class docstring), or the vocoder's last answer is
        less than ``idle_s`` old."""
        with self._lock:
            sent = self._sent.get(corr_id)
            if sent is None:
                return False
            n_sent, started, last = sent
        counted = self.vocoded.counted(corr_id)
        n_vocoded, when = counted if counted is not None and counted[1] >= started else (0, float("-inf"))
        now = self.wall()
        if n_vocoded < n_sent:
            if now - last >= self.max_transit_s:
                return False
            since, free_at = self.vocoders_since(), self.vocoder_free_at(corr_id)
            if since is not None and last < since:   # lost with a vocoder that died (issue 53)
                return now - when < self.idle_s
            if free_at is not None and free_at >= last + self.slack_s:   # dropped on the way (its client went)
                return now - max(when, last) < self.idle_s
            return True
        return now - when < self.idle_s

    def sequence_ended(self, corr_id) -> None:
        with self._lock:
            self._sent.pop(corr_id, None)

    def sequence_dropped(self, corr_id, reason: str) -> None:
        self.sequence_ended(corr_id)
