"""When requests arrived at the ensembles, for the models further down: per-server marks on ``/dev/shm``.

The ensembles' first step (admission) sees every request arrive before Triton's sequence batcher queues it;
the solver and the vocoder are separate processes further down. Admission leaves a mark per correlation id
(a small file holding the wall-clock time) in two per-server folders:

* **starts** (``kind="starts"``): each admitted START. The vocoder takes the mark at the utterance's START and
  observes ``now - mark`` when its first samples beyond the silent start go out (``s3flow_first_audio_seconds``).
  A token2mel utterance never reaches a vocoder: its mark is swept after ``MAX_AGE_S``.
* **gone** (``kind="gone"``): written by the solver, not admission: each sequence it dropped before its END, with
  why (``s3flow.serving.triton_models.slots``: Triton's slot is then freed, so a late chunk never reaches the
  solver; admission answers it with the solver's words).
* **seen** (``kind="seen"``): every request. A mark newer than the time the solver last picked up a chunk of
  that sequence means a chunk is waiting in Triton's queue: the sequence is not idle, whatever its last answer's
  age (``s3flow.engine.sequences.SequenceTable``'s ``pending``), so overload never evicts what it accepted.
  Unless the chunk will never come: a client that goes between admission and the solver cancels its request,
  and the ensemble, which checks cancellation between its steps, never sends it on. :class:`OnTheWay` tells the
  two apart by what the solver instance has seen of Triton's queue since.

Example::

    starts = ArrivalMarks(ArrivalMarks.default_folder("starts"))
    starts.mark(corr_id)              # admission, START admitted
    started = starts.take(corr_id)    # vocoder, START (None: not marked, e.g. the vocoder called directly)

    on_the_way = OnTheWay(ArrivalMarks(ArrivalMarks.default_folder("seen")), slack_s=1.0)
    SequenceTable(capacity, pending=on_the_way.pending)   # solver; execute() calls picking_up() and free()
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

MAX_AGE_S = 600.0
SWEEP_EVERY = 256
#: the per-server folders (module docstring); "gone": sequences a model dropped before their END, with why
KINDS = ("starts", "seen", "gone")


#: every per-server folder: the marks' kinds, "live" (``s3flow.serving.admission.LiveCounts``), "load"
#: (``s3flow.serving.load.LoadFiles``) and "voices" (``s3flow.serving.voice_registry``, unless ``voice_dir``)
SERVER_FOLDERS = ("live", "load", "voices") + KINDS


def server_folder(name: str, server_pid: Optional[int] = None) -> Path:
    """``/dev/shm/s3flow-<name>-<server pid>``: a folder the python models of one server share (they are its
    children: the default PID is our parent's). ``s3flow.server.leftovers`` removes them."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(root) / f"s3flow-{name}-{server_pid if server_pid is not None else os.getppid()}"


class ArrivalMarks:
    def __init__(self, folder: Path, clock: Callable[[], float] = time.time):
        self.folder, self.clock = Path(folder), clock
        self.folder.mkdir(parents=True, exist_ok=True)
        self._marks = 0

    @staticmethod
    def default_folder(kind: str, server_pid: Optional[int] = None) -> Path:
        """The per-run folder of a server for ``kind`` (one of ``KINDS``)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return server_folder(kind, server_pid)

    def mark(self, corr_id: int, note: str = "") -> None:
        """Mark ``corr_id`` now, with an optional one-line ``note`` (:meth:`note` reads it back)."""
        path = self.folder / str(int(corr_id))
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(f"{self.clock():.6f} {note}".rstrip() + "\n")
        tmp.replace(path)
        self._marks += 1
        if self._marks % SWEEP_EVERY == 0:
            self.sweep()

    def peek(self, corr_id: int) -> Optional[float]:
        """The latest mark's time (wall clock), left in place; None when there is none."""
        try:
            return float((self.folder / str(int(corr_id))).read_text().split(maxsplit=1)[0])
        except (OSError, ValueError, IndexError):
            return None

    def note(self, corr_id: int) -> Optional[str]:
        """The latest mark's note ("" when it has none); None when there is no mark."""
        try:
            fields = (self.folder / str(int(corr_id))).read_text().split(maxsplit=1)
        except OSError:
            return None
        return fields[1].strip() if len(fields) > 1 else ("" if fields else None)

    def take(self, corr_id: int) -> Optional[float]:
        """The START's arrival time (wall clock), removing the mark; None when there is none."""
        path = self.folder / str(int(corr_id))
        try:
            value = float(path.read_text().split(maxsplit=1)[0])
            path.unlink(missing_ok=True)
            return value
        except (OSError, ValueError, IndexError):
            return None

    def sweep(self) -> int:
        """Remove marks older than MAX_AGE_S (utterances no vocoder took); returns how many."""
        gone, now = 0, self.clock()
        for path in self.folder.iterdir():
            try:
                if now - path.stat().st_mtime > MAX_AGE_S:
                    path.unlink(missing_ok=True)
                    gone += 1
            except OSError:
                continue
        return gone


class OnTheWay:
    """Whether a request that admission marked (``seen``) is still on its way to this solver instance.

    Triton hands a free instance the oldest requests queued for it (after at most its queue delay), so the
    instance learns up to when every request has reached it (the *horizon*): up to the arrival of any request it
    picks up (later arrivals queue behind earlier ones), and, once it has been free for ``slack_s``, up to
    ``slack_s`` ago. ``slack_s`` covers the batcher's queue delay, the hop from admission to the batcher and the
    order in which admission's instances mark. A mark older than the horizon belongs to a request that will
    never come (cancelled between admission and the solver) and keeps nothing; a newer one keeps its sequence
    however long it waits.
    """

    def __init__(self, marks: ArrivalMarks, slack_s: float, wall: Callable[[], float] = time.time):
        if slack_s <= 0:
            raise ValueError(f"slack_s must be > 0, got {slack_s}")
        self.marks, self.slack_s, self.wall = marks, slack_s, wall
        self._horizon = float("-inf")
        self._free_since: Optional[float] = wall()
        self._lock = threading.Lock()

    def picking_up(self, corr_ids: Iterable[int]) -> None:
        """The instance starts on requests of these sequences (each one's latest mark is its arrival)."""
        arrived = [a for a in (self.marks.peek(c) for c in corr_ids) if a is not None]
        with self._lock:
            self._free_since = None
            if arrived:
                self._horizon = max(self._horizon, max(arrived) - self.slack_s)

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

    def pending(self, corr_id: int, picked_at: float) -> bool:
        """A request of the sequence arrived after ``picked_at`` (when its last chunk was picked up) and may still
        come (``SequenceTable``'s ``pending``)."""
        seen = self.marks.peek(corr_id)
        return seen is not None and seen > picked_at and seen >= self.horizon()
