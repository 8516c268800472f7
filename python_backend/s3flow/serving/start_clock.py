"""When each admitted START arrived, for the vocoder's first-audio histogram (``s3flow_first_audio_seconds``).

The ensembles' first step (admission) sees a START arrive; the vocoder, three steps later, sends its first
samples. They are separate processes, so admission leaves a mark per admitted START (a small file holding the
wall-clock time, in a per-server folder on ``/dev/shm``) and the vocoder takes it at the utterance's START: the
first audio of that utterance is then ``now - mark`` when its first samples beyond the silent start go out.
A token2mel utterance never reaches a vocoder: its mark is swept after ``MAX_AGE_S``.

Example::

    clock = StartClock(StartClock.default_folder())
    clock.mark(corr_id)              # admission, START admitted
    started = clock.take(corr_id)    # vocoder, START (None: not marked, e.g. the vocoder called directly)
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

MAX_AGE_S = 120.0
SWEEP_EVERY = 256


class StartClock:
    def __init__(self, folder: Path, clock: Callable[[], float] = time.time):
        self.folder, self.clock = Path(folder), clock
        self.folder.mkdir(parents=True, exist_ok=True)
        self._marks = 0

    @staticmethod
    def default_folder(server_pid: Optional[int] = None) -> Path:
        """The per-run folder of a server (its python models are its children)."""
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return Path(root) / f"s3flow-starts-{server_pid if server_pid is not None else os.getppid()}"

    def mark(self, corr_id: int) -> None:
        path = self.folder / str(int(corr_id))
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(f"{self.clock():.6f}\n")
        tmp.replace(path)
        self._marks += 1
        if self._marks % SWEEP_EVERY == 0:
            self.sweep()

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
