"""One kind of per-sequence mark shared between a server's processes: a fixed-layout table in one shared-memory
file, opened once per process, read and written without a system call.

A mark is (corr_id, time, count, note, cleared): admission marks each admitted START (``starts``) and counts every
request it lets through (``seen``), the solver marks the sequences it dropped (``gone``), the vocoder counts its
answers (``vocoded``) (``s3flow.serving.arrivals``; ``s3flow.serving.records`` is the schema). They were a small
file per sequence, rewritten whole at every chunk: two to three system calls a mark and one a read, 6 of the 14
a token2wav chunk cost on the records (issue 49, results/syscalls.md).

Layout. The file (``marks`` in the record's per-server folder) holds ``LANES`` lanes of ``SLOTS`` slots. A lane
has one writer, the process whose PID its header holds (claimed at its first write, under an ``flock`` taken that
once, from a lane that is free or whose writer died), so no write needs a lock; every process reads every lane. A
slot is ``corr_id (u64) | time (f64) | count (i64) | flags (u64) | note length (u64) | note (NOTE_BYTES)``, found
by open addressing from a hash of the id (``PROBES`` slots at most; 0: never used). A writer fills a new slot's
fields before its id and updates a mark's count before its time, each an aligned 8-byte store, so a reader sees a
mark whole or as it was (on x86-64, the hosts this serves; a count read with an older time is harmless to its
readers: both only move forward). A slot older than ``RETAIN_S`` is free again: a mark's readers are done with
it within ``MAX_TRANSIT_S`` of its time (``s3flow.serving.arrivals``).

The newest mark of an id over all lanes is its mark: a process that *takes* a mark (the vocoder a START's, a new
START a gone mark) writes a cleared mark into its own lane, newer than the one it took.

Example::

    table = MarkTable(server_folder("seen") / "marks")
    table.put(7, count=1)               # this process's lane
    table.newest(7)                     # Mark(time=..., count=1, note='', cleared=False), from any process
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from s3flow.serving.records import map_region, writer_alive

LANES, SLOTS, PROBES, NOTE_BYTES = 8, 4096, 32, 56
#: a mark older than this is no one's any more (its readers look 60 s back at most): its slot is free again
RETAIN_S = 120.0
MAGIC = 0x53334D41524B5331   # "S3MARKS1": this layout
_HEADER = struct.Struct("<QQQQ")                 # magic, lanes, slots, note bytes (``map_region``)
_LANE = struct.Struct("<q")                      # the lane's writer PID (0: free)
_SLOT = struct.Struct(f"<QdqQQ{NOTE_BYTES}s")    # corr_id, time, count, flags, note length, note
_CLEARED = 1
_TOMB = (1 << 64) - 1                            # a slot that was used (lookups go on past it)
_LANES_AT = _HEADER.size
_SLOTS_AT = _LANES_AT + LANES * _LANE.size
SIZE = _SLOTS_AT + LANES * SLOTS * _SLOT.size


@dataclass(frozen=True)
class Mark:
    """An id's newest mark: when (wall clock), its count, its note, and whether it was taken (cleared)."""
    time: float
    count: int
    note: str
    cleared: bool


def _home(corr_id: int) -> int:
    return ((corr_id * 0x9E3779B97F4A7C15) & _TOMB) >> 52 & (SLOTS - 1)


