"""Each stream's playback clock: how much audio it has in hand, and when it needs its next frame.

A streaming client plays audio at real time from its first audio (after a start-up buffer). The server does not
see the player, but it knows when it answered and how many frames it delivered, so it can keep the same clock:
a stream first answered at ``t0`` with ``frames`` delivered so far has a *lead* of ``frames / 50 - (now - t0)``
seconds (negative: a player that started then has run dry), and its player needs frame ``frames`` at
``t0 + buffer + frames / 50``: the stream's *deadline*. Before its first answer a stream's deadline is its
START's arrival plus the first-audio target. The scheduler (``s3flow.engine.scheduler``) orders chunks by this
deadline; the metrics (``s3flow_stream_lead_seconds``) report the lead.

Example::

    book = PlaybackBook(PlaybackSettings(start_buffer_s=0.3, first_audio_s=0.5))
    book.arrived(7, now)             # a START
    book.delivered(7, 14, now)       # its first answer: 14 frames
    book.deadline(7)                 # t0 + 0.3 + 14 / 50
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from s3flow_contract.tensors import FRAMES_PER_SECOND


@dataclass(frozen=True)
class PlaybackSettings:
    """``start_buffer_s``: audio a client's player holds before it starts playing; ``first_audio_s``: how soon
    after its START's arrival a stream should hear its first audio (the deadline of a START)."""
    start_buffer_s: float = 0.3
    first_audio_s: float = 0.5


@dataclass
class _Stream:
    arrived: float
    first: Optional[float] = None      # its first answer
    frames: int = 0                    # frames delivered


class PlaybackBook:
    def __init__(self, settings: PlaybackSettings = PlaybackSettings()):
        self.settings = settings
        self._streams: dict[object, _Stream] = {}

    def arrived(self, key, now: float) -> None:
        """A stream's START arrived (a restart on a live key starts its clock again)."""
        self._streams[key] = _Stream(arrived=now)

    def delivered(self, key, frames: int, now: float) -> Optional[float]:
        """An answer with ``frames`` new frames went out; returns the stream's lead after its first answer
        (None at the first answer, and for a stream never seen arriving: its clock starts now)."""
        s = self._streams.setdefault(key, _Stream(arrived=now))
        lead = None if s.first is None else self.lead(key, now)
        if s.first is None:
            s.first = now
        s.frames += int(frames)
        return lead

    def lead(self, key, now: float) -> float:
        """Seconds of audio a player started at the first answer has in hand now (before this answer)."""
        s = self._streams[key]
        return 0.0 if s.first is None else s.frames / FRAMES_PER_SECOND - (now - s.first)

    def deadline(self, key) -> float:
        """When the stream's player needs its next frame (the clock of ``arrived`` / ``delivered``)."""
        s = self._streams[key]
        if s.first is None:
            return s.arrived + self.settings.first_audio_s
        return s.first + self.settings.start_buffer_s + s.frames / FRAMES_PER_SECOND

    def forget(self, key) -> None:
        self._streams.pop(key, None)

    def __contains__(self, key) -> bool:
        return key in self._streams

    def __len__(self) -> int:
        return len(self._streams)
