"""When requests arrived at the ensembles, for the models further down: per-server marks on ``/dev/shm``.

The ensembles' first step (admission) sees every request arrive before Triton's sequence batcher queues it;
the solver and the vocoder are separate processes further down. Admission leaves a mark per correlation id
(a small file holding the wall-clock time) in two per-server folders:

* **starts** (``kind="starts"``): each admitted START. The vocoder takes the mark at the utterance's START and
  observes ``now - mark`` when its first samples beyond the silent start go out (``s3flow_first_audio_seconds``).
  A token2mel utterance never reaches a vocoder: its mark is swept after ``MAX_AGE_S``.
* **seen** (``kind="seen"``): every request. A mark newer than the time the solver last picked up a chunk of
  that sequence means a chunk is waiting in Triton's queue: the sequence is not idle, whatever its last answer's
  age (``s3flow.engine.sequences.SequenceTable``'s ``waiting``), so overload never evicts what it accepted.

Example::

    starts = ArrivalMarks(ArrivalMarks.default_folder("starts"))
    starts.mark(corr_id)              # admission, START admitted
    started = starts.take(corr_id)    # vocoder, START (None: not marked, e.g. the vocoder called directly)
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

MAX_AGE_S = 600.0
SWEEP_EVERY = 256


class ArrivalMarks:
    def __init__(self, folder: Path, clock: Callable[[], float] = time.time):
        self.folder, self.clock = Path(folder), clock
        self.folder.mkdir(parents=True, exist_ok=True)
        self._marks = 0

    @staticmethod
    def default_folder(kind: str, server_pid: Optional[int] = None) -> Path:
        """The per-run folder of a server for ``kind`` ("starts" or "seen"; its python models are its children)."""
        if kind not in ("starts", "seen"):
            raise ValueError(f"kind must be 'starts' or 'seen', got {kind!r}")
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return Path(root) / f"s3flow-{kind}-{server_pid if server_pid is not None else os.getppid()}"

    def mark(self, corr_id: int) -> None:
        path = self.folder / str(int(corr_id))
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(f"{self.clock():.6f}\n")
        tmp.replace(path)
        self._marks += 1
        if self._marks % SWEEP_EVERY == 0:
            self.sweep()

    def peek(self, corr_id: int) -> Optional[float]:
        """The latest mark's time (wall clock), left in place; None when there is none."""
        try:
            return float((self.folder / str(int(corr_id))).read_text())
        except (OSError, ValueError):
            return None

    def take(self, corr_id: int) -> Optional[float]:
        """The START's arrival time (wall clock), removing the mark; None when there is none."""
        path = self.folder / str(int(corr_id))
        try:
            value = float(path.read_text())
            path.unlink(missing_ok=True)
            return value
        except (OSError, ValueError):
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