class MarkTable:
    """One kind's marks (module docstring). Thread-safe within a process (its lane's writes are serialised)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time, retain_s: float = RETAIN_S):
        self.path, self.clock, self.retain_s = Path(path), clock, retain_s
        self._map, self._view = map_region(self.path, SIZE, (MAGIC, LANES, SLOTS, NOTE_BYTES), "marks")
        self._lane: Optional[int] = None
        self._lock = threading.Lock()

    # -- reading: every lane ------------------------------------------------------------------------------
    def newest(self, corr_id: int) -> Optional[Mark]:
        """The newest mark of ``corr_id`` over all lanes (cleared ones included); None when there is none (an id no
        mark can have, 0 included: a request outside any sequence)."""
        corr_id = int(corr_id)
        if not 0 < corr_id < _TOMB:
            return None
        best = None
        for lane in range(LANES):
            if _LANE.unpack_from(self._view, _LANES_AT + lane * _LANE.size)[0] == 0:
                continue
            slot = self._find(lane, corr_id)
            if slot is None:
                continue
            _, when, count, flags, n, note = _SLOT.unpack_from(self._view, slot)
            if best is None or when > best.time:
                best = Mark(when, count, note[:n].decode(errors="replace"), bool(flags & _CLEARED))
        return best

    def _find(self, lane: int, corr_id: int) -> Optional[int]:
        """The offset of ``corr_id``'s slot in ``lane``; None when it has none."""
        base, home = _SLOTS_AT + lane * SLOTS * _SLOT.size, _home(corr_id)
        for k in range(PROBES):
            at = base + ((home + k) & (SLOTS - 1)) * _SLOT.size
            found = struct.unpack_from("<Q", self._view, at)[0]
            if found == corr_id:
                return at
            if found == 0:
                return None
        return None

    # -- writing: this process's lane ---------------------------------------------------------------------
    def put(self, corr_id: int, count: int = 0, note: str = "", cleared: bool = False) -> None:
        """Mark ``corr_id`` now in this process's lane (its earlier mark there replaced)."""
        corr_id = int(corr_id)
        if not 0 < corr_id < _TOMB:
            raise ValueError(f"corr_id must be in 1..2**64-2, got {corr_id}")
        data = note.encode()[:NOTE_BYTES]
        with self._lock:
            lane = self._own_lane()
            at = self._slot_for(lane, corr_id)
            flags = _CLEARED if cleared else 0
            if struct.unpack_from("<Q", self._view, at)[0] == corr_id:   # an update: the count before the time
                struct.pack_into("<qQQ", self._view, at + 16, count, flags, len(data))
                struct.pack_into(f"<{NOTE_BYTES}s", self._view, at + 40, data)
                struct.pack_into("<d", self._view, at + 8, self.clock())
            else:   # a new slot: its fields (its id a tombstone meanwhile: lookups go on past it), then its id
                _SLOT.pack_into(self._view, at, _TOMB, self.clock(), count, flags, len(data), data)
                struct.pack_into("<Q", self._view, at, corr_id)

    def _slot_for(self, lane: int, corr_id: int) -> int:
        """``corr_id``'s slot in ``lane``: its own, else the first free one on its probe path (never used, or
        older than ``retain_s``), else the oldest there (the table is full: the oldest mark goes)."""
        base, home, now = _SLOTS_AT + lane * SLOTS * _SLOT.size, _home(corr_id), self.clock()
        free = oldest = None
        oldest_time = float("inf")
        for k in range(PROBES):
            at = base + ((home + k) & (SLOTS - 1)) * _SLOT.size
            found, when = struct.unpack_from("<Qd", self._view, at)
            if found == corr_id:
                return at
            if found == 0:
                return at if free is None else free
            if free is None and (found == _TOMB or now - when > self.retain_s):
                free = at
            if when < oldest_time:
                oldest, oldest_time = at, when
        if free is None:
            free = oldest
        struct.pack_into("<Q", self._view, free, _TOMB)   # (readers go on past it while it is refilled)
        return free

    def _own_lane(self) -> int:
        """This process's lane, claimed at its first write: one whose writer is this process, else a free one or
        one whose writer died (cleared first), under the file's lock (the only system calls a writer makes)."""
        pid = os.getpid()
        if self._lane is not None:
            return self._lane
        with open(self.path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)   # released when the file closes
            owners = [_LANE.unpack_from(self._view, _LANES_AT + k * _LANE.size)[0] for k in range(LANES)]
            if pid in owners:
                lane = owners.index(pid)
            else:
                free = [k for k, p in enumerate(owners) if p == 0] or \
                    [k for k, p in enumerate(owners) if not writer_alive(p)]
                if not free:
                    raise RuntimeError(f"{self.path}: all {LANES} lanes have a live writer")
                lane = free[0]
                if owners[lane] != 0:   # a dead writer's marks: its readers are done with them
                    base = _SLOTS_AT + lane * SLOTS * _SLOT.size
                    self._view[base:base + SLOTS * _SLOT.size] = bytes(SLOTS * _SLOT.size)
                _LANE.pack_into(self._view, _LANES_AT + lane * _LANE.size, pid)
        self._lane = lane
        return lane

    def close(self) -> None:
        self._view.release()
        self._map.close()
