"""How many tokens the next chunk of an utterance takes: planned in advance, or chosen live.

The output depends on the chunk boundaries (each chunk is solved with its own context), so whatever chooses
them, the client records the sizes it sent (``UtteranceState.sizes``) and a resume replays exactly those.

* ``PlannedChunks``: sizes fixed before the first send (``chunk_schedule``, or ``Utterance.chunks``): every
  token is in hand, as in ``StreamingClient.synthesize``.
* ``LiveChunks``: tokens arrive while the utterance streams (a text-to-token model emits them). The first
  chunk is small (``first`` tokens: fast first audio); later ones grow toward the schedule (10, 20, 40, 80,
  100) while the audio in hand ahead of playback covers the wait for the missing tokens plus the server's
  latency; otherwise the chunk takes what exists now (at least ``least`` tokens). It never waits for tokens
  when the stream has ended, and says when to look again if nothing new arrives (``Decision.recheck_s``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def chunk_schedule(n_tokens: int, first: int = 10, growth: float = 2.0, largest: int = 100) -> list[int]:
    """Chunk sizes summing to n_tokens: a small first chunk (fast first audio), then growing ones."""
    if first < 1 or largest < first or growth < 1:
        raise ValueError(f"need 1 <= first <= largest and growth >= 1, got {first}, {largest}, {growth}")
    sizes, size, left = [], float(first), n_tokens
    while left > 0:
        take = min(int(size), left)
        sizes.append(take)
        left -= take
        size = min(size * growth, largest)
    return sizes


@dataclass(frozen=True)
class Decision:
    """``size``: tokens the next chunk takes now (None: wait); ``recheck_s``: decide again after this long
    even if no token arrives (None: only on the next token)."""
    size: Optional[int]
    recheck_s: Optional[float] = None


@dataclass(frozen=True)
class Situation:
    """What a chunking decision sees. ``available``: tokens pushed and not yet sent; ``ended``: no more will
    come; ``index``: the chunk's number; ``lead_s``: audio delivered and not yet played (seconds; playback
    starts at the first delivered frame); ``latency_s``: the server's latest chunk latency (None before the
    first); ``token_rate``: tokens per second arriving lately (None: unknown)."""
    available: int
    ended: bool
    index: int
    lead_s: float = 0.0
    latency_s: Optional[float] = None
    token_rate: Optional[float] = None


class PlannedChunks:
    def __init__(self, sizes: list[int]):
        if min(sizes, default=1) < 0:
            raise ValueError(f"chunk sizes must be >= 0, got {sizes}")
        self.sizes = list(sizes)

    def decide(self, s: Situation) -> Decision:
        want = self.sizes[s.index] if s.index < len(self.sizes) else s.available
        if s.available >= want or s.ended:
            return Decision(min(want, s.available))
        return Decision(None)


@dataclass
class LiveChunks:
    first: int = 10
    growth: float = 2.0
    largest: int = 100
    least: int = 4
    #: audio kept in hand beyond the server's latency before a chunk may wait for more tokens (seconds)
    margin_s: float = 0.3

    def __post_init__(self):
        if not 1 <= self.least <= self.first <= self.largest or self.growth < 1:
            raise ValueError(f"need 1 <= least <= first <= largest and growth >= 1, got {self}")

    def target(self, index: int) -> int:
        return int(min(self.largest, self.first * self.growth ** index))

    def decide(self, s: Situation) -> Decision:
        want = self.target(s.index)
        if s.available >= want:
            return Decision(want)
        if s.ended:
            return Decision(s.available)
        if s.index == 0 or s.available < self.least:
            return Decision(None)  # the first chunk (or a crumb): wait for its tokens
        latency = s.latency_s if s.latency_s is not None else 0.0
        spare = s.lead_s - latency - self.margin_s     # how long playback survives without this chunk's audio
        if spare <= 0:
            return Decision(s.available)
        if s.token_rate:
            missing_s = (want - s.available) / s.token_rate
            if missing_s > spare:
                return Decision(s.available)  # the rest of the chunk would come too late
        return Decision(None, recheck_s=spare)
