"""Each stream's playback clock: how much audio it has in hand, and when it needs its next frame.

A streaming client plays audio at real time from its first audio, after a start-up buffer. The server does not see
the player, but it knows when it answered and how many frames it delivered, so it keeps the same clock: a stream
first answered at ``t0`` with ``frames`` delivered so far needs frame ``frames`` at
``t0 + start_buffer_s + frames / 50``, its *deadline*, and has a *lead* of ``deadline - now`` seconds (negative:
a player that started then has run dry: a gap a listener hears). Before its first answer a stream's deadline is its
START's arrival plus the first-audio target.

The sequence table keeps one :class:`Playback` per stream (``s3flow.engine.sequences``: the one owner of a
stream's life and lead); the scheduler (``s3flow.engine.scheduler``) orders chunks by the deadline, the metrics
publish the lead at each answer (``s3flow_stream_lead_seconds``).

Example::

    settings = PlaybackSettings(start_buffer_s=0.3, first_audio_s=0.5)
    clock = Playback(arrived=10.0)
    clock.deadline(settings)                 # 10.5
    clock.delivered(14, 10.2, settings)      # its first answer: 14 frames
    clock.deadline(settings)                 # 10.2 + 0.3 + 14 / 50
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


@dataclass(frozen=True)
class Delivered:
    """What an answer did to its stream's clock: its ``lead`` just before (None at the first answer: the player
    starts from it), and whether the player ran dry there for the first time (``went_dry``)."""
    lead: Optional[float] = None
    went_dry: bool = False


@dataclass
class Playback:
    """One stream's clock (module docstring)."""
    arrived: float                     # its START's arrival
    first: Optional[float] = None      # its first answer
    frames: int = 0                    # frames delivered
    ran_dry: bool = False              # its player has run dry once

    def deadline(self, settings: PlaybackSettings) -> float:
        """When the stream's player needs its next frame."""
        if self.first is None:
            return self.arrived + settings.first_audio_s
        return self.first + settings.start_buffer_s + self.frames / FRAMES_PER_SECOND

    def lead(self, now: float, settings: PlaybackSettings) -> float:
        """Seconds of audio its player has in hand at ``now`` (0 before the first answer)."""
        return 0.0 if self.first is None else self.deadline(settings) - now

    def delivered(self, frames: int, now: float, settings: PlaybackSettings) -> Delivered:
        """An answer with ``frames`` new frames went out at ``now``."""
        if self.first is None:
            self.first, self.frames = now, int(frames)
            return Delivered()
        lead = self.lead(now, settings)
        went_dry = lead < 0 and not self.ran_dry
        self.ran_dry = self.ran_dry or lead < 0
        self.frames += int(frames)
        return Delivered(lead, went_dry)
